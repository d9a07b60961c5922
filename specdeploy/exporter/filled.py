"""The explicit graph's attention reading only the filled slots: what OpenVINO runs fast.

The explicit form's attention (``layers.cached_attention``) writes the new K/V into a copy of each cache and scores
every slot of it, so a call's attention costs the whole capacity whatever the text's length. ONNX Runtime's CPU
kernels spend little there; OpenVINO's, which run the int4 matrix products well, spent about as much on the
attention over 2048 slots as on the matrix products (docs/results/openvino/). Here each cache input is read through a
Slice of its first ``end`` slots, ``end`` = the longest row's past_len + tokens rounded up to a multiple of ``bucket``
(at most the capacity): everything downstream (the scatter of the new K/V, the scores, the mask, the softmax) takes its
length from the slice, so a slot a call never reads is never copied. The rounding keeps the lengths OpenVINO meets to a
few (it prepares each new shape once, tens of milliseconds), and a slot past every query's own position is masked as
before, so the slots a call reads beyond the filled ones change no logit.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

PREFIX = "filled_slots/"  # the names this rewrite adds


def read_filled_slots(model: onnx.ModelProto, bucket: int) -> onnx.ModelProto:
    """``model`` (a verify-v1 explicit graph) with every cache input read only up to the filled length rounded up to
    ``bucket`` slots; the graph's inputs and outputs are unchanged. Rewrites the proto in place and returns it."""
    if bucket < 1:
        raise ValueError(f"bucket: got {bucket}; expected a positive number of slots")
    graph = model.graph
    caches = [value.name for value in graph.input if value.name.startswith(("cache_key.", "cache_value."))]
    if not caches or graph.input[0].name != "input_ids" or "past_len" not in {value.name for value in graph.input}:
        raise ValueError("not a verify-v1 explicit graph: it needs input_ids, past_len and cache_key/cache_value inputs")
    if any(node.name.startswith(PREFIX) for node in graph.node):
        raise ValueError("the graph already reads only its filled slots")

    def name(part: str) -> str:
        return PREFIX + part

    for part, value in (("zero", 0), ("one", 1), ("slots_axis", 2), ("bucket", bucket), ("bucket_less_one", bucket - 1)):
        graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name(part)))
    nodes = [
        helper.make_node("ReduceMax", ["past_len"], [name("longest_past")], keepdims=1, name=name("longest_past")),
        helper.make_node("Shape", ["input_ids"], [name("ids_shape")], name=name("ids_shape")),
        helper.make_node("Gather", [name("ids_shape"), name("one")], [name("tokens")], axis=0, name=name("tokens")),
        helper.make_node("Add", [name("longest_past"), name("tokens")], [name("filled")], name=name("filled")),
        helper.make_node("Add", [name("filled"), name("bucket_less_one")], [name("up")], name=name("up")),
        helper.make_node("Div", [name("up"), name("bucket")], [name("buckets")], name=name("buckets")),
        helper.make_node("Mul", [name("buckets"), name("bucket")], [name("rounded")], name=name("rounded")),
        helper.make_node("Shape", [caches[0]], [name("cache_shape")], start=2, end=3, name=name("capacity")),
        helper.make_node("Min", [name("rounded"), name("cache_shape")], [name("end")], name=name("end")),
    ]
    read = {cache: name(cache) for cache in caches}
    nodes += [helper.make_node("Slice", [cache, name("zero"), name("end"), name("slots_axis")], [sliced],
                               name=sliced) for cache, sliced in read.items()]
    for node in graph.node:
        for i, value in enumerate(node.input):
            if value in read:
                node.input[i] = read[value]
    if any(output.name in read for output in graph.output):
        raise ValueError("a cache input is also a graph output; expected the new K/V as outputs")
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    return model
