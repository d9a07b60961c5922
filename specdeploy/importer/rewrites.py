"""The changes an import makes to a foreign graph's nodes, each returned in words for the manifest's rewrites.

Both keep the graph's own computation: one casts what it outputs, the other computes fewer of the same logits.
"""

from __future__ import annotations

from .sources import ONNX_TYPES

NUM_LOGITS = "num_logits"  # the input our fused graphs take for the same purpose (ModelSpec.trims_logits)
# Nodes the head's output may pass through on its way to the graph's logits: one varying input each (a soft-cap's
# Div, Tanh and Mul by constants, a Cast), so slicing positions before the head slices them after it alike
_ELEMENTWISE = {"Cast", "Identity", "Div", "Mul", "Tanh", "Add", "Sub"}
# The head as both tools write it; its output keeps its input's rank, so over the elementwise path above, its input is
# [batch, positions, hidden] where the logits are [batch, positions, vocab] (Gemm, 2-D only, is never the head here)
_HEADS = {"MatMul", "MatMulNBits"}


def logits_in_float32(model, name: str) -> list[str]:
    """Cast the graph's logits ``name`` to float32 where it declares another type (onnxruntime-genai's fp16 builds give
    float16 logits; the engines bind and acceptance reads float32, as every exported graph gives): a Cast node after
    the graph's own, on the device where its producer runs. Returns the rewrite in words, or nothing."""
    from onnx import TensorProto, helper

    output = next(value for value in model.graph.output if value.name == name)
    elem = output.type.tensor_type.elem_type
    if elem == TensorProto.FLOAT:
        return []
    inner = f"{name}_{ONNX_TYPES.get(elem, elem)}"
    for node in model.graph.node:
        node.output[:] = [inner if o == name else o for o in node.output]
        node.input[:] = [inner if i == name else i for i in node.input]
    model.graph.node.append(helper.make_node("Cast", [inner], [name], to=TensorProto.FLOAT, name=f"{name}_to_float32"))
    output.type.tensor_type.elem_type = TensorProto.FLOAT
    return [f"{name} cast from {ONNX_TYPES.get(elem, elem)} to float32 (a Cast node after the graph's own)"]


def head_trimmed(model, name: str) -> list[str]:
    """Let the graph compute the logits ``name`` of each row's last ``num_logits`` positions only, as our fused graphs
    do: a prefill chunk needs none and a draft's catch-up one, while both tools' graphs run the head (a [hidden,
    vocab] MatMul, a quarter of a 128-token prefill on the demo's pair) over every position. A Slice of the head's
    input along the positions, from -num_logits to the end; the new input ``num_logits`` (int64 [1]). Returns the
    rewrite in words, or nothing where the path from the head to ``name`` is not one this can follow (then the graph
    is left computing every position's logits, as before)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    output = next(value for value in graph.output if value.name == name)
    positions = output.type.tensor_type.shape.dim
    if len(positions) != 3 or NUM_LOGITS in {value.name for value in graph.input}:
        return []
    producer = {out: node for node in graph.node for out in node.output}
    constants = {t.name for t in graph.initializer} | {
        out for node in graph.node if node.op_type == "Constant" for out in node.output}
    node = producer.get(name)
    while node is not None and node.op_type not in _HEADS:
        varying = [i for i in node.input if i and i not in constants]
        if node.op_type not in _ELEMENTWISE or len(varying) != 1:
            return []
        node = producer.get(varying[0])
    if node is None:
        return []
    hidden = node.input[0]
    kept = f"{hidden}_last_num_logits"
    starts, ends, axes = (f"{NUM_LOGITS}_{part}" for part in ("negated", "to_the_end", "positions_axis"))
    graph.initializer.extend([numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), ends),
                              numpy_helper.from_array(np.array([1], np.int64), axes)])
    at = list(graph.node).index(node)
    graph.node.insert(at, helper.make_node("Slice", [hidden, starts, ends, axes], [kept], name=f"{NUM_LOGITS}_slice"))
    graph.node.insert(at, helper.make_node("Neg", [NUM_LOGITS], [starts], name=f"{NUM_LOGITS}_neg"))
    node.input[0] = kept
    graph.input.append(helper.make_tensor_value_info(NUM_LOGITS, TensorProto.INT64, [1]))
    positions[1].Clear()  # no longer the input's sequence length: a dim of its own
    positions[1].dim_param = "kept_positions"
    return [f"{name} of each row's last {NUM_LOGITS} positions only (a Slice before {node.op_type} {node.name!r}, "
            f"the head; input {NUM_LOGITS} int64 [1])"]
