"""Drafters propose tokens for the target to verify: a draft model, prompt lookup, or none.

A drafter reads the batch state, writes only what it owns (its cache, its draft buffer) and
returns a ``Proposal``. Drafters are registered by name (``--drafter NAME``); what one needs is
declared (``needs_model``), not probed.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..engines.base import Engine, KVCache, feed, prefill
from .config import GenerationConfig
from .sampling import penalize, row_probabilities, sample

if TYPE_CHECKING:  # the decoder imports the drafters
    from .decoder import BatchState


@dataclass
class Proposal:
    drafts: np.ndarray  # [batch, k] int64; the drafter's buffer, valid until its next ``propose``
    q: np.ndarray | None  # [batch, k, vocab] proposal distributions; None: deterministic (one-hot)
    seconds: float  # drafting time, engine calls and their bookkeeping
    steps: int  # draft engine calls
    catchup_tokens: int = 1  # tokens the first call fed (more than 2 after cycles that did not draft)
    limits: list[int] | None = None  # [batch] drafts row b really has (the rest fill its row); None: all k
    catchup_seconds: float = 0.0  # the first call's time: with many tokens fed, what the draft's catch-up cost
    without_model: bool = False  # drafted by lookup alone where a model could have: no news of the model's acceptance

    @classmethod
    def none(cls, batch: int) -> Proposal:
        """No drafts: the cycle is a plain decoding step."""
        return cls(np.zeros((batch, 0), np.int64), None, 0.0, 0)


DRAFTERS: dict[str, type[Drafter]] = {}  # name -> drafter class, in the order they are defined (and listed)


class Drafter(ABC):
    """Proposes up to k tokens per row after each row's committed tokens. A subclass with a ``name`` is
    registered under it (``--drafter NAME``, ``GenerationConfig.drafter``)."""

    name = ""
    needs_model = False  # True: built on the artifact's draft model (``create(engine)``)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):  # its own name: a subclass of a registered class does not take its place
            DRAFTERS[cls.name] = cls

    @classmethod
    def create(cls, engine: Engine | None) -> Drafter:
        return cls()

    def start(self, batch: int, capacity: int, config: GenerationConfig, threshold: float | None) -> None:
        """A new batch: ``threshold`` is the policy's confidence threshold (None: always draft k)."""
        self.threshold = threshold

    @abstractmethod
    def propose(self, state: BatchState, k: int, budgets: list[int] | None = None) -> Proposal:
        """Up to k drafts per row (every row gets as many); row b uses at most ``budgets[b]`` of them (its own
        k and tokens left), and a row's random draws depend on its own budget alone, never on its batch mates'."""

    def rollback(self, lengths: list[int]) -> None:  # noqa: B027 (a default: nothing to do)
        """Tokens x[0:lengths[b]] stand (the verified prefix); anything seen beyond them is discarded."""

    def select(self, rows: list[int]) -> None:  # noqa: B027 (a default: nothing to do)
        """Keep only batch rows ``rows`` (finished rows left)."""

    def row(self, b: int) -> Drafter:
        """This drafter for row ``b`` alone (stateless drafters serve any row)."""
        return self

    def extend(self, rows: int) -> None:  # noqa: B027 (a default: nothing to do)
        """``rows`` new rows join at the end of the batch, having seen nothing."""

    def adopt(self, b: int, single: Drafter) -> None:  # noqa: B027 (a default: nothing to do)
        """Take back what a ``row(b)`` drafter committed."""

    def warm(self, state: BatchState, goal: list[int]) -> int:
        """See row b's first ``goal[b]`` tokens now (a prefill chunk), rather than on the next ``propose``;
        returns the tokens fed (all rows together)."""
        return 0

    def behind(self, state: BatchState) -> int:
        """Tokens (all rows together) the next ``propose`` must catch up on beyond the one or two a
        drafting cycle leaves: prompts never seen, plain cycles since the last draft."""
        return 0

    def sample(self, state: BatchState, tokens: int) -> tuple[float, int, float]:
        """Catch each row up on at most ``tokens`` more of what it lacks, then make one call of one token a row (a
        draft step's cost, its logits unused); both only add what the next ``propose`` would feed anyway. Returns
        (the catch-up's seconds, tokens it fed for all rows together, the call's seconds; 0: no call)."""
        return 0.0, 0, 0.0

    def merge(self, other: Drafter) -> None:  # noqa: B027 (a default: nothing to do)
        """``other``'s rows (a drafter of the same kind, as far as it has seen them) join at the end of the batch."""

    def cost_ratio(self, target_spec) -> float:
        """A draft step's cost relative to the target's (0: drafting needs no model)."""
        return 0.0

    def without_catchup(self) -> Drafter | None:
        """What drafts a cycle for which the policy finds the draft model not worth paying (its catch-up,
        ``behind``, or its drafts: the policy chose plain decoding): a drafter that needs no model, or
        None (a plain cycle)."""
        return None


