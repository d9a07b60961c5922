"""Where a greedy output leaves plain decoding, and by what margin the target chose there."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..engines.base import Engine, feed, prefill
from .cache import plan_capacity
from .config import ConfigError, GenerationConfig, checked_token_ids


def first_divergence(target: Engine, prompt_ids: np.ndarray, reference: Sequence[int], other: Sequence[int],
                     config: GenerationConfig) -> dict | None:
    """Where greedy ``other`` leaves ``reference``, plain decoding's view of it under ``config``.

    Returns the position and the margin logit(reference token) - logit(other token) as plain
    decoding computed it: the target replays that request alone (prefill, then one token a call,
    in a cache of the capacity the request planned: compressed kernels give slightly different
    logits for other call shapes and capacities) up to the position. A small margin is a near-tie
    that the engine's arithmetic can tip (verifying K + 1 tokens at once is not bit-identical to
    decoding one: docs/runtime.md, Exact mode); a large one points at a bug. None when neither leaves the other.
    ``reference`` and ``other`` must be token ids inside the vocabulary (ConfigError naming them otherwise).
    """
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"config: got {type(config).__name__}; expected a GenerationConfig")
    vocab = target.spec.vocab_size
    reference = checked_token_ids(reference, vocab, "reference").tolist()
    other = checked_token_ids(other, vocab, "other").tolist()
    position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if position is None:
        return None
    ids = np.concatenate([prompt_ids, np.asarray(reference[:position], np.int64)])[None]
    prompt_end = len(prompt_ids) - 1  # plain decoding prefills all prompt tokens but the last
    capacity = plan_capacity([len(prompt_ids)], config.max_new_tokens, config.max_drafts,
                             target.spec.capacity)
    cache = target.allocate_cache(1, capacity)
    prefill(target, cache, ids, [prompt_end])
    for at in range(prompt_end, ids.shape[1]):
        logits, _ = feed(target, cache, ids, [at + 1])
    last = logits[0]
    a, b = int(reference[position]), int(other[position])
    return {"position": position, "reference_token": a, "other_token": b, "margin": float(last[a] - last[b])}
