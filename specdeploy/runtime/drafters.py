"""Drafters propose tokens for the target to verify: a draft model, a suffix index, prompt lookup, or none.

A drafter is a proposer (``propose``, ``rollback``): it reads the batch's rows through a narrow view
(``rows.BatchView``: arrays, settings and generators in batch order) and, for a draft model, the draft's cache
(``engines.base.KVCache``, owned by the generation with the batch's other rows), and returns a ``Proposal``. What a
drafter can do is declared: ``uses_model`` (it has a draft model and its cache), ``looks_up`` (it drafts without a
model call: by prompt lookup, or from a suffix index where it ``indexes``). How many drafts each source makes is the
policy's choice (``k``, ``lookup_k``, and for index drafts each row's own count by ``price``: ``Policy.free_drafts``);
each row drafts at most ``caps[b]`` (its own k and tokens left).

The default, ``HybridDrafter``, drafts from the suffix index where the policy prices its drafts above the draft
model's, and by the draft model elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..engines.base import Engine, KVCache, feed
from .errors import ConfigError
from .policies import CycleOutcome, Policy
from .rows import BatchView, RowResult
from .sampling import keyed_token, penalize, row_probabilities, sample
from .suffix import LEVELS, SuffixIndex, propose

# (batch, a row's index drafts' estimates, whether the model drafts the other rows) -> how many of them to verify
Price = Callable[[int, list[float], bool], int]


@dataclass(slots=True)
class Proposal:
    """One cycle's drafts. A row's drafts beyond ``drafted[b]`` only fill its row (never kept)."""

    drafts: np.ndarray  # [batch, width] int64; a model drafter's: a view of its buffer, valid until its next proposal
    q: np.ndarray | None  # [batch, width, vocab] proposal distributions; None: deterministic (one-hot)
    drafted: list[int]  # [batch] drafts row b really has
    lookup: list[bool] = field(default_factory=list)  # [batch] row b's drafts came from prompt lookup
    seconds: float = 0.0  # drafting: engine calls and their bookkeeping
    first_call_seconds: float = 0.0  # the first draft call, which feeds what the draft had not seen
    first_call_tokens: int = 0  # tokens a row that first call fed (the widest row's lag)
    later_calls: int = 0  # draft calls after the first
    later_call_seconds: float = 0.0
    estimates: list[list[float] | None] | None = None  # [batch] an index row's estimate of each draft (else None)
    origins: list[str | None] | None = None  # [batch] the request whose text an index row's drafts follow

    def outcome(self, accepted: list[int], verify_seconds: float) -> CycleOutcome:
        """What the policy hears of the cycle these drafts were verified in: ``accepted`` drafts per row, the target's
        call over K + 1 tokens a row in ``verify_seconds``."""
        return CycleOutcome(len(self.drafted), self.drafted, accepted, self.lookup, self.first_call_seconds,
                            self.first_call_tokens, self.later_call_seconds, self.later_calls, verify_seconds,
                            self.drafts.shape[1] + 1, self.estimates)

    @classmethod
    def none(cls, batch: int) -> Proposal:
        """No drafts: the cycle is a plain decoding step."""
        return cls(np.zeros((batch, 0), np.int64), None, [0] * batch, [False] * batch)


class Drafter:
    """Proposes drafts after each row's committed tokens. Without drafts (``NoDrafter``): plain decoding."""

    uses_model = False
    looks_up = False
    indexes = False

    def __init__(self, engine: Engine | None = None, stop_below: float | None = None, max_ngram: int = 3,
                 min_ngram: int = 1):
        # stop_below: a model row stops drafting once the draft's top probability falls below it (None: never);
        # n-grams: prompt lookup continues the latest earlier match of the last n tokens, the longest n first
        self.engine, self.stop_below, self.max_ngram, self.min_ngram = engine, stop_below, max_ngram, min_ngram
        self._buffer: tuple | None = None  # a model drafter's drafts (``ModelDrafter._columns``)
        self._own: dict[int, tuple] = {}  # an index drafter's: (a request's result, an index of its text), by id(result)
        self._found_facts: tuple[list, list] | None = None  # the last ``_found``'s estimates and origins
        self.price: Price | None = None  # an index drafter's: how many of a row's drafts to keep (None: all)

    def plan(self, policy: Policy, batch: int, most: int) -> tuple[int, int]:
        """This cycle's (model drafts, free drafts) a row, as ``policy`` prices the sources this drafter has (index
        drafts by ``index_k``, lookup by ``next_k(lookup=True)``, the model by ``next_k``), at most ``most`` each."""
        free = policy.index_k(batch) if self.indexes else policy.next_k(batch, lookup=True) if self.looks_up else 0
        return (min(policy.next_k(batch), most) if self.uses_model else 0), min(free, most)

    def priced_by(self, price: Price | None) -> None:
        """Index drafts are kept as ``price`` says (the generation's policy's ``free_drafts``; None: all found)."""
        self.price = price

    def propose(self, state: BatchView, cache: KVCache | None, k: int, lookup_k: int, caps: list[int]) -> Proposal:
        """Up to ``k`` model drafts or ``lookup_k`` free drafts a row, row b at most ``caps[b]``; an index drafter
        keeps of a row's drafts what its ``price`` says (``priced_by``), from their estimates."""
        return Proposal.none(state.batch)

    def rollback(self, cache: KVCache | None, lengths: list[int]) -> None:
        """Tokens x[0:lengths[b]] stand (the verified prefix); anything the draft saw beyond them is forgotten."""
        if cache is not None:
            cache.commit([min(seen, length) for seen, length in zip(cache.past_len.tolist(), lengths)])

    def behind(self, state: BatchView, cache: KVCache | None) -> int:
        """Tokens (all rows together) the draft model must catch up on before drafting, beyond the one or two a
        drafting cycle leaves it: prompts it never saw, plain cycles since it last drafted."""
        if cache is None:
            return 0
        return sum([max(0, length - 2 - past) for length, past in zip(state.lengths, cache.past_len.tolist())])