class ModelDrafter(Drafter):
    """A draft model: catches up on committed tokens it has not seen, then proposes one call a token."""

    name = "model"
    needs_model = True

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cache: KVCache | None = None

    @classmethod
    def create(cls, engine: Engine | None) -> Drafter:
        return cls(engine)

    def start(self, batch: int, capacity: int, config: GenerationConfig, threshold: float | None) -> None:
        super().start(batch, capacity, config, threshold)
        self.cache = self.engine.allocate_cache(batch, capacity)
        self._buffers(batch, config.k)

    def _buffers(self, batch: int, k: int) -> None:
        # draft i of every row is row i of ``columns``: contiguous, so [batch, 1] views of it are the
        # next draft call's input as they are
        self.columns = np.zeros((max(k, 1), batch), np.int64)  # [k, batch]
        self.inputs = [column[:, None] for column in self.columns]  # k views [batch, 1]

    def propose(self, state: BatchState, k: int, budgets: list[int] | None = None) -> Proposal:
        began = time.perf_counter()
        cache, engine = self.cache, self.engine
        lengths = state.lengths
        configs = None if state.greedy and not state.penalized else state.configs()
        # catch up on the committed tokens it has not seen: as many as the row furthest behind needed
        logits, catchup_tokens = feed(engine, cache, state.tokens, lengths)  # [batch, vocab] after x[L - 1]
        caught_up = time.perf_counter()
        pasts = [np.array([at + i for at in lengths]) for i in range(k - 1)]  # each draft call's past_len
        # sampled rows stop on their own (budget, confidence), so that their draws are theirs alone
        limits = None if state.greedy else list(budgets or [k] * len(lengths))
        qs, made = [], 0
        while made < k:
            if state.penalized:
                logits = self._penalized(logits, state, configs, made)
            if state.greedy:
                # greedy needs no distribution, only its top probability when a threshold asks for it
                if self.threshold is not None and _top_probability(logits).max() < self.threshold:
                    break
                logits.argmax(-1, out=self.columns[made])
            else:
                q = row_probabilities(logits, configs)  # [batch, vocab]; one-hot for greedy rows
                if self.threshold is not None:
                    limits = [made if limit > made and top < self.threshold else limit
                              for limit, top in zip(limits, q.max(-1).tolist())]
                if max(limits) <= made:
                    break  # no row wants another draft
                self.columns[made] = [sample(q[b], rng) if made < limit else 0  # 0: a filler no row keeps
                                      for b, (rng, limit) in enumerate(zip(state.rngs(), limits))]
                qs.append(q)
            made += 1
            if made < k:
                logits = engine.infer(self.inputs[made - 1], pasts[made - 1], cache).logits[:, 0]
        steps = 1 + min(made, k - 1)  # the catch-up call, then one call per draft but the last
        cache.commit([at + steps - 1 for at in lengths])
        q_all = np.stack(qs, axis=1) if qs else None
        limits = _limits(limits if limits is not None else budgets, made)
        return Proposal(self.columns[:made].T, q_all, time.perf_counter() - began, steps, catchup_tokens, limits,
                        caught_up - began)

    def _penalized(self, logits: np.ndarray, state: BatchState, configs: list[GenerationConfig], made: int) -> np.ndarray:
        so_far = self.columns[:made].T  # [batch, made]
        return np.stack([penalize(logits[b], np.concatenate([state.tokens[b, :at], so_far[b]]), config.repetition_penalty)
                         for b, (at, config) in enumerate(zip(state.lengths, configs))])

    def rollback(self, lengths: list[int]) -> None:
        self.cache.commit([min(seen, v) for seen, v in zip(self.cache.past_len.tolist(), lengths)])

    def select(self, rows: list[int]) -> None:
        self.cache = self.cache.select(rows)
        self._buffers(len(rows), self.columns.shape[0])

    def row(self, b: int) -> ModelDrafter:
        single = copy.copy(self)  # the same kind and settings, over row b's cache
        single.cache = self.cache.rows(b, b + 1)
        single._buffers(1, self.columns.shape[0])
        return single

    def extend(self, rows: int) -> None:
        self.cache = self.cache.extend(self.engine.allocate_cache(rows, self.cache.capacity))
        self._buffers(self.cache.shape[1], self.columns.shape[0])

    def adopt(self, b: int, single: ModelDrafter) -> None:
        self.cache.commit_row(b, single.cache.past_len.item(0))

    def warm(self, state: BatchState, goal: list[int]) -> int:
        seen = sum(self.cache.past_len.tolist())
        prefill(self.engine, self.cache, state.tokens, goal)
        return sum(self.cache.past_len.tolist()) - seen

    def behind(self, state: BatchState) -> int:
        return sum(max(0, length - 2 - past) for length, past in zip(state.lengths, self.cache.past_len.tolist()))

    def sample(self, state: BatchState, tokens: int) -> tuple[float, int, float]:
        seen, lengths = self.cache.past_len.tolist(), state.lengths
        began = time.perf_counter()
        fed = self.warm(state, [max(past, min(past + tokens, length - 2)) for past, length in zip(seen, lengths)])
        caught_up = time.perf_counter()
        step, ends = 0.0, [min(past + 1, length - 1) for past, length in zip(self.cache.past_len.tolist(), lengths)]
        if ends != self.cache.past_len.tolist():  # some row has a token left: one [batch, 1] call, in which a row with
            feed(self.engine, self.cache, state.tokens, ends)  # nothing left re-feeds its last token (``feed``)
            step = time.perf_counter() - caught_up
        return caught_up - began, fed, step

    def merge(self, other: ModelDrafter) -> None:
        self.cache = self.cache.extend(other.cache)
        self._buffers(self.cache.shape[1], self.columns.shape[0])

    def cost_ratio(self, target_spec) -> float:
        """Parameters of the draft over the target's: what a token costs each, to a first estimate."""
        draft, target = self.engine.spec.parameters, target_spec.parameters
        return draft / target if draft > 0 and target > 0 else 0.0


