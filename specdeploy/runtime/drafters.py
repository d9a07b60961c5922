"""Drafters propose tokens for the target to verify: a draft model, a suffix index, prompt lookup, or none.

A drafter is a proposer, as vLLM's are: it takes the batch's rows through a narrow view (``rows.BatchView``: arrays,
settings and generators in batch order), counts, and for a draft model the draft's cache (``engines.base.KVCache``,
owned by the generation with the batch's other rows), and returns what it drafted. It never sees the policy: the
decoder asks the policy how many drafts each source makes and passes the counts, in two steps a cycle:

1. ``find(state, free_k, caps)``: each row's drafts that cost no model call (``Found``): prompt lookup's, or a suffix
   index's with the index's estimate of each draft and the request whose text they follow. The decoder asks the
   policy how many of an index row's drafts to verify (``Policy.free_drafts``, from the estimates) and cuts them
   (``Found.kept``).
2. ``propose(state, cache, k, found, caps)``: the ``Proposal``: a row's found drafts where it has some, and up to
   ``k`` drafts by the draft model for the others (``caps[b]``: row b's own k and tokens left bound both).

What a drafter can do is declared: ``uses_model`` (it has a draft model and its cache), ``finds_free`` (it finds drafts
without a model call), ``uses_index`` (from a suffix index, with estimates). The default, ``HybridDrafter``, is composed
of a ``SuffixDrafter`` and a ``ModelDrafter``: index drafts where the policy keeps some, the draft model elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..engines.base import Engine, KVCache, feed
from .rows import BatchView, RowResult
from .sampling import keyed_token, penalize, row_probabilities, sample
from .suffix import LEVELS, SuffixIndex, propose

MAX_NGRAM, MIN_NGRAM = 3, 1  # prompt lookup continues the latest earlier match of the last n tokens, longest n first
_NONE = np.zeros(0, np.int64)  # a row that found nothing (never written)


@dataclass(slots=True, kw_only=True)
class Proposal:
    """One cycle's drafts, by keyword (nine fields, several of one type). A row's drafts beyond ``drafted[b]`` only fill
    its row (never kept)."""

    drafts: np.ndarray  # [batch, width] int64; a model drafter's: a view of its buffer, valid until its next proposal
    q: np.ndarray | None  # [batch, width, vocab] proposal distributions; None: deterministic (one-hot)
    drafted: list[int]  # [batch] drafts row b really has
    free: list[bool] = field(default_factory=list)  # [batch] row b's drafts cost no model call (prompt lookup's or an index's)
    seconds: float = 0.0  # drafting: engine calls and their bookkeeping, finding free drafts included
    first_call_seconds: float = 0.0  # the first draft call, which feeds what the draft had not seen
    first_call_tokens: int = 0  # tokens a row that first call fed (the widest row's lag)
    later_calls: int = 0  # draft calls after the first
    later_call_seconds: float = 0.0
    estimates: list[list[float] | None] | None = None  # [batch] an index row's estimate of each draft (else None)
    origins: list[str | None] | None = None  # [batch] the request whose text an index row's drafts follow

    @classmethod
    def none(cls, batch: int, seconds: float = 0.0) -> Proposal:
        """No drafts: the cycle is a plain decoding step (``seconds``: spent finding none)."""
        return cls(drafts=np.zeros((batch, 0), np.int64), q=None, drafted=[0] * batch, free=[False] * batch,
                   seconds=seconds)


@dataclass(slots=True)
class Found:
    """Each row's drafts that cost no model call, before and after the policy chose how many of them to verify."""

    drafts: list[np.ndarray]  # [batch] row b's drafts, at most its cap (empty: none found)
    estimates: list[list[float] | None] | None = None  # [batch] a suffix index's estimate of each; None: no estimates
    origins: list[str | None] | None = None  # [batch] the request whose text row b's drafts follow (an index's)
    seconds: float = 0.0  # finding them

    @classmethod
    def nothing(cls, batch: int) -> Found:
        return cls([_NONE] * batch)

    def kept(self, keep: list[int]) -> Found:
        """Row b's first ``keep[b]`` drafts, with their estimates and origin (a row that keeps none: None)."""
        return Found([drafts[:n] for drafts, n in zip(self.drafts, keep)],
                     None if self.estimates is None else [row[:n] or None for row, n in zip(self.estimates, keep)],
                     None if self.origins is None else [origin if n else None for origin, n in zip(self.origins, keep)],
                     self.seconds)

    def proposal(self, state: BatchView) -> Proposal:
        """These drafts alone as a proposal (deterministic: q one-hot), each row's filled after its last."""
        width = max(map(len, self.drafts))
        if not width:
            return Proposal.none(state.batch, self.seconds)
        began = time.perf_counter()
        drafts = np.empty((state.batch, width), np.int64)
        for b, row in enumerate(self.drafts):
            _fill(drafts[b], row, state.tokens[b, state.lengths[b] - 1])
        return Proposal(drafts=drafts, q=None, drafted=list(map(len, self.drafts)),
                        free=[len(row) > 0 for row in self.drafts], seconds=self.seconds + time.perf_counter() - began,
                        estimates=self.estimates, origins=self.origins)


