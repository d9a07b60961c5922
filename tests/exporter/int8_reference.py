"""The int8 graph as ONNX Runtime's dynamic quantizer and the per-row rewrite made it before
``specdeploy.exporter.int8`` (kept as the reference the lean writer must match bit for bit)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from specdeploy.exporter.onnx_graph import ExportError, _quiet, save


def to_int8_dynamic(path: Path) -> None:
    """Rewrite the graph at ``path`` with int8 MatMul weights (per channel) and activations quantized per row.

    ONNX Runtime's dynamic quantizer (MatMulInteger on MLAS's int8 GEMM): on this project's CPUs its
    cost grows far more slowly with the tokens per call than MatMulNBits', which is what verifying
    K + 1 tokens at once needs (docs/benchmarks.md, Verify cost). Its activation scale is then made per row
    (:func:`per_row_activations`), so that a verified token's int8 MatMuls do not depend on the drafts
    beside it.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantized = path.with_name(path.stem + ".int8.onnx")
    with _quiet():
        quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                         op_types_to_quantize=["MatMul"], use_external_data_format=True)
    model = onnx.load(str(quantized))
    for leftover in list(path.parent.iterdir()):  # the quantizer's graph and its external-data file
        if leftover.name.startswith(quantized.stem):
            leftover.unlink()
    if not any(node.op_type == "MatMulInteger" for node in model.graph.node):
        raise ExportError("int8 quantization rewrote no MatMul; the graph has no constant MatMul weights")
    save(per_row_activations(model), path)


def per_row_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace each DynamicQuantizeLinear (one scale for the whole activation tensor) by a per-row one.

    With one scale per call, a token's int8 activations depend on the other tokens of the call: a
    token verified among K + 1 drafts is computed differently than decoded alone, and the K/V it
    leaves in the cache depends on drafts that were then rejected. Per row (per token), symmetric:
    scale = max|x| / 127, zero point 128 as uint8 (MatMulInteger's zero point must be a scalar). The
    integer GEMM is exact, so each token's int8 MatMuls no longer depend on the call. (fp32 attention
    still sums 5 rows in another order than 1, and int8 rounding can amplify that noise:
    docs/results/exactness.) Accuracy improves too: one outlier token no longer coarsens the whole call
    (Qwen2.5-Coder 1.5B, top-1 agreement with fp32 over 168 positions: 0.98 against 0.95).

    The row scale multiplies the rescaled output in a Mul of its own, and the quantizer's scale
    input becomes 1: ONNX Runtime fuses MatMulInteger -> Cast -> Mul(scale) into
    MatMulIntegerToFloat, which reads an activation scale as per tensor or per column, never per
    row (fed a per-row scale there, its output is garbage at optimization level "extended").
    """
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def only_consumer(name: str, op_type: str) -> onnx.NodeProto:
        found = consumers.get(name, [])
        if len(found) != 1 or found[0].op_type != op_type:
            raise ExportError(f"int8 rewrite: expected {name!r} to feed one {op_type}, found "
                              f"{[n.op_type for n in found]}; the quantizer's graph layout changed")
        return found[0]

    constants = {"per_row.axes": np.array([-1], np.int64), "per_row.eps": np.array(1e-12, np.float32),
                 "per_row.inv127": np.array(1 / 127, np.float32), "per_row.offset": np.array(128, np.float32)}
    initializers = [numpy_helper.from_array(value, name) for name, value in constants.items()]
    rescale_after: dict[int, list[onnx.NodeProto]] = {}  # id of a quantizer's rescaling Mul -> per-row Muls after it
    nodes = []
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            nodes.append(node)
            continue
        x, (quantized, scale, zero_point), p = node.input[0], node.output, f"{node.output[0]}/per_row"
        nodes += [
            helper.make_node("Abs", [x], [f"{p}/abs"]),
            helper.make_node("ReduceMax", [f"{p}/abs", "per_row.axes"], [f"{p}/max"], keepdims=1),
            helper.make_node("Max", [f"{p}/max", "per_row.eps"], [f"{p}/max_eps"]),  # an all-zero row
            helper.make_node("Mul", [f"{p}/max_eps", "per_row.inv127"], [f"{p}/scale"]),
            helper.make_node("Div", [x, f"{p}/scale"], [f"{p}/scaled"]),
            helper.make_node("Round", [f"{p}/scaled"], [f"{p}/rounded"]),
            helper.make_node("Add", [f"{p}/rounded", "per_row.offset"], [f"{p}/shifted"]),
            helper.make_node("Cast", [f"{p}/shifted"], [quantized], to=TensorProto.UINT8),
        ]
        initializers += [numpy_helper.from_array(np.array(128, np.uint8), zero_point),
                         numpy_helper.from_array(np.array(1.0, np.float32), scale)]
        for matmul in consumers.get(quantized, []):
            if matmul.op_type != "MatMulInteger":
                raise ExportError(f"int8 rewrite: {quantized!r} feeds a {matmul.op_type}, expected MatMulInteger")
            cast = only_consumer(matmul.output[0], "Cast")
            rescale = only_consumer(cast.output[0], "Mul")
            output = rescale.output[0]
            rescale.output[0] = f"{output}/per_tensor_scaled"
            rescale_after.setdefault(id(rescale), []).append(
                helper.make_node("Mul", [rescale.output[0], f"{p}/scale"], [output]))
    ordered = []
    for node in nodes:
        ordered += [node, *rescale_after.get(id(node), [])]
    del graph.node[:]
    graph.node.extend(ordered)
    graph.initializer.extend(initializers)
    return model
