"""Calls of an even number of tokens a row: the arithmetic behind exact mode (``GenerationConfig.exact``).

A compressed target's kernels branch on how many positions a call carries: ONNX Runtime's int4 MatMulNBits computes a
one-row call (and, at accuracy level 4 with 128-weight blocks, the odd last row of any call) with another kernel than
rows in pairs, and GroupQueryAttention writes a one-token call's K/V by another path than a several-token call's
(docs/results/exactness/). The two differ by a few units in the last place, which 28 layers grow to ~1 logit, and a
near-tie can go either way. Through ``EvenTokens`` every call carries an even number of tokens a row, at least 2 (one
dummy token appended where the count is odd), so every position runs the same kernels whichever call computes it:
a plain step, a verification's row j or a prefill chunk; its logits and the K/V it writes are the same bits.
The dummy's logits are dropped and its K/V lands one slot past the call's tokens, beyond the committed length,
where the next call overwrites it (rollback moves a length).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import Engine, EngineOutput, KVCache


class EvenTokens(Engine):
    """``engine`` with every call padded to an even number of tokens a row (its session, spec and caches)."""

    def __init__(self, engine: Engine):
        self.engine, self.spec = engine, engine.spec

    @property
    def call_form(self):
        return self.engine.call_form  # the inner engine's: closed with it

    @property
    def cache_dtype(self) -> np.dtype:
        return self.engine.cache_dtype

    def allocate_cache(self, batch: int, capacity: int) -> KVCache:
        return self.engine.allocate_cache(batch, capacity)

    def infer_impl(self, input_ids, past_len, cache: KVCache, kept: int) -> tuple:
        return self.engine.infer_impl(input_ids, past_len, cache, kept)

    def infer(self, input_ids: np.ndarray, past_len: np.ndarray, cache: KVCache, last: int | None = None,
              widths: Sequence[int] | None = None) -> EngineOutput:
        """``Engine.infer`` of ``input_ids`` [batch, tokens] with one dummy token (each row's last again) after them
        where ``tokens`` is odd, and each row's ``widths`` rounded up to even; returns what ``Engine.infer`` returns
        for the given tokens alone (the dummy's logits and ids dropped). The dummy's K/V is written at slot
        past_len[b] + tokens: the cache must hold it."""
        if not isinstance(input_ids, np.ndarray) or input_ids.ndim != 2:
            return super().infer(input_ids, past_len, cache, last, widths)  # refused there, in the engine's words
        batch, tokens = input_ids.shape
        if widths is not None:  # checked against the call as given, then rounded up with it
            widths = [w + w % 2 for w in self._checked_widths(widths, batch, tokens)]
        if tokens % 2 == 0:
            return super().infer(input_ids, past_len, cache, last, widths)
        padded = np.concatenate([input_ids, input_ids[:, -1:]], axis=1)
        out = super().infer(padded, past_len, cache, None if last is None else last + 1, widths)
        real = slice(0, out.logits.shape[1] - 1)  # the dummy's position is the last kept
        ids = None if out._ids is None else out.ids[:, real]
        return EngineOutput(out.logits[:, real], out.new_kv, out.seconds, out.stage_seconds, ids)
