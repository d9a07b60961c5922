"""Ragged engine calls: one call serves rows that need different numbers of new tokens."""

from __future__ import annotations

import time

import numpy as np

from ..contract import PREFILL_CHUNK
from ..engines.base import Engine
from .cache import KVCache


def forward_rows(engine: Engine, cache: KVCache, tokens: np.ndarray, ends: np.ndarray):
    """Bring each row's cache up to ``ends[b]`` tokens of ``tokens`` [batch, width]; one engine call.

    Rows needing fewer new tokens than the longest re-feed tokens they already cached (their K/V is
    recomputed and overwritten with the same values), so one [batch, T] call serves a ragged
    batch. A row too short to start T tokens back is right-padded instead: its padding lands beyond
    ``ends[b]`` and is never committed.
    Returns logits [batch, T, vocab], start [batch] (logits[b, j] follows token start[b] + j), the
    engine's seconds and the staging seconds. Commits past_len = ends.
    """
    past = cache.past_len
    if len(past) == 1:  # batch 1, the latency case: plain ints and one slice
        first, last = past.item(0), ends.item(0)
        start, input_ids = past, tokens[:, first:last]  # a slice of one C-contiguous row: contiguous
    else:
        tokens_per_row = int((ends - past).max())
        start = np.maximum(0, np.minimum(past, ends - tokens_per_row))  # [batch]
        first = int(start[0])
        if (start == first).all():
            input_ids = tokens[:, first : first + tokens_per_row]
        else:
            index = np.minimum(start[:, None] + np.arange(tokens_per_row)[None, :], tokens.shape[1] - 1)
            input_ids = np.take_along_axis(tokens, index, axis=1)  # [batch, T]
        input_ids = np.ascontiguousarray(input_ids)
    out = engine.infer(input_ids, start, cache.buffers)
    began = time.perf_counter()
    cache.stage(out.new_kv, start)
    cache.commit(ends)
    return out.logits, start, out.seconds, time.perf_counter() - began


def prefill(engine: Engine, cache: KVCache, tokens: np.ndarray, goal: np.ndarray) -> None:
    """Bring each row's cache up to ``goal[b]`` tokens of ``tokens``, in calls of at most PREFILL_CHUNK tokens."""
    while np.any(cache.past_len < goal):
        forward_rows(engine, cache, tokens, np.minimum(goal, cache.past_len + PREFILL_CHUNK))


def forward_one(engine: Engine, cache: KVCache, next_tokens: np.ndarray):
    """One new token per row at each row's past_len (the drafting step): no ragged bookkeeping.

    next_tokens: [batch, 1] int64, C-contiguous (what ``argmax(-1)`` of the previous logits gives).
    Returns logits [batch, 1, vocab] (as the engine gave them: the argmax is the next call's input)
    and the engine's seconds.
    """
    past = cache.past_len
    out = engine.infer(next_tokens, past, cache.buffers)
    cache.stage(out.new_kv, past)
    cache.past_len = past + 1
    return out.logits, out.seconds
