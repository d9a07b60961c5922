"""ONNX Runtime engine: CPU by default; CUDA, TensorRT or OpenVINO execution providers when present (``providers``).

The engine's caches, inputs and outputs live where the session computes (``HostMemory``: NumPy; ``CudaMemory``: CuPy,
whose stream ONNX Runtime computes on) and are bound once by address (``ShapeBuffers``); on CUDA each call shape can run as
a captured CUDA graph (``graphs``).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..contract import ModelSpec, io_problems
from ..digests import cache_dir
from .base import Engine, KVCache, NewCache, allocated, state_slots
from .graphs import PLAIN, GraphIds, open_session, run_options
from .memory import address, transfers
from .providers import (
    COMPILED_FOLDER,
    PROVIDERS,
    Provider,
    ProviderError,
    assignment,
    check_available,
    check_graph,
    check_whole,
    record_placement,
)

__all__ = ["PROVIDERS", "OrtEngine", "Provider", "ProviderError", "check_provider", "placement"]

_global_pool: int | None = None
_pool_lock = threading.Lock()  # sessions may be created on several threads at once (``open_artifact``)
# Calls of up to this many tokens (decode, draft and verify steps) get outputs preallocated once per
# shape and reused; longer calls (prefill chunks) get fresh ones, as holding a [batch, 512, vocab]
# logits buffer per shape would cost hundreds of MB.
REUSED_OUTPUT_TOKENS = 16
REUSED_SHAPES = 8
TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64", "tensor(int32)": "int32"}


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


def fit_thread_pool(options) -> None:
    """ONNX Runtime ``options`` on this process's pool: the shared one once made (``shared_thread_pool``; then every
    session must use it, the user's too), else its own, whose threads stop spinning when a call ends (the idle model's
    spinning threads slowed the busy one's: docs/results/thread_pool/thread_pool.txt)."""
    if _global_pool is not None:
        options.use_per_session_threads = False
    else:
        options.add_session_config_entry("session.force_spinning_stop", "1")