class NoDrafter(Drafter):
    """Plain target decoding: the baseline."""


class PromptLookup(Drafter):
    """Prompt lookup (n-gram) drafting, like transformers' ``prompt_lookup_num_tokens``: no model, proposals are
    deterministic (q one-hot: sampling verification keeps a draft d with probability p(d))."""

    looks_up = True

    def propose(self, state: BatchView, cache: KVCache | None, k: int, lookup_k: int, caps: list[int]) -> Proposal:
        began = time.perf_counter()
        found = self._free(state, lookup_k, caps, False)
        width = max(map(len, found))
        if not width:
            return Proposal.none(state.batch)
        drafts = np.empty((state.batch, width), np.int64)
        for b, cont in enumerate(found):
            _fill(drafts[b], cont, state.tokens[b, state.lengths[b] - 1])
        return self._facts(Proposal(drafts, None, list(map(len, found)), [len(f) > 0 for f in found],
                                    time.perf_counter() - began))

    def _free(self, state: BatchView, lookup_k: int, caps: list[int], model: bool) -> list[np.ndarray]:
        """Each row's free drafts (``_found``); an index drafter's cut to what ``price`` keeps of them, the draft
        model drafting the other rows where ``model``."""
        self._found_facts = None
        found, price = self._found(state, lookup_k, caps), self.price
        if self._found_facts is not None and price is not None:
            estimates, origins = self._found_facts
            keep = [price(state.batch, row, model) if len(row) else 0 for row in estimates]
            found = [cont[:n] for cont, n in zip(found, keep)]
            self._found_facts = ([row[:n] or None for row, n in zip(estimates, keep)],
                                 [origin if n else None for origin, n in zip(origins, keep)])
        return found

    def _facts(self, proposal: Proposal) -> Proposal:
        """``proposal`` with what the index said of its rows' drafts (their estimates and origins), if anything."""
        if self._found_facts is not None:
            proposal.estimates, proposal.origins = self._found_facts
        return proposal

    def _found(self, state: BatchView, lookup_k: int, caps: list[int]) -> list[np.ndarray]:
        return [lookup(state.tokens[b, :length], min(lookup_k, cap), self.max_ngram, self.min_ngram)
                for b, (length, cap) in enumerate(zip(state.lengths, caps))]


