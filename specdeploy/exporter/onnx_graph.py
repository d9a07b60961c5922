"""Torch verify module -> ONNX file: dynamo export, then optional fp16 and int4 rewrites."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch

from ..contract import input_names, kv_layers, output_names, state_names
from .dims import Dims
from .errors import ExportError

OPSET = 18
# Models past this size keep their weights as ONNX external data. Protobuf caps a file at 2 GB, and
# ONNX Runtime memory-maps external tensors but parses inline ones out of the message: the 0.5B int4
# draft (808 MB) opened in 1.7 s inline and in 0.3 s as external data (measured for 0.3.x: git show d946e5f:README.md).
EXTERNAL_DATA_BYTES = 32 << 20
# Example sizes for tracing: all >= 2 and pairwise distinct, since a dim of size 1, or one equal to
# another, can be specialised into the graph.
EXAMPLE_BATCH, EXAMPLE_TOKENS, EXAMPLE_CAPACITY = 3, 5, 11


def export_graph(module: torch.nn.Module, dims: Dims, path: Path) -> None:
    """Trace ``module`` into a verify-v1 graph at ``path`` with dynamic batch, tokens and capacity.

    Weights are streamed from the torch module to disk (as ONNX external data when large), so the
    exporter never holds a second in-memory copy of a multi-GB model.
    """
    layers, kv_heads, head_dim, states = dims.num_layers, dims.kv_heads, dims.head_dim, dims.states
    input_ids = torch.randint(0, dims.vocab_size, (EXAMPLE_BATCH, EXAMPLE_TOKENS))
    past_len = torch.tensor([2, 4, 3][:EXAMPLE_BATCH], dtype=torch.int64)
    cache = [torch.zeros(EXAMPLE_BATCH, kv_heads, EXAMPLE_CAPACITY, head_dim) for _ in range(2 * len(kv_layers(layers, states)))]
    batch, tokens, capacity = (torch.export.Dim(n) for n in ("batch", "tokens", "capacity"))
    axes = [{0: batch, 2: capacity} for _ in cache]
    for state in states:  # a positional state's slots are the capacity; a ring's its declared length, fixed
        cache += [torch.zeros(EXAMPLE_BATCH, *state.buffer_shape(1, EXAMPLE_CAPACITY)[1:]) for _ in state.layers]
        axes += [{0: batch} | ({} if state.slots else {1: capacity}) for _ in state.layers]
    dynamic = (
        {0: batch, 1: tokens},
        {0: batch},
        tuple(axes),  # varargs take a nested tuple
    )
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            (input_ids, past_len, *cache),
            dynamo=True,
            dynamic_shapes=dynamic,
            input_names=input_names(layers, states),
            output_names=output_names(layers, "explicit", states),
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        program.save(str(path), external_data=weight_bytes >= EXTERNAL_DATA_BYTES)
    del program
    # rename the dynamic axes in the graph alone; external weights stay where they are
    graph = onnx.load(str(path), load_external_data=False)
    _name_dims(graph, layers, states)
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


def _name_dims(model: onnx.ModelProto, layers: int, states=()) -> None:
    """Give the dynamic axes the contract's names, whatever the exporter called them."""
    wanted = {"input_ids": ["batch", "tokens"], "past_len": ["batch"], "logits": ["batch", "tokens", "vocab"]}
    for i in kv_layers(layers, states):
        for kind in ("key", "value"):
            wanted[f"cache_{kind}.{i}"] = ["batch", "kv_heads", "capacity", "head_dim"]
            wanted[f"new_{kind}.{i}"] = ["batch", "kv_heads", "tokens", "head_dim"]
    for state in states:  # a ring's new states: the call's last min(tokens, slots) positions
        wanted |= dict.fromkeys(state_names((state,), "cache"), ["batch", "capacity"])
        wanted |= dict.fromkeys(state_names((state,), "new"), ["batch", "written" if state.slots else "tokens"])
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
