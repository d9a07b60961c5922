"""ONNX Runtime engine: CPU by default; CUDA or TensorRT execution providers when present."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..contract import ModelSpec, io_problems
from .base import Engine, KVCache

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


class ProviderError(RuntimeError):
    """A requested execution provider is missing or silently fell back to another."""


_global_pool: int | None = None
_pool_lock = threading.Lock()  # sessions may be created on several threads at once (``open_artifact``)
# Calls of up to this many tokens (decode, draft and verify steps) get outputs preallocated once per
# shape and reused; longer calls (prefill chunks) get fresh ones, as holding a [batch, 512, vocab]
# logits buffer per shape would cost hundreds of MB.
REUSED_OUTPUT_TOKENS = 16
REUSED_SHAPES = 8


def shared_thread_pool(threads: int) -> None:
    """Let every session of this process share one intra-op pool of ``threads`` threads.

    With a pool per session, the idle session's spinning threads (the draft's while the target
    runs, and back) fight for the same cores. ONNX Runtime sets the pool once per process: a later
    request for another size keeps the first one, with a warning.
    """
    global _global_pool
    import onnxruntime as ort

    with _pool_lock:
        if _global_pool is None:
            ort.set_global_thread_pool_sizes(threads, 1)
            _global_pool = threads
            return
    if threads != _global_pool:
        warnings.warn(f"threads={threads}: this process's ONNX Runtime thread pool already has {_global_pool} threads "
                      "(ONNX Runtime sets it once per process); using it", stacklevel=3)


class OrtEngine(Engine):
    """A verify-v1 graph in an ONNX Runtime InferenceSession, driven through IOBinding."""

    def __init__(self, path: Path, spec: ModelSpec, provider: str = "cpu", threads: int | None = None,
                 optimization: str = "all", profile: Path | None = None):
        """``profile``: a file prefix; ONNX Runtime's profiler then records every node's time, written (as
        JSON) by ``self.session.end_profiling()`` (``tools/profile_ops.py``)."""
        import onnxruntime as ort

        if provider not in PROVIDERS:
            raise ProviderError(f"provider {provider!r} is unknown; expected one of {', '.join(PROVIDERS)}")
        wanted = PROVIDERS[provider]
        available = ort.get_available_providers()
        if wanted not in available:
            raise ProviderError(
                f"provider {provider!r} ({wanted}) is not available in this onnxruntime build; available: {available}. "
                "CUDA and TensorRT need onnxruntime-gpu in place of onnxruntime (the two overwrite each other's "
                "files): pip uninstall -y onnxruntime && pip install onnxruntime-gpu 'specdeploy[gpu]'"
            )
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = {
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[optimization]
        if profile is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(profile)
        if threads is not None:
            shared_thread_pool(threads)
        if _global_pool is not None:  # once a process has the shared pool, every session must use it
            options.use_per_session_threads = False
        else:
            # A pool of its own, whose threads stop spinning when a call ends: left spinning, the idle model's
            # threads ran against the busy one's on the same cores (fixed K = 4 at 20.7 tok/s, 29.8 with spinning
            # stopped, docs/bench_thread_pool.txt). No process-wide pool unless asked for (``threads``):
            # once one exists, ONNX Runtime refuses every later session a pool of its own, the user's too.
            options.add_session_config_entry("session.force_spinning_stop", "1")
        chain = [wanted] + (["CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [])
        self.session = ort.InferenceSession(str(path), options, providers=chain)
        active = self.session.get_providers()
        if active[0] != wanted:
            raise ProviderError(f"provider {wanted} was requested but the session fell back to {active}")
        self.spec = spec
        # On a device EP, ONNX Runtime copies a bound host input to the device when it is bound: the
        # runtime's in-place cache updates made afterwards would never reach the graph, so the caches
        # are rebound on every call there (a copy per call until the caches live on the device).
        self.binds_by_copy = wanted != "CPUExecutionProvider"
        self._check_graph()
        self._outputs = spec.outputs
        self._local = threading.local()

    def _check_graph(self) -> None:
        """The graph's inputs and outputs must be the ones the manifest declares, in order, with its types
        and sizes."""
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        if got_in != self.spec.inputs or got_out != self.spec.outputs:
            raise ProviderError(
                f"{self.spec.file}: graph inputs/outputs disagree with the manifest: got inputs {got_in[:4]}… "
                f"({len(got_in)}), outputs {got_out[:3]}… ({len(got_out)}); expected {self.spec.inputs[:4]}… "
                f"({len(self.spec.inputs)}), {self.spec.outputs[:3]}… ({len(self.spec.outputs)})"
                + _differences(got_in + got_out, self.spec.inputs + self.spec.outputs)
            )
        types = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}
        declared = {t.name: (types.get(t.type, t.type), t.shape)
                    for t in self.session.get_inputs() + self.session.get_outputs()}
        problems = io_problems(self.spec, declared)
        if problems:
            raise ProviderError(f"{self.spec.file}: graph disagrees with the manifest: " + "; ".join(problems[:3]))

    def infer_impl(self, input_ids, past_len, cache, kept):
        call = self._call((*input_ids.shape, kept))
        # The caches are preallocated and updated in place, so on the CPU they stay bound across calls
        # and are rebound only when the runtime hands over another cache (a new request, rows leaving).
        if call.bound is not cache or not isinstance(cache, KVCache) or self.binds_by_copy:
            buffers = cache.buffers if isinstance(cache, KVCache) else list(cache)  # a list's contents may change
            if (self.binds_by_copy or len(call.buffers) != len(buffers)
                    or not all(map(_same_memory, call.buffers, buffers))):
                self._forget_other_caches(buffers)
                for name, buf in zip(self.spec.cache_inputs, buffers):
                    call.binding.bind_cpu_input(name, buf)
                if self.spec.writes_cache:  # present_* is the cache itself: the graph writes the new K/V in place
                    for name, buf in zip(self.spec.outputs[1:], buffers):
                        call.binding.bind_output(name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
            call.bound, call.buffers = cache, buffers
        call.binding.bind_cpu_input("input_ids", input_ids)
        call.binding.bind_cpu_input("past_len", past_len)
        self.session.run_with_iobinding(call.binding)
        return call.logits, call.new_kv

    def _call(self, shape: tuple[int, int, int]) -> _BoundCall:
        """The IOBinding for calls of ``shape`` (batch, tokens, logits kept) on this thread, outputs bound to numpy
        arrays.

        One binding per shape and thread (a binding holds per-call state; a session may be shared),
        so a cycle's alternating shapes (draft steps of 1 token, verification of K + 1) never rebind.
        """
        calls = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = OrderedDict()
        call = calls.get(shape)
        if call is not None:
            calls.move_to_end(shape)
            return call
        call = _BoundCall(self.session.io_binding(), self.spec, shape, self.cache_dtype)
        if shape[1] <= REUSED_OUTPUT_TOKENS:
            calls[shape] = call
            if len(calls) > REUSED_SHAPES:
                calls.popitem(last=False)
        return call

    def _forget_other_caches(self, cache) -> None:
        """Drop this thread's bindings still bound to other caches: they would keep a finished request's
        buffers (hundreds of MB on a real model) alive for as long as their shape goes unused."""
        calls = self._local.calls
        for shape, call in list(calls.items()):
            if call.buffers and not _same_memory(call.buffers[0], cache[0]):
                del calls[shape]


def _differences(got: list[str], expected: list[str]) -> str:
    """The names one side has and the other lacks (the order aside), for a mismatch message."""
    extra, missing = [n for n in got if n not in expected], [n for n in expected if n not in got]
    return (f"; the graph has {extra[:4]} the manifest does not list" if extra else "") + (
        f"; the manifest lists {missing[:4]} the graph lacks" if missing else "")


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Two array objects over the same buffer (views of one cache made apart, e.g. by iterating it)."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape


class _BoundCall:
    """An IOBinding with its outputs bound to preallocated arrays: ONNX Runtime writes the results there."""

    def __init__(self, binding, spec: ModelSpec, shape: tuple[int, int, int], cache_dtype: np.dtype):
        batch, tokens, kept = shape
        self.binding, self.bound, self.buffers = binding, None, []
        if spec.trims_logits:
            self.kept = np.array([kept], np.int64)  # bound once: a binding serves one shape
            binding.bind_cpu_input("num_logits", self.kept)
        self.logits = np.empty((batch, kept, spec.vocab_size), np.float32)
        binding.bind_output(spec.outputs[0], "cpu", 0, np.float32, list(self.logits.shape), self.logits.ctypes.data)
        if spec.writes_cache:  # the cache outputs are bound with the cache inputs
            self.new_kv = None
            return
        self.new_kv = np.empty((2 * spec.num_layers, *spec.cache_shape(batch, tokens)), cache_dtype)
        for name, buf in zip(spec.outputs[1:], self.new_kv):
            binding.bind_output(name, "cpu", 0, cache_dtype, list(buf.shape), buf.ctypes.data)
