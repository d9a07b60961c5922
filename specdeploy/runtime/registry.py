"""The policies and drafters by name (``--policy NAME``, ``--drafter NAME``, ``GenerationConfig``)."""

from __future__ import annotations

from collections.abc import Callable

from ..engines.base import Engine
from .config import GenerationConfig
from .cost_policy import CostPolicy, Costs
from .drafters import Drafter, HybridDrafter, ModelDrafter, NoDrafter, PromptLookup, SuffixDrafter
from .policies import ConfidenceStop, FixedK, Heuristic, Policy

# name -> (k, confidence threshold, the pipeline's cost table) -> policy
POLICIES = {
    "cost": lambda k, threshold, costs: CostPolicy(k, costs),
    "fixed": lambda k, threshold, costs: FixedK(k),
    "confidence": lambda k, threshold, costs: ConfidenceStop(k, threshold),
    "heuristic": lambda k, threshold, costs: Heuristic(k),
}


def _hybrid(engine: Engine | None, stop_below: float | None) -> HybridDrafter:
    """The default: a suffix index and, where the artifact has one, the draft model."""
    return HybridDrafter(SuffixDrafter(), ModelDrafter(engine, stop_below) if engine is not None else None)


# name -> (the draft model or None, the policy's confidence stop) -> drafter
DRAFTERS: dict[str, Callable[[Engine | None, float | None], Drafter]] = {
    "hybrid": _hybrid,
    "model": ModelDrafter,
    "suffix": lambda engine, stop_below: SuffixDrafter(),
    "prompt-lookup": lambda engine, stop_below: PromptLookup(),
    "none": lambda engine, stop_below: NoDrafter(),
}


def make_policy(name: str, k: int, confidence_threshold: float = 0.4, costs: Costs | None = None) -> Policy:
    """The policy called ``name`` with at most ``k`` drafts a cycle, pricing by ``costs`` (the pipeline's table)."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown; expected one of {', '.join(POLICIES)}")
    return POLICIES[name](k, confidence_threshold, costs if costs is not None else Costs())


def make_drafter(name: str, engine: Engine | None, stop_below: float | None = None) -> Drafter:
    """The drafter called ``name`` over the draft model ``engine`` (None: the artifact has none)."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter {name!r} is unknown; expected one of {', '.join(DRAFTERS)}")
    return DRAFTERS[name](engine, stop_below)


def policy_of(config: GenerationConfig, costs: Costs) -> Policy:
    """The policy ``config`` names, at its k and confidence threshold, pricing by ``costs``."""
    return make_policy(config.policy, config.k, config.confidence_threshold, costs)


def speculation(config: GenerationConfig, draft: Engine | None, costs: Costs,
                policy: Policy | None = None) -> tuple[Policy, Drafter]:
    """``config``'s policy (``policy`` when given: a server's, which outlives a batch) and its drafter over the draft
    model ``draft``, with the policy's confidence stop; a config that does not speculate drafts nothing."""
    policy = policy if policy is not None else policy_of(config, costs)
    return policy, make_drafter(config.drafter if config.speculative else "none", draft, policy.stop_below)
