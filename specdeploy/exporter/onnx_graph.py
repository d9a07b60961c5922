"""Torch verify module -> ONNX file: dynamo export, then optional fp16 and int4 rewrites."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from ..contract import input_names, output_names
from .registry import ExportError

OPSET = 18
# Models past this size must keep their weights as ONNX external data (protobuf caps files at 2 GB).
EXTERNAL_DATA_BYTES = 1 << 30
# Example sizes for tracing: all >= 2 and pairwise distinct, since a dim of size 1, or one equal to
# another, can be specialised into the graph.
EXAMPLE_BATCH, EXAMPLE_TOKENS, EXAMPLE_CAPACITY = 3, 5, 11


def export_graph(module: torch.nn.Module, dims: dict, path: Path) -> None:
    """Trace ``module`` into a verify-v1 graph at ``path`` with dynamic batch, tokens and capacity.

    Weights are streamed from the torch module to disk (as ONNX external data when large), so the
    exporter never holds a second in-memory copy of a multi-GB model.
    """
    layers, kv_heads, head_dim = dims["num_layers"], dims["kv_heads"], dims["head_dim"]
    input_ids = torch.randint(0, dims["vocab_size"], (EXAMPLE_BATCH, EXAMPLE_TOKENS))
    past_len = torch.tensor([2, 4, 3][:EXAMPLE_BATCH], dtype=torch.int64)
    cache = [torch.zeros(EXAMPLE_BATCH, kv_heads, EXAMPLE_CAPACITY, head_dim) for _ in range(2 * layers)]
    batch, tokens, capacity = (torch.export.Dim(n) for n in ("batch", "tokens", "capacity"))
    dynamic = (
        {0: batch, 1: tokens},
        {0: batch},
        tuple({0: batch, 2: capacity} for _ in cache),  # varargs take a nested tuple
    )
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            (input_ids, past_len, *cache),
            dynamo=True,
            dynamic_shapes=dynamic,
            input_names=input_names(layers),
            output_names=output_names(layers),
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        program.save(str(path), external_data=weight_bytes >= EXTERNAL_DATA_BYTES)
    del program
    # rename the dynamic axes in the graph alone; external weights stay where they are
    graph = onnx.load(str(path), load_external_data=False)
    _name_dims(graph, layers)
    onnx.save_model(graph, str(path))


def load(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path))


def declared_io(path: Path) -> dict[str, tuple[str, list]]:
    """name -> (NumPy dtype name, dims: ints where fixed, names where dynamic) of a graph's inputs and outputs."""
    model = onnx.load(str(path), load_external_data=False)
    declared = {}
    for value in list(model.graph.input) + list(model.graph.output):
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        declared[value.name] = (dtype, [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim])
    return declared


def _name_dims(model: onnx.ModelProto, layers: int) -> None:
    """Give the dynamic axes the contract's names, whatever the exporter called them."""
    wanted = {"input_ids": ["batch", "tokens"], "past_len": ["batch"], "logits": ["batch", "tokens", "vocab"]}
    for i in range(layers):
        for kind in ("key", "value"):
            wanted[f"cache_{kind}.{i}"] = ["batch", "kv_heads", "capacity", "head_dim"]
            wanted[f"new_{kind}.{i}"] = ["batch", "kv_heads", "tokens", "head_dim"]
    for value in list(model.graph.input) + list(model.graph.output):
        for dim, name in zip(value.type.tensor_type.shape.dim, wanted.get(value.name, [])):
            if not dim.HasField("dim_value"):
                dim.dim_param = name


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """fp16 weights and caches; ids, past_len and logits keep their types (the contract's)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep = [n for n in ("input_ids", "past_len", "logits")]
    return convert_float_to_float16(model, keep_io_types=keep, disable_shape_infer=True)


def to_int4(model: onnx.ModelProto, block_size: int = 32, accuracy_level: int = 4) -> onnx.ModelProto:
    """4-bit block-wise weight-only MatMuls through ONNX Runtime's own MatMulNBits quantizer."""
    return quantize_weights(model, bits=4, block_size=block_size, accuracy_level=accuracy_level)


def quantize_weights(model: onnx.ModelProto, bits: int = 4, block_size: int = 32, accuracy_level: int = 4) -> onnx.ModelProto:
    """Block-wise weight-only MatMuls (``bits`` 4 or 8) through ONNX Runtime's MatMulNBits quantizer.

    accuracy_level 4 lets the kernels quantize activations to int8 on the fly (fastest on CPU);
    0 keeps fp32 compute.
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                          bits=bits)
    quantizer = MatMulNBitsQuantizer(model, algo_config=config)
    with _quiet():
        quantizer.process()
    quantized = quantizer.model.model
    if not any(node.op_type == "MatMulNBits" for node in quantized.graph.node):
        raise ExportError(f"int{bits} quantization rewrote no MatMul; the graph has no constant MatMul weights")
    return quantized


def save(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write the graph (and its external data when large) over ``path``; return the files written."""
    data = path.with_name(path.name + ".data")
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size < EXTERNAL_DATA_BYTES:
        onnx.save_model(model, str(path))
        data.unlink(missing_ok=True)
        return [path]
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    return [path, data]


def to_int8_dynamic(path: Path) -> None:
    """Rewrite the graph at ``path`` with int8 MatMul weights (per channel) and activations quantized per row.

    ONNX Runtime's dynamic quantizer (MatMulInteger on MLAS's int8 GEMM): on this project's CPUs its
    cost grows far more slowly with the tokens per call than MatMulNBits', which is what verifying
    K + 1 tokens at once needs (see README, Measuring). Its activation scale is then made per row
    (:func:`per_row_activations`), so that a verified token's int8 MatMuls do not depend on the drafts
    beside it.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantized = path.with_name(path.stem + ".int8.onnx")
    with _quiet():
        quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8, per_channel=True,
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
    still sums 5 rows in another order than 1, and int8 rounding can amplify that noise: README,
    Measuring.) Accuracy improves too: one outlier token no longer coarsens the whole call
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


class _quiet:
    """Silence the exporters' info logging (progress is shown by the caller)."""

    def __enter__(self):
        self.levels = {}
        for name in ("torch.onnx", "onnxscript", "onnx_ir", "root", "onnxruntime"):
            logger = logging.getLogger(None if name == "root" else name)
            self.levels[name] = logger.level
            logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        for name, level in self.levels.items():
            logging.getLogger(None if name == "root" else name).setLevel(level)
