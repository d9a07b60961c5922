"""The hybrid drafter: prompt lookup where the text repeats an earlier stretch, the draft model elsewhere.

A lookup proposal costs no model call, only a longer verification, so it pays where the text copies
itself (code, retrieval, summaries) and costs where its matches are chance (chat). Each row keeps its
own record of what its lookups gained: a row whose lookups keep being rejected stops proposing them,
and tries again after skipping a few matches. A policy that finds the draft model's catch-up or
drafting not worth paying (the cost policy on a long prompt, or on text the draft cannot follow)
leaves a single row to lookup alone (``without_catchup``), rather than to plain decoding; a batch's
plain steps stand (the decoder's ``_cycle``).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

from ..engines.base import Engine
from .config import GenerationConfig
from .drafters import Drafter, ModelDrafter, Proposal, _limits, lookup

if TYPE_CHECKING:
    from .decoder import BatchState


class HybridDrafter(ModelDrafter):
    """Lookup for rows whose final ``min_ngram``-or-longer n-gram occurred before (and whose lookups
    have been paying), the draft model for the others, in the same cycle.

    The model catches up on what it skipped at its next call. The choice reads a row's committed
    tokens and its own lookup record alone, and lookup rows draw nothing from their generator, so a
    row's proposals never depend on its batch mates'.
    """

    name = "hybrid"
    min_gain = 1.0  # accepted drafts a lookup must average to be worth its longer verification (~v(5) / v(1) - 1)
    first_gain = 1.5  # a row's record before its first lookup: one rejected lookup stops them
    retry = 0.05  # what each skipped match adds back to a row's record: a retry after about 5-10

    def __init__(self, engine: Engine, max_ngram: int = 3, min_ngram: int = 2):
        super().__init__(engine)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.gains: list[float] = []  # per row: drafts accepted per lookup proposal, a running mean (the last weighs half)
        self.pending: list[int | None] = []  # per row: its length when it last proposed by lookup

    def start(self, batch: int, capacity: int, config: GenerationConfig, threshold: float | None) -> None:
        super().start(batch, capacity, config, threshold)
        self.gains, self.pending = [self.first_gain] * batch, [None] * batch
        self.lookup_k = config.k

    def propose(self, state: BatchState, k: int, budgets: list[int] | None = None, model: bool = True) -> Proposal:
        began = time.perf_counter()
        lengths = state.lengths
        # A lookup costs no model call: its length is its own record's (``_lookup``), up to the request's k, not the
        # K the policy chose for the model's drafts (capped at 1 where a model draft is dear, lookups that copied a
        # retrieved passage 4 tokens a cycle were cut to 1). Rows with budgets of their own keep them.
        found_budgets = budgets or [min(self.lookup_k, left - 1) for left in state.remaining()]
        budgets = budgets or [k] * state.batch
        found = [self._lookup(b, state.tokens[b, :length], budget)
                 for b, (length, budget) in enumerate(zip(lengths, found_budgets))]
        hits = [len(f) > 0 for f in found]
        self.pending = [length if hit else None for hit, length in zip(hits, lengths)]
        if not any(hits):
            return super().propose(state, k, budgets) if model else Proposal.none(state.batch)
        if all(hits) or not model:  # no model call: the draft falls behind, and catches up when it next drafts
            modelled = Proposal.none(state.batch)
        else:  # lookup rows get no model drafts (budget 0: no draws); the draft keeps only their committed tokens
            modelled = super().propose(state, k, [0 if hit else budget for hit, budget in zip(hits, budgets)])
            self.cache.commit([length if hit else past for hit, length, past
                               in zip(hits, lengths, self.cache.past_len.tolist())])
        made = modelled.drafts.shape[1]
        width = max([made] + [len(f) for f in found])
        drafts = np.empty((state.batch, width), np.int64)
        drafts[:, :made] = modelled.drafts
        own = modelled.limits or [made] * state.batch  # each model row's real drafts
        for b, (hit, cont) in enumerate(zip(hits, found)):
            if hit:
                drafts[b, : len(cont)] = cont
            filled = len(cont) if hit else made
            if filled < width:  # fillers: greedy may keep one that matches, a sampled row's limit excludes them
                drafts[b, filled:] = drafts[b, filled - 1] if filled else state.tokens[b, lengths[b] - 1]
        q = None
        if modelled.q is not None:  # sampled rows: the model's q where it drafted, one-hot elsewhere
            q = np.zeros((state.batch, width, modelled.q.shape[-1]), modelled.q.dtype)
            q[:, :made] = modelled.q
            for b, hit in enumerate(hits):
                first = 0 if hit else made
                q[b, np.arange(first, width), drafts[b, first:]] = 1.0
        if state.greedy:  # a row without drafts of its own may keep fillers that match, within its budget
            limits = [lookup if hit else budget if model else 0 for hit, budget, lookup in zip(hits, budgets, found_budgets)]
        else:
            limits = [len(cont) if hit else min(limit, made) for hit, cont, limit in zip(hits, found, own)]
        return Proposal(drafts, q, time.perf_counter() - began, modelled.steps, modelled.catchup_tokens,
                        _limits(limits, width), modelled.catchup_seconds, without_model=not modelled.steps)

    def _lookup(self, b: int, seq: np.ndarray, k: int) -> np.ndarray:
        """Row b's lookup continuation, one token longer than its lookups have been gaining (a rejected
        lookup wastes a longer verification the longer it is), none while they have not been paying."""
        found = lookup(seq, min(k, math.ceil(self.gains[b]) + 1), self.max_ngram, self.min_ngram)
        if len(found) and self.gains[b] < self.min_gain:
            self.gains[b] += self.retry
            return found[:0]
        return found

    def rollback(self, lengths: list[int]) -> None:
        super().rollback(lengths)
        for b, (at, length) in enumerate(zip(self.pending, lengths)):
            if at is not None and length >= at:  # a verified lookup proposal: what it gained
                self.gains[b] = (self.gains[b] + length - at) / 2
        self.pending = [None] * len(lengths)

    def without_catchup(self) -> Drafter:
        return _LookupOnly(self)

    # rows come and go with their records
    def select(self, rows: list[int]) -> None:
        super().select(rows)
        self.gains, self.pending = [self.gains[r] for r in rows], [None] * len(rows)

    def row(self, b: int) -> HybridDrafter:
        single = super().row(b)
        single.gains, single.pending = [self.gains[b]], [self.pending[b]]
        return single

    def adopt(self, b: int, single: HybridDrafter) -> None:
        super().adopt(b, single)
        self.gains[b] = single.gains[0]

    def extend(self, rows: int) -> None:
        super().extend(rows)
        self.gains, self.pending = self.gains + [self.first_gain] * rows, self.pending + [None] * rows

    def merge(self, other: HybridDrafter) -> None:
        super().merge(other)
        self.gains, self.pending = self.gains + other.gains, self.pending + other.pending


class _LookupOnly(Drafter):
    """A hybrid drafter's rows by lookup alone: the model is not called and stays where it was."""

    def __init__(self, hybrid: HybridDrafter):
        self.hybrid = hybrid

    def propose(self, state: BatchState, k: int, budgets: list[int] | None = None) -> Proposal:
        return self.hybrid.propose(state, k, budgets, model=False)

    def rollback(self, lengths: list[int]) -> None:
        self.hybrid.rollback(lengths)
