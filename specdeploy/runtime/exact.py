"""Exact mode (``GenerationConfig.exact``): the target a request's calls run on, the costs its policy prices by, and
the check of whether a target can give it.

Exact mode pads every target call to an even number of tokens a row (``engines.even.EvenTokens``), so that greedy
speculative output is exact-mode plain output bit for bit. Its calls cost otherwise (a plain step is a two-token call),
so its requests' policies price by a cost table of their own.
"""

from __future__ import annotations

from ..engines.base import Engine
from ..engines.even import EvenTokens
from .config import ConfigError
from .cost_policy import Costs


class ExactMode:
    """Exact mode's target (``target`` with every call padded: ``EvenTokens``) and its cost table."""

    def __init__(self, target: Engine):
        self.target, self.costs = EvenTokens(target), Costs()


def check_exact(spec) -> None:
    """Refuse exact mode on a target whose graph cannot give it: the explicit form's attention sums the keys of a
    call's own tokens apart from the cache's (``exporter.layers.cached_attention``), so a position's logits depend on
    which of its keys came in the same call, and on the cache's capacity (docs/results/exactness/)."""
    if spec.graph != "fused":
        raise ConfigError(f"exact: the target's graph is the {spec.graph} form; exact mode needs the fused form (its attention "
                          "reads every key from the cache in place, whichever call wrote it): re-export with --graph fused")
