"""KV cache staging and commit. Rollback moves a length: nothing is copied or cropped.

Each model's cache holds K/V for a prefix of a row's tokens; ``past_len[b]`` is that prefix's
length. New K/V are staged at ``past_len .. past_len + T``; commit moves ``past_len`` to the
accepted prefix, and rejected entries beyond it are simply overwritten by the next call.
"""

from __future__ import annotations

import numpy as np


class CapacityError(ValueError):
    """A request that cannot fit in the cache capacity."""


def plan_capacity(prompt_lengths: list[int], max_new_tokens: int, k: int, limit: int, role: str = "target") -> int:
    """Slots a batch needs: longest prompt + max_new_tokens + k + 1; refused above ``limit``."""
    needed = max(prompt_lengths) + max_new_tokens + k + 1
    if needed > limit:
        raise CapacityError(
            f"{role}: prompt ({max(prompt_lengths)} tokens) + max_new_tokens ({max_new_tokens}) + k ({k}) + 1 = "
            f"{needed} cache slots, but the artifact was exported with capacity {limit}; shorten the prompt, lower "
            "max_new_tokens or k, or re-export with a larger --capacity"
        )
    return needed


class KVCache:
    """Preallocated, zero-filled K/V buffers of one model for a batch, and each row's past_len.

    ``stacked`` is one array [2 * layers, batch, kv_heads, capacity, head_dim] (what
    ``Engine.allocate_cache`` returns); ``buffers`` lists its per-layer tensors, the objects the
    engine keeps bound between calls.
    """

    def __init__(self, stacked: np.ndarray):
        self.stacked = stacked
        self.buffers = list(stacked)  # [k0, v0, k1, v1, ...], each [batch, kv_heads, capacity, head_dim]
        self.past_len = np.zeros(stacked.shape[1], dtype=np.int64)  # [batch]

    @property
    def capacity(self) -> int:
        return self.stacked.shape[3]

    def stage(self, new_kv, start: np.ndarray) -> None:
        """Write new K/V (2 * layers of [batch, kv_heads, T, head_dim]) at slots start[b] .. start[b] + T."""
        s = start.item(0)
        if len(start) == 1 or (start == s).all():
            self.stage_at(new_kv, s)
            return
        new_kv = np.asarray(new_kv)
        tokens = new_kv.shape[3]
        for b, s in enumerate(start.tolist()):
            self.stacked[:, b, :, s : s + tokens] = new_kv[:, b]

    def stage_at(self, new_kv, slot: int) -> None:
        """Write new K/V (2 * layers of [batch, kv_heads, T, head_dim]) at slots slot .. slot + T of every row."""
        if not isinstance(new_kv, np.ndarray):  # engines may return a list; ONNX Runtime returns one stacked array
            new_kv = np.asarray(new_kv)
        self.stacked[:, :, :, slot : slot + new_kv.shape[3]] = new_kv  # every layer in one copy

    def commit(self, lengths: np.ndarray) -> None:
        """Move each row's valid prefix to ``lengths`` [batch].

        The array is kept, not copied: arrays of lengths are replaced, never written into (here, in
        the decoder and the drafters), so a caller or a snapshot may hold the same one.
        """
        self.past_len = np.asarray(lengths, dtype=np.int64)

    def commit_row(self, row: int, length: int) -> None:
        """Move one row's valid prefix to ``length``, in a new array (see ``commit``)."""
        past = self.past_len.copy()
        past[row] = length
        self.past_len = past

    def select(self, rows: np.ndarray) -> None:
        """Keep only ``rows`` (finished rows leave the batch)."""
        self.stacked = np.ascontiguousarray(self.stacked[:, rows])
        self.buffers = list(self.stacked)
        self.past_len = self.past_len[rows]

    def view(self, row: int) -> KVCache:
        """Row ``row`` alone, on views of the batch buffers: what it stages lands in the batch."""
        single = KVCache(self.stacked[:, row : row + 1])
        single.past_len = self.past_len[row : row + 1].copy()
        return single