class OrtEngine(Engine):
    """A verify-v1 graph in an ONNX Runtime InferenceSession, driven through IOBinding, its buffers where the session
    computes: NumPy arrays on the CPU, CuPy arrays on a GPU (``device``). No K/V byte crosses between host and device
    in a call: the inputs' few integers go in, and the logits or argmax ids come out only when read."""

    def __init__(self, path: Path, spec: ModelSpec, provider: str | Provider = "cpu", threads: int | None = None,
                 optimization: str = "all", profile: Path | None = None, cuda_graphs: bool | None = None):
        """``provider``: a word of PROVIDERS or a ``Provider`` with its options. ``profile``: a file prefix; ONNX
        Runtime's profiler then records every node's time, written (as JSON) by ``self.session.end_profiling()``
        (``tools/profile_ops.py``). ``cuda_graphs``: capture each call shape as a CUDA graph (provider "cuda" only;
        default: on where every node can run on the GPU, a fused graph that takes seqlens_k, and no profile is asked
        for)."""
        provider = Provider.of(provider)
        _check_wanted(path, spec, provider, cuda_graphs)
        if cuda_graphs is None:  # a fused hybrid that computes its state slots in the graph copies them in: no capture
            cuda_graphs = (provider.name == "cuda" and spec.takes_seqlens_k and (spec.takes_state_slots or not spec.states)
                           and profile is None)
        options = _session_options(optimization, profile, threads, provider)
        self.provider = provider
        # TensorRT's EP takes no user stream (ONNX Runtime's Python API passes one to the CUDA EP alone)
        self.memory = HostMemory() if provider.on_host else CudaMemory(shared_stream=provider.name == "cuda")
        self.session, captures = open_session(lambda graphs: self._create(path, options, provider, threads, graphs),
                                              cuda_graphs, str(path))
        captures = self._check_providers(provider.ep, captures)
        if provider.name == "openvino":
            check_whole(self.session, path, spec, provider)
        self.spec = spec
        self.graphs = GraphIds(str(path)) if captures else None
        self._check_graph()
        self._local = threading.local()
        if provider.prepares_shapes:
            self._prepare()

    def _create(self, path: Path, options, provider: Provider, threads: int | None, graphs: bool):
        """An InferenceSession on ``provider`` (the CPU EP behind a device EP), capturing CUDA graphs if ``graphs``.
        OpenVINO's compiled blobs for a GPU or an NPU are kept under $SPECDEPLOY_CACHE (``Provider.caches_compiled``)."""
        import onnxruntime as ort

        wanted = provider.ep
        compiled = cache_dir() / COMPILED_FOLDER if provider.caches_compiled else None
        device_options = (self.memory.provider_options() | provider.ep_options(threads, compiled)
                          | ({"enable_cuda_graph": "1"} if graphs else {}))
        chain = [(wanted, device_options)] + (["CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [])
        try:
            return ort.InferenceSession(str(path), options, providers=chain)
        except Exception as exc:
            if "user_compute_stream" not in str(exc):
                raise
            self.memory.shared_stream = False  # a build that takes no user stream: inputs uploaded and waited for
            return self._create(path, options, provider, threads, graphs)

    def _check_providers(self, wanted: str, captures: bool) -> bool:
        """Refuse a session that fell back to another EP; return whether it captures CUDA graphs after all (ONNX Runtime
        retries an EP that refused its options without them, "EP Error ... Falling back": what counts is what it took)."""
        active = self.session.get_providers()
        if active[0] != wanted:
            raise ProviderError(f"provider {wanted} was requested but the session fell back to {active}")
        applied = self.session.get_provider_options().get(wanted, {})
        if isinstance(self.memory, CudaMemory) and applied.get("has_user_compute_stream", "1") != "1":
            self.memory.shared_stream = False
        return captures and applied.get("enable_cuda_graph", "1") == "1"

    def _check_graph(self) -> None:
        """The graph's inputs and outputs must be the ones the manifest declares, in order, with its types
        and sizes."""
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        order = sorted if self.spec.imported else list  # bound by name: a graph we did not write lists them its own way
        if order(got_in) != order(self.spec.inputs) or order(got_out) != order(self.spec.outputs):
            raise ProviderError(
                f"{self.spec.file}: graph inputs/outputs disagree with the manifest: got inputs {got_in[:4]}… "
                f"({len(got_in)}), outputs {got_out[:3]}… ({len(got_out)}); expected {self.spec.inputs[:4]}… "
                f"({len(self.spec.inputs)}), {self.spec.outputs[:3]}… ({len(self.spec.outputs)})"
                + _differences(got_in + got_out, self.spec.inputs + self.spec.outputs)
            )
        declared = {t.name: (TYPES.get(t.type, t.type), t.shape)
                    for t in self.session.get_inputs() + self.session.get_outputs()}
        problems = io_problems(self.spec, declared)
        if problems:
            raise ProviderError(f"{self.spec.file}: graph disagrees with the manifest: " + "; ".join(problems[:3]))

    @property
    def rows_alike(self) -> bool:
        """OpenVINO's CPU kernels at FP32 compute a position alike in calls of any size (its int4 matrix products, its
        attention; measured bit for bit on the demo's 1.5B target, T = 1 .. 10, docs/results/openvino/; held by
        tests/engines/test_openvino.py); ONNX Runtime's CPU kernels do not (docs/results/exactness/)."""
        return self.provider.computes_rows_alike

    def allocate_cache(self, batch: int, capacity: int) -> KVCache:
        """Zero-filled key/value buffers [k0, v0, k1, v1, ...], each [batch, kv_heads, capacity, head_dim] (and each
        recurrent state's, ``ModelSpec.states``), where the session computes: host memory on the CPU, the GPU's on CUDA.
        On a provider that prepares each new input shape (OpenVINO), the exported capacity whatever ``capacity`` asks: a
        request's own would be a new shape for every call it makes (its graph reads only the filled slots, so the extra
        ones cost memory, not time)."""
        if self.provider.prepares_shapes:
            capacity = max(capacity, self.spec.capacity)
        return allocated(self.spec, batch, capacity, self.cache_dtype, self.memory.zeros)

    def _prepare(self) -> None:
        """One call of one token, so that the preparation a provider makes at its first call (OpenVINO's: seconds for a
        1.5B model, docs/results/openvino/) is paid while loading, not inside the first request's timing."""
        cache = self.allocate_cache(1, self.spec.capacity)
        self.infer(np.zeros((1, 1), np.int64), np.zeros(1, np.int64), cache)
        self._local = threading.local()  # the one-token call's buffers were bound to that cache

    def infer_impl(self, input_ids, past_len, cache: KVCache, kept):
        batch, tokens = input_ids.shape
        shape = self._buffers((batch, tokens, kept))
        binding, options = shape.binding(cache)
        shape.run(binding, options, input_ids, past_len)
        new = shape.new_kv if not shape.new_states else NewCache(shape.new_kv, tuple(shape.new_states))
        return shape.logits, new, shape.ids

    def close(self) -> None:
        """Release the session and every buffer bound to it (every thread's); later calls raise EngineClosedError."""
        super().close()
        self._local = threading.local()  # the old one, and each thread's buffers with it, goes
        self.session = self.graphs = None

    def _buffers(self, shape: tuple[int, int, int]) -> ShapeBuffers:
        """The buffers (and bindings) of calls of ``shape`` (batch, tokens, logits kept) on this thread.

        One set per shape and thread (a binding holds per-call state; a session may be shared), kept for the REUSED_SHAPES
        shapes last used, so a cycle's alternating shapes (draft steps of 1 token, verification of K + 1) never
        rebind; a longer call (a prefill chunk) gets fresh ones.
        """
        shapes = getattr(self._local, "shapes", None)
        if shapes is None:
            shapes = self._local.shapes = OrderedDict()
        found = shapes.get(shape)
        if found is not None:
            shapes.move_to_end(shape)
            return found
        reused = shape[1] <= REUSED_OUTPUT_TOKENS
        made = self.shape_buffers(shape, captured=reused)
        if reused:
            shapes[shape] = made
            if len(shapes) > REUSED_SHAPES:
                shapes.popitem(last=False)
        return made

    def shape_buffers(self, shape: tuple[int, int, int], captured: bool) -> ShapeBuffers:
        """New buffers and bindings for calls of ``shape`` (an adapter of a graph we did not write binds its own)."""
        return ShapeBuffers(self.session, self.spec, self.memory, shape, self.cache_dtype, self.graphs, captured)


def _check_wanted(path: Path, spec: ModelSpec, provider: Provider, cuda_graphs: bool | None) -> None:
    """ProviderError where ``provider`` cannot run this graph (or CUDA graphs), or is missing from this onnxruntime
    build."""
    check_graph(path, spec, provider)  # what the artifact must change is said first, wherever it is run
    check_available(provider)
    if cuda_graphs and provider.name != "cuda":
        raise ProviderError(f"{path}: cuda_graphs needs provider 'cuda', got {provider.name!r}")


def _session_options(optimization: str, profile: Path | None, threads: int | None, provider: Provider):
    """ONNX Runtime SessionOptions: the optimization level, the profiler where asked for, and the thread pool; on
    OpenVINO, where each node is placed is recorded (``check_whole``)."""
    import onnxruntime as ort

    levels = ort.GraphOptimizationLevel
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = {"none": levels.ORT_DISABLE_ALL, "basic": levels.ORT_ENABLE_BASIC,
                                        "extended": levels.ORT_ENABLE_EXTENDED, "all": levels.ORT_ENABLE_ALL}[optimization]
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    if provider.name == "openvino":
        record_placement(options)
    if threads is not None:
        shared_thread_pool(threads)
    fit_thread_pool(options)
    return options


def placement(path: Path, provider: str | Provider, threads: int | None = None) -> dict[str, dict[str, int]]:
    """Where ONNX Runtime would place the nodes of the graph at ``path`` on ``provider`` (the CPU EP taking what it
    does not): EP -> {operator type: nodes}. Makes a session, so it costs what loading the graph costs."""
    import onnxruntime as ort

    provider = Provider.of(provider)
    check_available(provider)
    options = _session_options("all", None, threads, provider)
    record_placement(options)
    chain = [(provider.ep, provider.ep_options(threads, None))] + (
        ["CPUExecutionProvider"] if provider.ep != "CPUExecutionProvider" else [])
    return assignment(ort.InferenceSession(str(path), options, providers=chain))


def check_provider(path: Path, spec: ModelSpec, provider: str | Provider) -> None:
    """Refuse, before any session is made, a graph that cannot run whole on ``provider`` (``providers.check_graph``)."""
    check_graph(path, spec, Provider.of(provider))


def _differences(got: list[str], expected: list[str]) -> str:
    """The names one side has and the other lacks (the order aside), for a mismatch message."""
    extra, missing = [n for n in got if n not in expected], [n for n in expected if n not in got]
    return (f"; the graph has {extra[:4]} the manifest does not list" if extra else "") + (
        f"; the manifest lists {missing[:4]} the graph lacks" if missing else "")


# --- where buffers live ------------------------------------------------------------------------------------------

class HostMemory:
    """The CPU's: NumPy arrays, bound to ONNX Runtime by address; an upload is a copy into the bound buffer."""

    name = "cpu"  # ONNX Runtime's device name for IOBinding

    def zeros(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def upload(self, buffer: np.ndarray, values: np.ndarray) -> None:
        """Copy host ``values`` into ``buffer`` (a bound input)."""
        np.copyto(buffer, values, casting="same_kind")

    def provider_options(self) -> dict[str, str]:
        return {}


class CudaMemory:
    """One GPU's, through CuPy: ``stream`` is the stream ONNX Runtime's CUDA EP computes on (its
    ``user_compute_stream``), and inputs are copied there."""

    name = "cuda"

    def __init__(self, device_id: int = 0, shared_stream: bool = True):
        try:
            import cupy
        except ImportError as exc:
            raise ImportError("caches on the GPU live in CuPy arrays, and CuPy is not installed: pip install "
                              "'specdeploy[gpu]' (cupy-cuda13x; cupy-cuda12x for CUDA 12)") from exc
        self.cupy, self.device_id = cupy, device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.shared_stream = shared_stream  # else the EP computes on a stream of its own: uploads wait on the host

    def zeros(self, shape, dtype):
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.zeros(shape, dtype)

    def empty(self, shape, dtype):
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.empty(shape, dtype)

    def upload(self, buffer, values: np.ndarray) -> None:
        """Copy host ``values`` into device ``buffer`` on the session's stream (a few bytes a call: ids, lengths)."""
        buffer.set(np.ascontiguousarray(values, dtype=buffer.dtype), stream=self.stream)
        transfers.to_device += buffer.nbytes
        if not self.shared_stream:
            self.stream.synchronize()

    def provider_options(self) -> dict[str, str]:
        shared = {"user_compute_stream": str(self.stream.ptr)} if self.shared_stream else {}
        return {"device_id": str(self.device_id), **shared}


# --- bindings: IOBindings of an ONNX Runtime engine: every input and output bound once, by address, where the session computes.

def cache_key(cache: KVCache) -> tuple:
    """Where a cache's tensors are, as a hashable key: its arrays' addresses, shapes and strides (tensor i is element i
    of its array: the K/V's, or a recurrent state's; kept on the handle, whose arrays never change)."""
    key = getattr(cache, "binding_key", None)
    if key is None:
        cache.binding_key = key = tuple((address(a), a.shape, a.strides) for a in (cache.stacked, *cache.states))
    return key


def allocation(buffer) -> int:
    """The identity of the allocation an array views (its root base), to tell one cache's rows from another cache."""
    while getattr(buffer, "base", None) is not None:
        buffer = buffer.base
    return id(buffer)


def bind(binding, name: str, device: str, array, output: bool = False) -> None:
    """Bind ``array`` (host or device memory of ``device``) as input or output ``name`` by its address."""
    method = binding.bind_output if output else binding.bind_input
    method(name, device, 0, array.dtype, list(array.shape), address(array))


class ShapeBuffers:
    """The input and output buffers of one call shape, where the session computes, and one IOBinding per cache.

    ``input_ids`` [batch, tokens] int64, ``lengths`` [batch] (past_len int64, or seqlens_k int32) and a fused hybrid's
    ``slots`` (each recurrent state's read and write slots, ``state_slots``) take each call's values; ``num_logits``
    stays on the host, where the graph reads it; ``logits`` [batch, kept, vocab] float32, ``ids`` [batch, kept] int64
    (graphs with an argmax output) and ``new_kv`` [2 * layers, batch, kv_heads, tokens, head_dim] (explicit graphs) are
    written by ONNX Runtime.
    """

    def __init__(self, session, spec: ModelSpec, memory, shape: tuple[int, int, int], cache_dtype: np.dtype,
                 graphs: GraphIds | None, captured: bool = True):
        """``graphs``: the engine's CUDA graph ids, None where its session captures none; ``captured``: whether calls of
        this shape are (a shape used once, a prefill chunk, runs plainly: id -1, as a session that captures must be
        told, or it captures under its default id)."""
        batch, tokens, kept = shape
        self.session, self.spec, self.memory, self.graphs, self.captured = session, spec, memory, graphs, captured
        self.input_ids = memory.empty((batch, tokens), np.int64)
        self.lengths = memory.empty((batch,), np.int32 if spec.takes_seqlens_k else np.int64)
        # each call's lengths are computed into this host array (the bound buffer itself on the CPU), then uploaded
        self.host_lengths = self.lengths if isinstance(self.lengths, np.ndarray) else np.empty((batch,), self.lengths.dtype)
        self.kept = np.array([kept], np.int64)  # read on the host by the graph (Slice's starts): bound there
        # (state, read slots [batch, lookback], write slots [batch, written]) a recurrent state, where the graph takes them
        self.slots = [(state, memory.empty((batch, state.lookback), np.int64),
                       memory.empty((batch, state.written(tokens)), np.int64))
                      for state in (spec.states if spec.takes_state_slots else ())]
        self.logits = memory.empty((batch, kept, spec.vocab_size), np.float32)
        self.ids = memory.empty((batch, kept), np.int64) if spec.argmax_ids else None
        self.new_kv = None if spec.writes_cache else memory.empty(
            (2 * len(spec.kv_layers), *spec.cache_shape(batch, tokens)), cache_dtype)
        # the explicit form's recurrent states of the call's last positions, [layers, batch, written, *shape] a state
        self.new_states = [] if spec.writes_cache else [
            memory.empty((len(state.layers), batch, state.written(tokens), *state.shape), cache_dtype)
            for state in spec.states]
        self.bindings: dict[tuple, tuple] = {}  # cache key -> (IOBinding, RunOptions or None, allocation)
        self.graph_ids: dict[tuple, int] = {}  # cache key -> graph id, kept while these buffers live

    def binding(self, cache: KVCache) -> tuple:
        """(IOBinding, RunOptions or None) for calls over ``cache``: made once per cache; a new cache's drops the
        bindings of other allocations (a finished request's rows)."""
        key = cache_key(cache)
        found = self.bindings.get(key)
        if found is not None:
            return found[:2]
        owner = allocation(cache.stacked)
        for other in [k for k, (_, _, o) in self.bindings.items() if o != owner]:
            del self.bindings[other]
        binding = self._bind(cache)
        options = None
        if self.graphs is not None:
            if key not in self.graph_ids:
                self.graph_ids[key] = self.graphs.new() if self.captured else PLAIN
            options = run_options(self.graph_ids[key])
        self.bindings[key] = (binding, options, owner)
        return binding, options

    def _bind(self, cache: KVCache):
        spec, device, buffers = self.spec, self.memory.name, cache.buffers
        binding = self.session.io_binding()
        bind(binding, "input_ids", device, self.input_ids)
        bind(binding, spec.lengths_input, device, self.lengths)
        if spec.trims_logits:
            bind(binding, "num_logits", "cpu", self.kept)
        for name, buf in zip(spec.slot_inputs, [buf for _, read, write in self.slots for buf in (read, write)]):
            bind(binding, name, device, buf)
        for name, buf in zip(spec.cache_inputs, buffers):
            bind(binding, name, device, buf)
        bind(binding, spec.outputs[0], device, self.logits, output=True)
        written = buffers if spec.writes_cache else self.new_kv  # present_* is the cache itself: K/V written in place
        for name, buf in zip(spec.cache_outputs, written):
            bind(binding, name, device, buf, output=True)
        for name, buf in zip(spec.state_inputs, cache.state_buffers):
            bind(binding, name, device, buf)
        new_states = cache.state_buffers if spec.writes_cache else [layer for group in self.new_states for layer in group]
        for name, buf in zip(spec.state_outputs, new_states):  # the fused form's present_* is the buffer: in place
            bind(binding, name, device, buf, output=True)
        if self.ids is not None:
            bind(binding, "ids", device, self.ids, output=True)
        return binding

    def run(self, binding, options, input_ids: np.ndarray, past_len: np.ndarray) -> None:
        """Copy the call's ids and lengths (past_len, or GroupQueryAttention's seqlens_k: the index of each row's last new
        token), and a fused hybrid's state slots, into their bound buffers and run. A CUDA graph that fails to capture is
        given up for plain runs, said once (``GraphIds.refuse``)."""
        self.memory.upload(self.input_ids, input_ids)
        offset = input_ids.shape[1] - 1 if self.spec.takes_seqlens_k else 0
        np.add(past_len, offset, out=self.host_lengths, casting="unsafe")
        if self.host_lengths is not self.lengths:
            self.memory.upload(self.lengths, self.host_lengths)
        for state, read, write in self.slots:
            for buffer, values in zip((read, write), state_slots(state, past_len, input_ids.shape[1])):
                self.memory.upload(buffer, values)
        try:
            self.session.run_with_iobinding(binding, options)
        except Exception as exc:
            if options is None or options.get_run_config_entry("gpu_graph_id") == str(PLAIN):
                raise
            self.graphs.refuse(exc)
            plain = run_options(PLAIN)
            self.graph_ids = dict.fromkeys(self.graph_ids, PLAIN)
            self.bindings = {key: (b, plain, owner) for key, (b, _, owner) in self.bindings.items()}
            self.session.run_with_iobinding(binding, plain)
