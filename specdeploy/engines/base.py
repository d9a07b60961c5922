"""One Engine interface over every backend; the runtime never asks which backend it has."""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..contract import ModelSpec

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class EngineInputError(ValueError):
    """An input that does not fit the engine's verify contract."""


@dataclass
class EngineOutput:
    """One call's results. They may live in buffers the engine reuses: valid until the engine's next
    call on the same thread with the same batch and token count; copy what must outlive that."""

    logits: np.ndarray  # [batch, tokens, vocab] float32
    # 2 * layers arrays [k0, v0, k1, ...], each [batch, kv_heads, tokens, head_dim]; ONNX Runtime
    # returns them as one stacked array [2 * layers, batch, kv_heads, tokens, head_dim]
    new_kv: np.ndarray | list[np.ndarray]
    seconds: float


class Engine(ABC):
    """A verify-v1 decoder. ``infer`` checks inputs and times the call; backends implement ``infer_impl``."""

    spec: ModelSpec

    @property
    def cache_dtype(self) -> np.dtype:
        return np.dtype(NUMPY_DTYPES[self.spec.dtype])

    def allocate_cache(self, batch: int, capacity: int) -> np.ndarray:
        """Zero-filled key/value buffers [k0, v0, k1, v1, ...], each [batch, kv_heads, capacity, head_dim].

        One array [2 * layers, batch, kv_heads, capacity, head_dim]: element i is cache tensor i, and
        staging a call's new K/V into every layer is one copy.
        """
        shape = self.spec.cache_shape(batch, capacity)
        return np.zeros((2 * self.spec.num_layers, *shape), self.cache_dtype)

    def infer(self, input_ids: np.ndarray, past_len: np.ndarray, cache: list[np.ndarray]) -> EngineOutput:
        """Run new tokens ``input_ids`` [batch, tokens] at ``past_len`` [batch] over ``cache``."""
        self._check(input_ids, past_len, cache)
        start = time.perf_counter()
        logits, new_kv = self.infer_impl(input_ids, past_len, cache)
        return EngineOutput(logits, new_kv, time.perf_counter() - start)

    @abstractmethod
    def infer_impl(self, input_ids, past_len, cache) -> tuple[np.ndarray, list[np.ndarray]]:
        """Run the backend on checked inputs; return logits and the new K/V per layer."""

    def _check(self, input_ids, past_len, cache) -> None:
        role = self.spec.role
        if not isinstance(input_ids, np.ndarray) or input_ids.dtype != np.int64 or input_ids.ndim != 2:
            raise EngineInputError(
                f"{role}: input tensor input_ids | received {_describe(input_ids)}; expected int64 [batch, tokens]"
            )
        batch, tokens = input_ids.shape
        if batch == 0 or tokens == 0:
            raise EngineInputError(f"{role}: input tensor input_ids | received empty shape {input_ids.shape}")
        if not isinstance(past_len, np.ndarray) or past_len.dtype != np.int64 or past_len.shape != (batch,):
            raise EngineInputError(
                f"{role}: input tensor past_len | received {_describe(past_len)}; expected int64 ({batch},)"
            )
        capacity = self._check_cache(cache, batch)
        # decode, draft and verify calls pass a handful of values: Python's min/max beat four NumPy reductions
        past = past_len.tolist()
        if min(past) < 0 or max(past) + tokens > capacity:
            raise EngineInputError(f"{role}: past_len {past} + {tokens} new tokens exceeds cache capacity {capacity}")
        if input_ids.size <= 64:
            ids = input_ids.ravel().tolist()
            low, high = min(ids), max(ids)
        else:
            low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.spec.vocab_size:
            raise EngineInputError(
                f"{role}: input_ids range [{low}, {high}] outside the vocabulary [0, {self.spec.vocab_size})"
            )

    def _check_cache(self, cache, batch: int) -> int:
        """Check the cache tensors' count, shapes and dtype; return their capacity.

        A request passes the same tensors on every call, so the last tensors that passed are remembered
        and not checked again while they are the ones passed (by identity): 56 on a 28-layer model.
        """
        known = getattr(self, "_checked_cache", ())
        if len(known) == len(cache) and all(ref() is buf for ref, buf in zip(known, cache)) and cache[0].shape[0] == batch:
            return cache[0].shape[2]
        if len(cache) != 2 * self.spec.num_layers:
            raise EngineInputError(f"{self.spec.role}: received {len(cache)} cache tensors; expected {2 * self.spec.num_layers}")
        first = cache[0]
        capacity = first.shape[2] if first.ndim == 4 else -1
        expected = self.spec.cache_shape(batch, capacity)
        for i, buf in enumerate(cache):
            if buf.shape != expected or buf.dtype != self.cache_dtype:
                name = f"cache_{'key' if i % 2 == 0 else 'value'}.{i // 2}"
                raise EngineInputError(
                    f"{self.spec.role}: input tensor {name} | received {_describe(buf)}; expected {self.spec.dtype} {expected}"
                )
        self._checked_cache = [weakref.ref(buf) for buf in cache]  # weak: a finished request's caches must go
        return capacity


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {value.shape}"
    return type(value).__name__