class Drafter:
    """Proposes drafts after each row's committed tokens. Without drafts (``NoDrafter``): plain decoding."""

    uses_model = False
    finds_free = False
    uses_index = False
    engine: Engine | None = None  # the draft model, where ``uses_model``

    def find(self, state: BatchView, free_k: int, caps: list[int]) -> Found:
        """Up to ``free_k`` drafts a row that cost no model call, row b at most ``caps[b]``; none by default."""
        return Found.nothing(state.batch)

    def propose(self, state: BatchView, cache: KVCache | None, k: int, found: Found, caps: list[int]) -> Proposal:
        """The cycle's proposal: ``found``'s drafts (``find``'s, cut as the policy keeps them) and, for a drafter with
        a model, up to ``k`` model drafts for the rows that found none, row b at most ``caps[b]``. By default the
        found drafts alone."""
        return found.proposal(state)

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
    deterministic (q one-hot: sampling verification keeps a draft d with probability p(d)); no estimates, so the
    policy's ``next_k(lookup=True)`` alone sets their number."""

    finds_free = True

    def find(self, state: BatchView, free_k: int, caps: list[int]) -> Found:
        began = time.perf_counter()
        drafts = [lookup(state.tokens[b, :length], min(free_k, cap), MAX_NGRAM, MIN_NGRAM)
                  for b, (length, cap) in enumerate(zip(state.lengths, caps))]
        return Found(drafts, seconds=time.perf_counter() - began)


class SuffixDrafter(Drafter):
    """Drafts from a suffix index (``suffix``) over each request's own text (its prompt and committed tokens) and the
    texts of earlier requests in its scope (``RowSettings.index``; None: its own text alone). No model call; the
    drafts are deterministic (q one-hot), and a row's read its own text and its scope alone, never its batch mates'.
    Each row's drafts carry the index's estimate of each, from which the policy prices how many to verify."""

    finds_free = uses_index = True

    def __init__(self):
        self._own: dict[int, tuple] = {}  # (a request's result, an index of its text), by id(result)

    def find(self, state: BatchView, free_k: int, caps: list[int]) -> Found:
        began = time.perf_counter()
        found, estimates, origins = [], [], []
        for b, (length, cap, (row, earlier)) in enumerate(zip(state.lengths, caps, state.texts)):
            own = self._own_text(state, b, row, length)
            context = state.tokens[b, max(0, length - LEVELS[0]) : length].tolist()
            drafts, estimate, origin = propose((own, earlier) if earlier is not None else (own,), context,
                                               min(free_k, cap))
            if earlier is not None and origin is not None:
                earlier.touch(origin)  # drafted from: the last of the earlier texts to be evicted
            found.append(np.array(drafts, np.int64))
            estimates.append(estimate)
            origins.append(origin)
        if len(self._own) > 2 * state.batch + 8:  # requests that left: their text goes with them
            live = {id(row) for row, _ in state.texts}
            self._own = {key: index for key, index in self._own.items() if key in live}
        return Found(found, estimates, origins, time.perf_counter() - began)

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

    def __init__(self, engine: Engine, stop_below: float | None = None):
        # stop_below: a row stops drafting once the draft's top probability falls below it (None: never)
        self.engine, self.stop_below = engine, stop_below
        self._buffer: tuple | None = None  # the drafts' columns, kept from one cycle to the next (``_columns``)

    def propose(self, state: BatchView, cache: KVCache | None, k: int, found: Found, caps: list[int]) -> Proposal:
        """Up to ``k`` drafts a row by the model (a model drafter finds no free drafts: ``found`` is empty)."""
        return self.draft(state, cache, k, caps) if k else Proposal.none(state.batch)

    def draft(self, state: BatchView, cache: KVCache, k: int, caps: list[int]) -> Proposal:
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
        return Proposal(drafts=columns[:made].T, q=qs, drafted=drafted, free=[False] * batch, seconds=ended - began,
                        first_call_seconds=caught_up - began, first_call_tokens=width, later_calls=steps,
                        later_call_seconds=ended - caught_up)

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


