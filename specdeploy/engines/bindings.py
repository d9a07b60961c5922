"""IOBindings of an ONNX Runtime engine: every input and output bound once, by address, where the session computes.

A call shape (batch, tokens, logits kept) owns its buffers (``ShapeBuffers``): the inputs, which each call copies its
few integers into, and the outputs, which ONNX Runtime writes. Each cache a shape runs over gets its own IOBinding of
those buffers and of the cache's tensors (a fused graph's present_* bound to the cache itself), kept across calls: a
request's calls rebind nothing, rows run one by one each keep theirs, and under CUDA graphs each binding is one
captured graph (``graphs``).
"""

from __future__ import annotations

import numpy as np

from ..contract import ModelSpec
from .device import address
from .graphs import PLAIN, GraphIds, run_options


def cache_key(cache) -> tuple:
    """Where a cache's tensors are, as a hashable key: for a ``KVCache`` its one array's address, shape and strides
    (tensor i is element i; kept on the handle, whose array never changes), for a list of tensors each one's."""
    key = getattr(cache, "binding_key", None)
    if key is not None:
        return key
    stacked = getattr(cache, "stacked", None)
    if stacked is None:
        return tuple((address(buf), buf.shape, buf.strides) for buf in cache)
    cache.binding_key = key = (address(stacked), stacked.shape, stacked.strides)
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

    ``input_ids`` [batch, tokens] int64 and ``lengths`` [batch] (past_len int64, or seqlens_k int32) take each call's
    values; ``num_logits`` stays on the host, where the graph reads it; ``logits`` [batch, kept, vocab] float32, ``ids``
    [batch, kept] int64 (graphs with an argmax output) and ``new_kv`` [2 * layers, batch, kv_heads, tokens, head_dim]
    (explicit graphs) are written by ONNX Runtime.
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
        self.logits = memory.empty((batch, kept, spec.vocab_size), np.float32)
        self.ids = memory.empty((batch, kept), np.int64) if spec.argmax_ids else None
        self.new_kv = None if spec.writes_cache else memory.empty((2 * spec.num_layers, *spec.cache_shape(batch, tokens)),
                                                                  cache_dtype)
        self.bindings: dict[tuple, tuple] = {}  # cache key -> (IOBinding, RunOptions or None, allocation)
        self.graph_ids: dict[tuple, int] = {}  # cache key -> graph id, kept while these buffers live

    def binding(self, cache, buffers: list) -> tuple:
        """(IOBinding, RunOptions or None) for calls over ``cache`` (whose tensors are ``buffers``): made once per
        cache; a new cache's drops the bindings of other allocations (a finished request's rows)."""
        key = cache_key(cache)
        found = self.bindings.get(key)
        if found is not None:
            return found[:2]
        owner = allocation(buffers[0])
        for other in [k for k, (_, _, o) in self.bindings.items() if o != owner]:
            del self.bindings[other]
        binding = self._bind(buffers)
        options = None
        if self.graphs is not None:
            if key not in self.graph_ids:
                self.graph_ids[key] = self.graphs.new() if self.captured else PLAIN
            options = run_options(self.graph_ids[key])
        self.bindings[key] = (binding, options, owner)
        return binding, options

    def _bind(self, buffers: list):
        spec, device = self.spec, self.memory.name
        binding = self.session.io_binding()
        bind(binding, "input_ids", device, self.input_ids)
        bind(binding, spec.lengths_input, device, self.lengths)
        if spec.trims_logits:
            bind(binding, "num_logits", "cpu", self.kept)
        for name, buf in zip(spec.cache_inputs, buffers):
            bind(binding, name, device, buf)
        bind(binding, spec.outputs[0], device, self.logits, output=True)
        written = buffers if spec.writes_cache else self.new_kv  # present_* is the cache itself: K/V written in place
        for name, buf in zip(spec.cache_outputs, written):
            bind(binding, name, device, buf, output=True)
        if self.ids is not None:
            bind(binding, "ids", device, self.ids, output=True)
        return binding

    def run(self, binding, options, input_ids: np.ndarray, past_len: np.ndarray) -> None:
        """Copy the call's ids and lengths (past_len, or GroupQueryAttention's seqlens_k: the index of each row's last new
        token) into their bound buffers and run. A CUDA graph that fails to capture is given up for plain runs, said
        once (``GraphIds.refuse``)."""
        self.memory.upload(self.input_ids, input_ids)
        offset = input_ids.shape[1] - 1 if self.spec.takes_seqlens_k else 0
        np.add(past_len, offset, out=self.host_lengths, casting="unsafe")
        if self.host_lengths is not self.lengths:
            self.memory.upload(self.lengths, self.host_lengths)
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