def _limits(limits: list[int] | None, made: int) -> list[int] | None:
    """Per-row draft counts, at most ``made``; None when every row has all ``made``."""
    if limits is None or min(limits) >= made:
        return None
    return [min(limit, made) for limit in limits]


def _top_probability(logits: np.ndarray) -> np.ndarray:
    """max softmax(logits) per row, without forming the distribution.  # [batch]"""
    return 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)


class PromptLookup(Drafter):
    """Prompt lookup (n-gram) drafting: continue the latest earlier match of the last n tokens.

    No model; like transformers' ``prompt_lookup_num_tokens``. Proposals are deterministic, so q is
    one-hot and sampling verification accepts a draft d with probability p(d).
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state: BatchState, k: int, budgets: list[int] | None = None) -> Proposal:
        began = time.perf_counter()
        budgets = budgets or [k] * state.batch
        found = [self._lookup(state.tokens[b, :length], budget) for b, (length, budget) in enumerate(zip(state.lengths, budgets))]
        made = max(len(f) for f in found)
        drafts = np.empty((state.batch, made), np.int64)
        for b, (length, cont) in enumerate(zip(state.lengths, found)):
            drafts[b, : len(cont)] = cont
            if len(cont) < made:  # rows without a (long enough) match repeat their last token: any proposal is lossless
                drafts[b, len(cont) :] = cont[-1] if len(cont) else state.tokens[b, length - 1]
        # greedy rows may keep a repeated token that happens to match; a sampled row's draws count its own drafts only
        limits = _limits(budgets if state.greedy else [len(f) for f in found], made)
        return Proposal(drafts, None, time.perf_counter() - began, 0, limits=limits)

    def _lookup(self, seq: np.ndarray, k: int) -> np.ndarray:
        return lookup(seq, k, self.max_ngram, self.min_ngram)


def lookup(seq: np.ndarray, k: int, max_ngram: int, min_ngram: int = 1) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of ``seq``'s final n-gram, the longest
    n in [min_ngram, max_ngram] that has one; empty when none has."""
    length = len(seq)
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


class NoDrafter(Drafter):
    """Plain target decoding: the baseline."""

    name = "none"

    def propose(self, state: BatchState, k: int, budgets: list[int] | None = None) -> Proposal:
        return Proposal.none(state.batch)


from .hybrid import HybridDrafter  # noqa: E402 (registers "hybrid"; it builds on the drafters above)

__all__ = ["DRAFTERS", "Drafter", "HybridDrafter", "ModelDrafter", "NoDrafter", "PromptLookup", "Proposal", "lookup"]
