"""int8 MatMul weights (per column) with int8 activations quantized per row, written one weight at a time.

The graph is what ONNX Runtime's dynamic quantizer writes (``quantize_dynamic``, QInt8 weights per
channel: MatMulInteger -> Cast -> Mul(scale)), with each DynamicQuantizeLinear (one activation scale per
call) replaced by a per-row quantization, so that a verified token's int8 MatMuls do not depend on the
drafts beside it (symmetric: scale = max|x| / 127, zero point 128 as uint8; the integer GEMM is exact).
The per-row scale multiplies the rescaled output in a Mul of its own and the quantizer's activation
scale is 1: ONNX Runtime fuses MatMulInteger -> Cast -> Mul(scale) into MatMulIntegerToFloat, which
reads an activation scale per tensor or per column, never per row.

The weights are quantized by ONNX Runtime's own ``quantize_data``, column by column as its quantizer
does, so the values are the same bit for bit (tests/exporter/test_int8.py checks against
``quantize_dynamic``), with its ``reduce_range``: 7-bit weights in [-64, 64]. On x86 without VNNI,
MLAS's uint8 x int8 GEMM sums pairs of products in saturating int16 (VPMADDUBSW): 255 x 127 x 2
overflows it and the output is garbage (seen on AVX2 EPYCs), 255 x 64 x 2 does not, on any CPU.
What differs is memory: the graph is read with onnx-ir, whose external tensors
are memory-mapped, and each float weight is dropped once quantized, so a 1.5B target needs about its
int8 size instead of the quantizer's three float copies (21 GB peak for Qwen2.5-Coder 1.5B).
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import numpy as np

PER_ROW_CONSTANTS = {"per_row.axes": np.array([-1], np.int64), "per_row.eps": np.array(1e-12, np.float32),
                     "per_row.inv127": np.array(1 / 127, np.float32), "per_row.offset": np.array(128, np.float32)}


class Int8Error(ValueError):
    """The graph has nothing to quantize, or not in the expected form."""


COLLECT_FROM_BYTES = 200_000_000  # weights below this free too little to pay a full garbage collection for

def to_int8_per_row(path: Path, external_data_bytes: int, progress=lambda message: None, reduce_range: bool = True,
                    kept=lambda name: False) -> None:
    """Rewrite the graph at ``path`` (and its external data) in place with int8 MatMuls. ``reduce_range=False``:
    full-range weights, as exporters before 0.3.3 wrote them (``tools/bench_int8_range.py`` compares the two).
    ``kept(name)``: a weight left in full precision (a mixture's routers: ``expert_weights.is_router``)."""
    import onnx_ir as ir

    model = ir.load(path)
    graph = model.graph
    constants = {name: _initializer(graph, name, value) for name, value in PER_ROW_CONSTANTS.items()}
    rows: dict[str, tuple] = {}  # activation name -> (uint8 value, its row scale, scale 1.0, zero point 128)
    matmuls = [node for node in graph if node.op_type == "MatMul" and node.domain == "" and _constant_weight(node, kept)]
    if not matmuls:
        raise Int8Error("int8 quantization rewrote no MatMul; the graph has no constant MatMul weights")
    for done, node in enumerate(matmuls):
        x, weight = node.inputs
        if x.name not in rows:
            rows[x.name] = _quantize_rows(graph, node, x, constants)
        quantized, row_scale, x_scale, x_zero = rows[x.name]
        values, scales, zeros = _quantize_columns(weight.const_value.numpy(), reduce_range)
        w_q = _initializer(graph, f"{weight.name}_quantized", values)
        w_scale = _initializer(graph, f"{weight.name}_scale", scales)
        w_zero = _initializer(graph, f"{weight.name}_zero_point", zeros)
        output = node.outputs[0]
        scales_mul = _node("Mul", [x_scale, w_scale], f"{node.name}_quant_scales_mul:0")
        product = _node("MatMulInteger", [quantized, w_q, x_zero, w_zero], f"{output.name}_quantized")
        cast = _node("Cast", [product.outputs[0]], f"{output.name}_quantized_cast_output", to=ir.DataType.FLOAT.value)
        scaled = _node("Mul", [cast.outputs[0], scales_mul.outputs[0]], f"{output.name}/per_tensor_scaled")
        rescaled = _node("Mul", [scaled.outputs[0], row_scale], f"{output.name}/per_row")
        graph.insert_before(node, [scales_mul, product, cast, scaled, rescaled])
        final = rescaled.outputs[0]
        final.shape, final.type = output.shape, output.type
        output.replace_all_uses_with(final, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        final.name = output.name
        if not weight.uses():  # the float weight goes as soon as nothing reads it
            tensor = graph.initializers.pop(weight.name).const_value
            if isinstance(tensor, ir.ExternalTensor):
                tensor.release()
        if done % 16 == 15:
            progress(f"int8: {done + 1} of {len(matmuls)} MatMuls")
    _save(model, path, external_data_bytes)


def _constant_weight(node, kept) -> bool:
    import onnx_ir as ir

    weight = node.inputs[1]
    return (weight is not None and weight.const_value is not None and not weight.is_graph_input()
            and weight.dtype == ir.DataType.FLOAT and len(weight.shape) == 2 and not kept(weight.name))


def _quantize_columns(weights: np.ndarray, reduce_range: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 values [K, N], scales [N] and zero points [N], per column as ONNX Runtime's quantizer makes them."""
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    values = np.empty(weights.shape, np.int8)
    scales = np.empty(weights.shape[1], np.float32)
    zeros = np.empty(weights.shape[1], np.int8)
    for column in range(weights.shape[1]):
        zero, scale, quantized = quantize_data(weights[:, column].flatten(), TensorProto.INT8, True, reduce_range=reduce_range)
        values[:, column], scales[column], zeros[column] = quantized, scale, zero
    return values, scales, zeros


def _quantize_rows(graph, first_consumer, x, constants) -> tuple:
    """x quantized per row to uint8 (zero point 128), before ``first_consumer``; returns what MatMulInteger needs."""
    import onnx_ir as ir

    p = f"{x.name}_quantized/per_row"
    absolute = _node("Abs", [x], f"{p}/abs")
    largest = _node("ReduceMax", [absolute.outputs[0], constants["per_row.axes"]], f"{p}/max", keepdims=1)
    floor = _node("Max", [largest.outputs[0], constants["per_row.eps"]], f"{p}/max_eps")  # an all-zero row
    scale = _node("Mul", [floor.outputs[0], constants["per_row.inv127"]], f"{p}/scale")
    scaled = _node("Div", [x, scale.outputs[0]], f"{p}/scaled")
    rounded = _node("Round", [scaled.outputs[0]], f"{p}/rounded")
    shifted = _node("Add", [rounded.outputs[0], constants["per_row.offset"]], f"{p}/shifted")
    quantized = _node("Cast", [shifted.outputs[0]], f"{x.name}_quantized", to=ir.DataType.UINT8.value)
    graph.insert_before(first_consumer, [absolute, largest, floor, scale, scaled, rounded, shifted, quantized])
    x_scale = _initializer(graph, f"{x.name}_scale", np.array(1.0, np.float32))
    x_zero = _initializer(graph, f"{x.name}_zero_point", np.array(128, np.uint8))
    return quantized.outputs[0], scale.outputs[0], x_scale, x_zero


def _node(op_type: str, inputs: list, output: str, **attributes):
    import onnx_ir as ir

    node = ir.node(op_type, inputs, attributes=attributes, name=f"{output}/{op_type}")
    node.outputs[0].name = output
    return node


def _initializer(graph, name: str, array: np.ndarray):
    import onnx_ir as ir

    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name), shape=ir.Shape(array.shape),
                     type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
    graph.register_initializer(value)
    return value


def _save(model, path: Path, external_data_bytes: int) -> None:
    """Write next to ``path`` first, then replace the graph and its data: the old data is read while writing."""
    import onnx_ir as ir

    data = path.with_name(path.name + ".data")
    fresh = path.parent / f".{path.stem}.int8"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    external = size >= external_data_bytes
    if not external:  # tensors the rewrite left as they are still point at the data file deleted below
        ir.external_data.load_to_model(model)
    ir.save(model, fresh / path.name, external_data=data.name if external else None)
    del model
    if size >= COLLECT_FROM_BYTES:  # as artifact.COLLECT_FROM_PARAMETERS: a full pass costs the heap, not the model
        gc.collect()
    (fresh / path.name).replace(path)
    if external:
        (fresh / data.name).replace(data)
    else:
        data.unlink(missing_ok=True)
    shutil.rmtree(fresh)