class SuffixDrafter(PromptLookup):
    """Drafts from a suffix index (``suffix``) over each request's own text (its prompt and committed tokens) and the
    texts of earlier requests in its scope (``RowSettings.index``; None: its own text alone). No model call; the
    drafts are deterministic (q one-hot), and a row's read its own text and its scope alone, never its batch mates'.
    Each row's proposal carries the index's estimate of each draft, which the policy prices (``price``)."""

    looks_up = indexes = True

    def _found(self, state: BatchView, lookup_k: int, caps: list[int]) -> list[np.ndarray]:
        found, estimates, origins = [], [], []
        for b, (length, cap, (row, shared)) in enumerate(zip(state.lengths, caps, state.scopes)):
            own = self._own_text(state, b, row, length)
            context = state.tokens[b, max(0, length - LEVELS[0]) : length].tolist()
            drafts, estimate, origin = propose((own, shared) if shared is not None else (own,), context,
                                               min(lookup_k, cap))
            if shared is not None and origin is not None:
                shared.touch(origin)  # drafted from: the last of the shared texts to be evicted
            found.append(np.array(drafts, np.int64))
            estimates.append(estimate)
            origins.append(origin)
        if len(self._own) > 2 * state.batch + 8:  # requests that left: their text goes with them
            live = {id(row) for row, _ in state.scopes}
            self._own = {key: index for key, index in self._own.items() if key in live}
        self._found_facts = estimates, origins
        return found

    def _own_text(self, state: BatchView, b: int, row: RowResult, length: int) -> SuffixIndex:
        """The index of request ``row``'s own committed text x[0:length] (row ``b``), brought up to date."""
        mine = self._own.get(id(row))
        if mine is None or mine[0] is not row:  # never another request's text, whatever reuses its id
            mine = self._own[id(row)] = (row, SuffixIndex())
        own, key = mine[1], row.request_id
        seen = own.length(key)
        if seen < length:
            own.extend(key, state.tokens[b, seen:length].tolist())
        return own


