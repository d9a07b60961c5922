"""Draft-length policies: how many tokens to draft next, and what to learn from a cycle.

A policy answers ``next_k(batch, lookup)``: how many drafts the next cycle of a batch of ``batch`` rows
proposes by the draft model (``lookup=False``) or by prompt lookup (``lookup=True``: drafts that cost no
model call); 0: that source does not draft. A suffix index's drafts are priced row by row: ``index_k`` bounds
them, and ``free_drafts`` says how many of a row's to verify from the index's estimates of them. ``observe``
hears what a cycle did (``CycleOutcome``: what the proposal drafted, what was kept, what the calls cost);
``catchup_pays`` judges whether drafting repays the draft model catching up on tokens it has not seen; ``at_past``
tells it, before a cycle is priced, how far into their texts the batch's rows are.
``stop_below`` (None: never) stops a row's model drafts once the draft's top probability falls below it.

A policy never sees a drafter, nor a drafter the policy: the decoder asks the policy for counts, hands them
to the drafter, and hands what the drafter returned back to the policy (``decoder.Generation._propose``).

The simple policies live here; the cost policy, the default, in ``cost_policy``; ``registry`` names them all.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class CycleOutcome:
    """What a policy observes after one cycle of a batch (or, with no target call, after a draft catch-up)."""

    batch: int
    drafted: Sequence[int] = ()  # drafts verified per row (0: the row decoded plainly)
    accepted: Sequence[int] = ()  # drafts kept per row
    free: Sequence[bool] = ()  # per row: its drafts cost no model call (prompt lookup's or a suffix index's)
    first_call_seconds: float = 0.0  # the cycle's first draft call, which feeds what the draft has not seen yet
    first_call_tokens: int = 0  # tokens a row in that call (1-2 after a drafting cycle; more: a catch-up); 0: none
    later_call_seconds: float = 0.0  # the draft calls after the first, together
    later_calls: int = 0
    verify_seconds: float = 0.0  # the target's call
    verify_tokens: int = 0  # tokens a row in it (K + 1); 0: no target call (a draft catch-up alone)
    estimates: Sequence[Sequence[float] | None] | None = None  # per row: a suffix index's estimate of each draft
    past: int | None = None  # the longest row's past in the cycle's calls (what they attend over); None: not known

    @property
    def lookup(self) -> Sequence[bool]:
        """Deprecated since 0.5 (it named an index's drafts too): ``free``."""
        warnings.warn("CycleOutcome.lookup is deprecated: use CycleOutcome.free", DeprecationWarning, stacklevel=2)
        return self.free


class Policy(ABC):
    """The protocol every draft-length policy follows: ``next_k`` and ``observe``, and a catch-up judgement."""

    stop_below: float | None = None

    @abstractmethod
    def next_k(self, batch: int, lookup: bool = False) -> int:
        """Drafts the next cycle proposes by the draft model, or (``lookup``) by prompt lookup; 0: none (a suffix
        index's drafts: ``index_k`` and ``free_drafts``)."""

    def observe(self, outcome: CycleOutcome) -> None:  # noqa: B027 (a default: nothing to learn)
        """Learn from a cycle."""

    def at_past(self, past: int) -> None:  # noqa: B027 (a default: nothing depends on it)
        """The next cycle's calls attend over ``past`` tokens (the batch's longest row): what its prices are at."""

    def index_k(self, batch: int) -> int:
        """Drafts a row may take from a suffix index this cycle (each row's own count: ``free_drafts``)."""
        return self.next_k(batch, lookup=True)

    def free_drafts(self, batch: int, estimates: Sequence[float], model: bool) -> int:
        """How many of a row's suffix-index drafts to verify, from the index's ``estimates`` of each (``model``: the
        draft model drafts the batch's other rows, and would this one); 0: none. By default, all it found."""
        return len(estimates)

    def catchup_pays(self, batch: int, behind: int, to_come: float) -> bool:
        """Would drafting by the model for ``batch`` rows, which are expected to make ``to_come`` tokens still (as long
        as the pipeline's answers ran: ``AnswerLengths``), repay the draft catching up on ``behind`` tokens (all rows
        together) first?"""
        return True


class FixedK(Policy):
    """Always draft k tokens."""

    def __init__(self, k: int):
        self.k = k

    def next_k(self, batch: int, lookup: bool = False) -> int:
        return self.k


class ConfidenceStop(FixedK):
    """Draft up to k tokens, stopping once the draft's top probability falls below a threshold."""

    def __init__(self, k: int, threshold: float = 0.4):
        super().__init__(k)
        self.stop_below = threshold


class Heuristic(Policy):
    """transformers' schedule: +2 after a fully accepted block, -1 otherwise, within [1, most]."""

    def __init__(self, most: int, start: int | None = None):
        self.most = most
        self.k = min(start or most, most)

    def next_k(self, batch: int, lookup: bool = False) -> int:
        return self.k

    def observe(self, outcome: CycleOutcome) -> None:
        if max(outcome.drafted, default=0) == 0:
            return
        if all(n == d for n, d in zip(outcome.accepted, outcome.drafted)):
            self.k = min(self.k + 2, self.most)
        else:
            self.k = max(self.k - 1, 1)


__all__ = ["ConfidenceStop", "CycleOutcome", "FixedK", "Heuristic", "Policy"]