class HybridDrafter(Drafter):
    """A suffix index's drafts for the rows where the policy keeps some, the draft model's for the others, in one
    cycle (``found`` empty: no index drafts; ``k`` 0: no model drafts); composed of the two sources (``suffix``,
    ``model``). A row's choice reads its own text and its scope's index alone, and index rows draw nothing, so no row's
    proposal depends on its batch mates'. Without a draft model (a target-only artifact), it drafts from the index
    alone."""

    finds_free = uses_index = True

    def __init__(self, suffix: SuffixDrafter, model: ModelDrafter | None):
        self.suffix, self.model = suffix, model
        self.uses_model = model is not None
        self.engine = model.engine if model is not None else None

    def find(self, state: BatchView, free_k: int, caps: list[int]) -> Found:
        return self.suffix.find(state, free_k, caps)

    def propose(self, state: BatchView, cache: KVCache | None, k: int, found: Found, caps: list[int]) -> Proposal:
        modelling = bool(k) and self.model is not None
        hits = [len(row) > 0 for row in found.drafts]
        if not any(hits):
            return self.model.draft(state, cache, k, caps) if modelling else Proposal.none(state.batch, found.seconds)
        lengths = state.lengths
        if modelling and not all(hits):  # index rows get no model drafts; the draft keeps their prefix
            modelled = self.model.draft(state, cache, k, [0 if hit else cap for hit, cap in zip(hits, caps)])
            cache.commit([length if hit else past for hit, length, past in zip(hits, lengths, cache.past_len.tolist())])
        else:  # no model call: the draft falls behind, and catches up when it next drafts
            modelled = Proposal.none(state.batch)
        began, made = time.perf_counter(), modelled.drafts.shape[1]
        drafted = [len(row) if hit else n for hit, row, n in zip(hits, found.drafts, modelled.drafted)]
        drafts = np.empty((state.batch, max(drafted + [made])), np.int64)
        for b, (hit, row) in enumerate(zip(hits, found.drafts)):
            _fill(drafts[b], row if hit else modelled.drafts[b, : drafted[b]], state.tokens[b, lengths[b] - 1])
        q = None
        if modelled.q is not None:  # sampled rows: the model's q where it drafted, one-hot elsewhere
            q = np.zeros((*drafts.shape, modelled.q.shape[-1]), modelled.q.dtype)
            q[:, :made] = modelled.q
            for b, hit in enumerate(hits):
                first = 0 if hit else made
                q[b, np.arange(first, drafts.shape[1]), drafts[b, first:]] = 1.0
        # the model's proposal, its rows merged with the index's: its calls' timings stand for the cycle's
        modelled.drafts, modelled.q, modelled.drafted, modelled.free = drafts, q, drafted, hits
        modelled.estimates, modelled.origins = found.estimates, found.origins
        modelled.seconds += found.seconds + time.perf_counter() - began
        return modelled


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
