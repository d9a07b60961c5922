"""Cache memory planning: how many slots a batch needs, and whether its caches fit.

The caches themselves belong to the engines (``engines.base.KVCache``): each model's cache holds
K/V for a prefix of a row's tokens, ``past_len[b]`` long; rollback moves that length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..contract import ModelSpec
from .config import GenerationConfig
from .rows import RowSettings


class CapacityError(ValueError):
    """A request that cannot fit in the cache capacity; ``field`` names what to change: ``prompt`` where it leaves no
    room for a new token, else ``max_new_tokens``."""

    def __init__(self, message: str, field: str = "max_new_tokens"):
        super().__init__(message)
        self.field = field


EXPORTED = "the artifact was exported with capacity {limit}"
ADVICE = "shorten the prompt, lower max_new_tokens or k, or re-export with a larger --capacity"


def slots_needed(prompt: int, max_new_tokens: int, k: int) -> int:
    """Cache slots one request needs: its prompt, its new tokens, and the k + 1 a verification writes beyond them
    (the one home of this rule)."""
    return prompt + max_new_tokens + k + 1


def plan_capacity(prompt_lengths: list[int], max_new_tokens: int, k: int, limit: int, role: str = "target",
                  why: str = EXPORTED) -> int:
    """Slots a batch needs: ``slots_needed`` of its longest prompt; refused above ``limit`` (``why`` says
    where the limit comes from)."""
    longest = max(prompt_lengths)
    needed = slots_needed(longest, max_new_tokens, k)
    if needed > limit:
        advice = ADVICE if why == EXPORTED else ADVICE.split(", or")[0]
        if slots_needed(longest, 1, k) > limit:  # no answer fits: the prompt (or k) is what to change
            larger = ", or re-export with a larger --capacity" if why == EXPORTED else ""
            raise CapacityError(f"{role}: prompt ({longest} tokens) + k ({k}) + 1 = {slots_needed(longest, 0, k)} cache "
                                f"slots leave no room for a new token: {why.format(limit=limit)}; shorten the prompt or "
                                f"lower k{larger}", field="prompt")
        raise CapacityError(
            f"{role}: prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + k ({k}) + 1 = "
            f"{needed} cache slots, but {why.format(limit=limit)}; {advice}"
        )
    return needed


def cache_bytes(specs: dict[str, ModelSpec], batch: int, capacity: int) -> dict[str, int]:
    """KV-cache bytes of a batch of ``batch`` rows of ``capacity`` slots, per model role and in total."""
    sizes = {role: spec.cache_bytes(batch, capacity) for role, spec in specs.items()}
    sizes["total"] = sum(sizes.values())
    return sizes


def plan_batch(prompt_lengths: list[int], config: GenerationConfig, limit: int, specs: dict[str, ModelSpec],
               max_cache_bytes: int | None = None, why: str = EXPORTED, capacity: int | None = None) -> int:
    """Cache slots a row for a batch: ``capacity`` where the caller fixes them (each row checked to fit them alone),
    else what its longest prompt and answer need (``plan_capacity``); refused if the caches of the models in ``specs``
    would need more than ``max_cache_bytes`` together at those slots."""
    if capacity is None:
        capacity = plan_capacity(prompt_lengths, config.max_new_tokens, config.max_drafts, limit, why=why)
    if max_cache_bytes is not None:
        sizes = cache_bytes(specs, len(prompt_lengths), capacity)
        if sizes["total"] > max_cache_bytes:
            detail = ", ".join(f"{role} {n / 2**20:.1f} MiB" for role, n in sizes.items() if role != "total")
            raise CapacityError(
                f"KV caches for {len(prompt_lengths)} rows x {capacity} slots need {sizes['total'] / 2**20:.1f} MiB "
                f"({detail}), over the limit of {max_cache_bytes / 2**20:.1f} MiB; use a smaller batch, fewer new "
                "tokens or k"
            )
    return capacity


def rows_slots(prompts: list[np.ndarray], config: GenerationConfig, settings: Sequence[RowSettings] | None, k: int,
               limit: int) -> int:
    """Cache slots rows need (``plan_capacity``), each prompt with its own max_new_tokens (``settings``; default
    ``config``'s)."""
    news = [row.config.max_new_tokens for row in settings] if settings else [config.max_new_tokens] * len(prompts)
    return max(plan_capacity([len(prompt)], new, k, limit) for prompt, new in zip(prompts, news))
