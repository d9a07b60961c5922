"""onnxruntime-genai's graphs (its model builder's ``model.onnx``): GroupQueryAttention over one shared buffer.

The cache is [batch, kv_heads, capacity, head_dim] per layer, fed as ``past_key_values.i.*`` and bound as
``present.i.*`` (the same memory), so the new tokens' K/V are written in place as in our fused form. The graph takes no
lengths: it computes GroupQueryAttention's ``seqlens_k`` (ones - 1) and ``total_sequence_length`` (the mask's width)
from ``attention_mask``. Row b's mask is ones over its past_len[b] + tokens slots and zeros after, as wide as the
cache: rollback is a shorter mask, that is, a smaller past_len. Several new tokens after a past run at batch 1 only,
so such calls run row by row (``InPlaceCalls``), as our fused form's do.
"""

from __future__ import annotations

import numpy as np

from .base import KVCache
from .ort import OrtEngine, ShapeBuffers, cache_key


class GenaiEngine(OrtEngine):
    """An onnxruntime-genai graph behind the Engine interface (``ModelSpec.imported``, cache "shared")."""

    def shape_buffers(self, shape: tuple[int, int, int], captured: bool) -> ShapeBuffers:
        return MaskBuffers(self.session, self.spec, self.memory, shape, self.cache_dtype, self.graphs, captured)


class MaskBuffers(ShapeBuffers):
    """A call shape's buffers, the lengths input being an attention mask [batch, capacity] (one per cache bound)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.masks: dict[tuple, tuple] = {}  # cache key -> (bound mask, host mask); dropped with the cache's binding

    def binding(self, cache: KVCache) -> tuple:
        key = cache_key(cache)
        found = self.masks.get(key)
        if found is None:  # a new cache: its mask, and the masks of caches whose bindings went are dropped
            shape = (self.input_ids.shape[0], cache.capacity)
            bound = self.memory.zeros(shape, np.int64)
            found = (bound, bound if isinstance(bound, np.ndarray) else np.zeros(shape, np.int64))
            self.lengths, self.host_lengths = found  # what ``_bind`` binds as the lengths input
            binding = super().binding(cache)
            self.masks = {k: v for k, v in self.masks.items() if k in self.bindings} | {key: found}
            return binding
        self.lengths, self.host_lengths = found
        return super().binding(cache)

    def run(self, binding, options, input_ids: np.ndarray, past_len: np.ndarray) -> None:
        """Each row's mask: ones over its past and new tokens, zeros beyond; then run."""
        self.memory.upload(self.input_ids, input_ids)
        mask, tokens = self.host_lengths, input_ids.shape[1]
        for row, end in enumerate(past_len.tolist()):  # a row or two: slices beat a [batch, capacity] comparison
            mask[row, : end + tokens] = 1
            mask[row, end + tokens :] = 0
        if mask is not self.lengths:
            self.memory.upload(self.lengths, mask)
        self.session.run_with_iobinding(binding, options)
