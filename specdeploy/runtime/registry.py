"""The policies and drafters by name (``--policy NAME``, ``--drafter NAME``, ``GenerationConfig``)."""

from __future__ import annotations

from collections.abc import Callable

from ..engines.base import Engine
from ..values import short
from .config import GenerationConfig
from .cost_policy import CostPolicy, Costs
from .drafters import Drafter, HybridDrafter, ModelDrafter, NoDrafter, PromptLookup, SuffixDrafter
from .errors import ConfigError
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
NEEDS_DRAFT_MODEL = ("model",)  # the drafters that cannot run without the artifact's draft model
USE_A_MODEL = ("model", "hybrid")  # the drafters that draft with the artifact's draft model where it has one


def make_policy(name: str, k: int, confidence_threshold: float = 0.4, costs: Costs | None = None) -> Policy:
    """The policy called ``name`` with at most ``k`` drafts a cycle, pricing by ``costs`` (the pipeline's table)."""
    if name not in POLICIES:
        raise ValueError(f"policy {short(name)} is unknown; expected one of {', '.join(POLICIES)}")
    return POLICIES[name](k, confidence_threshold, costs if costs is not None else Costs())


def check_drafter(name: str, has_draft_model: bool) -> None:
    """ConfigError where the drafter called ``name`` needs the draft model an artifact lacks; builds nothing."""
    if name in NEEDS_DRAFT_MODEL and not has_draft_model:
        raise ConfigError(f"drafter: {name!r} needs a draft model, and this artifact has none; use drafter='hybrid' (the "
                          "suffix index alone without one), 'suffix', 'prompt-lookup' or 'none', or export with --draft")


def make_drafter(name: str, engine: Engine | None, stop_below: float | None = None) -> Drafter:
    """The drafter called ``name`` over the draft model ``engine`` (None: the artifact has none; ``check_drafter``)."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter {short(name)} is unknown; expected one of {', '.join(DRAFTERS)}")
    check_drafter(name, engine is not None)
    return DRAFTERS[name](engine, stop_below)


def drafter_name(config: GenerationConfig) -> str:
    """The drafter a config's batch drafts with: the one it names, ``none`` where it does not speculate."""
    return config.drafter if config.speculative else "none"


def policy_of(config: GenerationConfig, costs: Costs) -> Policy:
    """The policy ``config`` names, at its k and confidence threshold, pricing by ``costs``."""
    return make_policy(config.policy, config.k, config.confidence_threshold, costs)


def speculation(config: GenerationConfig, draft: Engine | None, costs: Costs,
                policy: Policy | None = None) -> tuple[Policy, Drafter]:
    """``config``'s policy (``policy`` when given: a server's, which outlives a batch) and its drafter over the draft
    model ``draft``, with the policy's confidence stop; a config that does not speculate drafts nothing."""
    policy = policy if policy is not None else policy_of(config, costs)
    return policy, make_drafter(drafter_name(config), draft, policy.stop_below)