class ModelDrafter(Drafter):
    """A draft model: catches up on committed tokens it has not seen, then proposes one call a token."""

    uses_model = True

    def __init__(self, engine: Engine | None = None, stop_below: float | None = None, max_ngram: int = 3,
                 min_ngram: int = 1):
        if engine is None:
            raise ConfigError(f"drafter: {type(self).__name__} needs a draft model, and this artifact has none; use "
                              "drafter='hybrid' (prompt lookup without one), 'prompt-lookup' or 'none', or export "
                              "with --draft")
        super().__init__(engine, stop_below, max_ngram, min_ngram)

    def propose(self, state: BatchView, cache: KVCache | None, k: int, lookup_k: int, caps: list[int]) -> Proposal:
        return self._model(state, cache, k, caps) if k else Proposal.none(state.batch)

    def _model(self, state: BatchView, cache: KVCache, k: int, caps: list[int]) -> Proposal:
        """Up to k drafts a row by the draft model: every row drafts (greedy rows draw nothing), a sampled row only
        up to its cap, so that its random draws depend on its own settings alone, never on its batch mates'."""
        began = time.perf_counter()
        engine, lengths, batch = self.engine, state.lengths, len(caps)
        logits, width = feed(engine, cache, state.tokens, lengths)  # [batch, vocab] after x[L - 1]: the catch-up
        caught_up = time.perf_counter()
        most = min(k, max(caps))
        columns, inputs = self._columns(most, batch)
        # draft call i feeds draft i - 1 at L + i - 1; offsets made here: NumPy runs slower right after an ORT call
        # (docs/results/overhead)
        pasts = [np.array([at + i for at in lengths]) for i in range(most - 1)]
        if state.greedy:  # each draft the argmax after the last: no distribution, only its top probability if asked
            made = 0
            while made < most:
                if state.penalized:
                    logits = _penalized(logits, state, state.configs, columns[:made].T)
                if self.stop_below is not None and _top_probability(logits).max() < self.stop_below:
                    break
                logits.argmax(-1, out=columns[made])
                made += 1
                if made < most:
                    logits = engine.infer(inputs[made - 1], pasts[made - 1], cache).logits[:, 0]
            steps = max(0, min(made, most - 1))  # draft calls after the catch-up: none after the last draft
            qs, drafted = None, [min(made, cap) for cap in caps]
        else:
            made, steps, qs, drafted = self._sampled(state, cache, logits, columns, inputs, pasts,
                                                     [min(k, cap) for cap in caps])
        cache.commit([at + steps for at in lengths])  # the catch-up saw x[:L], each later call one draft more
        ended = time.perf_counter()
        return Proposal(columns[:made].T, qs, drafted, [False] * batch, ended - began, caught_up - began, width,
                        steps, ended - caught_up)

    def _columns(self, most: int, batch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """A [most, batch] buffer for the drafts, and its rows as [batch, 1] views: draft i of every row is row i,
        contiguous, so its view is the next call's input as it is. Kept from one cycle to the next, as making them
        costs a cycle measurably (docs/results/overhead): a proposal's drafts are valid until the next."""
        if self._buffer is None or len(self._buffer[0]) < most or self._buffer[0].shape[1] != batch:
            columns = np.zeros((max(most, 1), batch), np.int64)
            self._buffer = columns, [column[:, None] for column in columns]
        return self._buffer

    def _sampled(self, state: BatchView, cache: KVCache, logits: np.ndarray, columns: np.ndarray, inputs: list,
                 pasts: list, limits: list[int]):
        """Sampled (and greedy) rows' drafts into ``columns``, each drawn from the draft's distribution q (one-hot for
        greedy rows), row b at most ``limits[b]``: drafts made, draft calls after the catch-up, q [batch, made, vocab]
        and the drafts each row has (confidence may cut its limit)."""
        configs, qs, made, steps, most = state.configs, [], 0, 0, max(limits)
        while made < most:
            if state.penalized:
                logits = _penalized(logits, state, configs, columns[:made].T)
            q = row_probabilities(logits, configs)  # [batch, vocab]
            if self.stop_below is not None:
                limits = [made if limit > made and top < self.stop_below else limit
                          for limit, top in zip(limits, q.max(-1).tolist())]
                most = max(limits)
                if most <= made:
                    break
            columns[made] = [_draw(q[b], rng, state.noise(b, at + made, q.shape[-1])) if made < limit else 0  # filler
                             for b, (rng, limit, at) in enumerate(zip(state.rngs(), limits, state.lengths))]
            qs.append(q)
            made += 1
            if made < most:
                logits = self.engine.infer(inputs[made - 1], pasts[made - 1], cache).logits[:, 0]
                steps += 1
        return made, steps, np.stack(qs, axis=1) if qs else None, [min(made, limit) for limit in limits]


class HybridDrafter(ModelDrafter, SuffixDrafter):
    """The suffix index for rows where the policy prices its drafts above the draft model's, the draft model for the
    others, in one cycle (``lookup_k`` 0: no index drafts; ``k`` 0: no model drafts). A row's choice reads its own
    text and its scope's index alone, and index rows draw nothing, so no row's proposal depends on its batch mates'.
    Without a draft model (a target-only artifact), it drafts from the index alone."""

    uses_model = looks_up = indexes = True

    def __init__(self, engine: Engine | None = None, stop_below: float | None = None, max_ngram: int = 3,
                 min_ngram: int = 2):
        Drafter.__init__(self, engine, stop_below, max_ngram, min_ngram)
        self.uses_model = engine is not None

    def propose(self, state: BatchView, cache: KVCache | None, k: int, lookup_k: int, caps: list[int]) -> Proposal:
        modelling = bool(k) and self.uses_model
        self._found_facts = None
        found = (self._free(state, lookup_k, caps, modelling) if lookup_k
                 else [np.zeros(0, np.int64)] * state.batch)
        hits = [len(f) > 0 for f in found]
        if not any(hits):
            return self._model(state, cache, k, caps) if modelling else Proposal.none(state.batch)
        lengths = state.lengths
        if modelling and not all(hits):  # index rows get no model drafts; the draft keeps their prefix
            modelled = self._model(state, cache, k, [0 if hit else cap for hit, cap in zip(hits, caps)])
            cache.commit([length if hit else past for hit, length, past in zip(hits, lengths, cache.past_len.tolist())])
        else:  # no model call: the draft falls behind, and catches up when it next drafts
            modelled = Proposal.none(state.batch)
        began, made = time.perf_counter(), modelled.drafts.shape[1]
        drafted = [len(f) if hit else n for hit, f, n in zip(hits, found, modelled.drafted)]
        drafts = np.empty((state.batch, max(drafted + [made])), np.int64)
        for b, (hit, cont) in enumerate(zip(hits, found)):
            _fill(drafts[b], cont if hit else modelled.drafts[b, : drafted[b]], state.tokens[b, lengths[b] - 1])
        q = None
        if modelled.q is not None:  # sampled rows: the model's q where it drafted, one-hot elsewhere
            q = np.zeros((*drafts.shape, modelled.q.shape[-1]), modelled.q.dtype)
            q[:, :made] = modelled.q
            for b, hit in enumerate(hits):
                first = 0 if hit else made
                q[b, np.arange(first, drafts.shape[1]), drafts[b, first:]] = 1.0
        modelled.drafts, modelled.q, modelled.drafted, modelled.lookup = drafts, q, drafted, hits
        modelled.seconds += time.perf_counter() - began
        return self._facts(modelled)


def lookup(seq: np.ndarray, k: int, max_ngram: int, min_ngram: int = 1) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of ``seq``'s final n-gram, the longest
    n in [min_ngram, max_ngram] that has one; empty when none has (or k is 0)."""
    length = len(seq)
    if k <= 0:
        return seq[:0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # starts j < length - n where seq[j : j + n] equals the final n-gram
        match = seq[: length - n] == seq[length - n]
        for t in range(1, n):
            match &= seq[t : length - n + t] == seq[length - n + t]
        for hit in np.flatnonzero(match)[::-1]:  # latest match with a continuation first
            cont = seq[hit + n : hit + n + k]
            if len(cont):
                return cont
    return seq[:0]


def _draw(q: np.ndarray, rng: np.random.Generator, noise: np.ndarray | None) -> int:
    """A sampled row's draft from q [vocab]: the token its keyed noise picks (a seeded row), else a draw by its generator."""
    return sample(q, rng) if noise is None else keyed_token(q, noise)


def _fill(row: np.ndarray, drafts: np.ndarray, last: int) -> None:
    """``row`` takes ``drafts``, then repeats the last of them (or ``last``, the row's last token): fillers only."""
    row[: len(drafts)] = drafts
    row[len(drafts) :] = drafts[-1] if len(drafts) else last


def _penalized(logits: np.ndarray, state: BatchView, configs, so_far: np.ndarray) -> np.ndarray:
    return np.stack([penalize(logits[b], np.concatenate([state.tokens[b, :at], so_far[b]]), config.repetition_penalty)
                     for b, (at, config) in enumerate(zip(state.lengths, configs))])


def _top_probability(logits: np.ndarray) -> np.ndarray:
    """max softmax(logits) per row, without forming the distribution.  # [batch]"""
    return 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
