"""Draft-length policies: how many tokens to draft next, and what to learn from a cycle.

Each policy is a two-method object (``next_k``, ``observe``), testable without a model, registered
by name. Capabilities are declared attributes, read once per request:
- ``confidence_threshold`` (None: draft all k) tells the drafter when to stop early;
- ``learns`` (False: ``observe`` does nothing) spares the decoder building outcomes;
- ``plans`` (True: ``plan`` wants the draft's catch-up estimate before the first cycle);
- ``weighs_catchup`` (True: ``catchup_pays`` judges a long catch-up of the draft before it is paid:
  rows that joined a running batch without the draft seeing their prompts, or a long plain streak).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CycleOutcome:
    """What a policy observes after one cycle of a batch."""

    proposed: int  # drafts verified this cycle (K; 0 for a plain decode step)
    accepted: Sequence[int]  # accepted drafts per row
    draft_seconds: float  # whole cycle's drafting time
    draft_steps: int  # draft engine calls made
    verify_seconds: float  # the target call
    verify_tokens: int  # tokens per row in the target call (K + 1)
    catchup_tokens: int = 1  # tokens the draft's first call fed (many after cycles that did not draft)
    first_draft_seconds: float = 0.0  # of ``draft_seconds``, the first call's (it feeds the last cycle's tokens); 0: unknown


POLICIES: dict[str, type[Policy]] = {}  # name -> policy class, in the order they are defined (and listed)


class Policy(ABC):
    """The protocol every draft-length policy follows, with its defaults. A subclass with a ``name`` is
    registered under it (``--policy NAME``, ``GenerationConfig.policy``)."""

    name = ""
    confidence_threshold: float | None = None
    learns = True
    plans = False
    weighs_catchup = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):  # its own name: a subclass of a registered class does not take its place
            POLICIES[cls.name] = cls

    @classmethod
    def create(cls, k: int, confidence_threshold: float) -> Policy:
        """The policy for a request with maximum draft length ``k``."""
        return cls(k)

    @abstractmethod
    def next_k(self) -> int:
        """Drafts to propose in the next cycle (0: a plain decoding step)."""

    def observe(self, outcome: CycleOutcome) -> None:  # noqa: B027 (a default: nothing to do)
        """Learn from a cycle (only called when ``learns``)."""

    def plan(self, catchup_seconds: float, new_tokens: int, draft_cost_ratio: float) -> None:  # noqa: B027 (a default: nothing to do)
        """Before the first cycle (only called when ``plans``)."""

    def catchup_pays(self, batch: int, behind: int, to_come: int) -> bool:
        """Would drafting for a batch of ``batch`` rows, which still make ``to_come`` tokens, repay the draft
        catching up on ``behind`` tokens first? (only asked when ``weighs_catchup``)"""
        return True

    def observe_catchup(self, seconds: float, tokens: int) -> None:  # noqa: B027 (a default: nothing to do)
        """The draft caught up on ``tokens`` (all rows together) in ``seconds`` (only told when ``weighs_catchup``)."""

    def catchup_sample(self) -> int:
        """Asked after ``catchup_pays`` said no: tokens of each row's catch-up to pay now all the same, to re-measure
        what a catch-up and a draft call cost (``observe_sample``); 0: none."""
        return 0

    def observe_sample(self, catchup_seconds: float, catchup_tokens: int, step_seconds: float, rows: int) -> None:  # noqa: B027 (a default: nothing to do)
        """A ``catchup_sample`` was paid: ``catchup_tokens`` (all rows together) in ``catchup_seconds``, then one draft
        call of one token per row for ``rows`` rows in ``step_seconds`` (0: not measured)."""

    def inherit(self, previous: Policy) -> None:  # noqa: B027 (a default: nothing to do)
        """Start from what ``previous``, the same kind of policy on the same engines, has learnt (a pipeline's
        earlier request)."""

    def remembered(self) -> dict | None:
        """What a later process may start from (``recall``), as JSON-able data; None: nothing worth keeping."""
        return None

    def recall(self, state: dict) -> bool:
        """Start from ``state``, what ``remembered`` returned in an earlier process with the same engines;
        False (and nothing changed) where this policy cannot use it."""
        return False


class Adopted(Policy):
    """A policy object from outside the package (anything with ``next_k()`` and ``observe(outcome)``),
    with the protocol's defaults for the capabilities it does not declare."""

    def __init__(self, policy):
        self.policy = policy
        for capability in ("confidence_threshold", "learns", "plans", "weighs_catchup"):
            setattr(self, capability, getattr(policy, capability, getattr(Policy, capability)))

    def next_k(self) -> int:
        return self.policy.next_k()

    def observe(self, outcome: CycleOutcome) -> None:
        self.policy.observe(outcome)

    def plan(self, catchup_seconds: float, new_tokens: int, draft_cost_ratio: float) -> None:
        self.policy.plan(catchup_seconds, new_tokens, draft_cost_ratio)

    def catchup_pays(self, batch: int, behind: int, to_come: int) -> bool:
        return self.policy.catchup_pays(batch, behind, to_come)

    def observe_catchup(self, seconds: float, tokens: int) -> None:
        self.policy.observe_catchup(seconds, tokens)

    def catchup_sample(self) -> int:
        return self.policy.catchup_sample() if hasattr(self.policy, "catchup_sample") else 0

    def observe_sample(self, catchup_seconds: float, catchup_tokens: int, step_seconds: float, rows: int) -> None:
        if hasattr(self.policy, "observe_sample"):
            self.policy.observe_sample(catchup_seconds, catchup_tokens, step_seconds, rows)


def adopt(policy) -> Policy:
    """``policy`` itself if it is a ``Policy``, else wrapped in ``Adopted``."""
    return policy if isinstance(policy, Policy) else Adopted(policy)


class FixedK(Policy):
    """Always draft k tokens."""

    name = "fixed"
    learns = False

    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k


class ConfidenceStop(FixedK):
    """Draft up to k tokens, stopping once the draft's top probability falls below a threshold."""

    name = "confidence"

    def __init__(self, k: int, threshold: float = 0.4):
        super().__init__(k)
        self.confidence_threshold = threshold

    @classmethod
    def create(cls, k: int, confidence_threshold: float) -> Policy:
        return cls(k, confidence_threshold)


class Heuristic(Policy):
    """transformers' schedule: +2 after a fully accepted block, -1 otherwise, within [1, k_max]."""

    name = "heuristic"

    def __init__(self, k_max: int, start: int | None = None):
        self.k_max = k_max
        self.k = min(start or k_max, k_max)

    def next_k(self) -> int:
        return self.k

    def observe(self, outcome: CycleOutcome) -> None:
        if outcome.proposed == 0:
            return
        if all(n == outcome.proposed for n in outcome.accepted):
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, 1)


def make_policy(name: str, k: int, confidence_threshold: float = 0.4) -> Policy:
    """The policy called ``name`` with maximum draft length ``k``."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown; expected {', '.join(POLICIES)}")
    return POLICIES[name].create(k, confidence_threshold)


from .cost_model import CostModel  # noqa: E402 (registers "cost"; it builds on the protocol above)

__all__ = ["POLICIES", "ConfidenceStop", "CostModel", "CycleOutcome", "FixedK", "Heuristic", "Policy", "adopt", "make_policy"]
