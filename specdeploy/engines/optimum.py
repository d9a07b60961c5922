"""optimum's graphs (``optimum-cli export onnx --task text-generation-with-past``): standard ops, present = past
followed by the new tokens.

The engine keeps each layer's cache as a buffer of capacity slots, as for our graphs, and feeds its first
max(past_len) slots as past; the new tokens' K/V, present's last ``tokens`` positions, are returned to be written
at each row's past_len (``StagedCalls``), so rollback is still a length. Rows of a ragged batch are padded to the
longest past: a row's slots between its own past_len and the longest are masked out of the attention mask, and its
positions come from ``position_ids``. Feeding the past copies it (the graph copies it into present anyway): that is
the cost of this layout, paid on every call.
"""

from __future__ import annotations

import numpy as np

from .base import KVCache
from .ort import OrtEngine


class OptimumEngine(OrtEngine):
    """An optimum graph behind the Engine interface (``ModelSpec.imported``, cache "concatenated"); host memory."""

    def allocate_cache(self, batch: int, capacity: int) -> KVCache:
        """Host buffers wherever the session computes: each call copies the past it feeds anyway."""
        shape = self.spec.cache_shape(batch, capacity)
        return KVCache(np.zeros((2 * self.spec.num_layers, *shape), self.cache_dtype))

    def infer_impl(self, input_ids, past_len, cache: KVCache, kept):
        io, spec = self.spec.imported, self.spec
        tokens = input_ids.shape[1]
        longest = int(past_len.max())
        slots = np.arange(longest + tokens)
        # row b sees its own past (slots < past_len[b]) and the new tokens (slots >= longest): [batch, longest + tokens]
        mask = (slots < past_len[:, None]) | (slots >= longest)
        feeds = {io.input_ids: input_ids, io.attention_mask: mask.astype(np.int64)}
        if io.position_ids:
            feeds[io.position_ids] = past_len[:, None] + np.arange(tokens)  # [batch, tokens]
        if spec.trims_logits:  # the import sliced the head's input: the logits of each row's last ``kept`` positions
            feeds["num_logits"] = np.array([kept], np.int64)
        for name, buffer in zip(spec.cache_inputs, cache.buffers):
            feeds[name] = np.ascontiguousarray(buffer[:, :, :longest])
        logits, *present = self.session.run(spec.outputs, feeds)
        new_kv = np.stack([layer[:, :, longest:] for layer in present])  # [2 * layers, batch, kv_heads, tokens, head_dim]
        return logits, new_kv, None
