"""Expert weights quantized per expert, and the explicit form's gathered experts rewritten to read them.

One rounding for both graph forms, so that an int4 or int8 mixture's two forms hold the same values: int4 in blocks of
``block_size`` inputs, as ONNX Runtime's MatMulNBits quantizer rounds a MatMul's weight (its own ``qbits_block_quant``,
symmetric, zero point 8), and int8 per output column (symmetric, zero point 128: QMoE's default zero point; per column,
QMoE's CPU kernel keeps float activations, so the explicit form's dequantized weights compute the same sums). The fused
form feeds them to ONNX Runtime's QMoE; the explicit form, whose experts are ``Gather`` of a [experts, in, out] weight by
each token's chosen experts (``feed_forward.RoutedFeedForward``), gathers the quantized experts instead and dequantizes
only the ones chosen, in standard ops (``quantize_gathered_experts``).

A router's weight (initializers named ``*router``, ``is_router``) stays in full precision in every format, as llama.cpp
keeps ``ffn_gate_inp`` in F32: which experts a token reaches is decided at full precision.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROUTER = "router"  # the last part of a router's weight name, in both graph forms


def is_router(name: str) -> bool:
    """Whether an initializer is a router's weight, which no weight format quantizes."""
    return name.endswith(ROUTER)


def int4_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert's MatMul weight [in, out] as int4: (packed [out, in / 2] uint8, low nibble first; scales
    [out, in / block_size]), ONNX Runtime's MatMulNBits rounding (``in`` a multiple of ``block_size``)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(weight, np.float32))
    return packed.reshape(packed.shape[0], -1), scales.astype(np.float32)


def int8_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One expert's MatMul weight [in, out] as int8 per output column: (values [out, in] uint8 around 128, scales [out])."""
    columns = np.ascontiguousarray(weight.T, np.float32)  # [out, in]
    scales = np.maximum(np.abs(columns).max(axis=1), 1e-12) / 127.0
    values = np.clip(np.rint(columns / scales[:, None]), -127, 127) + 128
    return values.astype(np.uint8), scales.astype(np.float32)


def quantize(experts: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Experts [experts, in, out] quantized one by one: (values [experts, out, in * bits / 8], scales [experts, out, blocks]
    for int4 or [experts, out] for int8): QMoE's layout (``weights_prepacked`` 0)."""
    done = [int4_blocks(e, block_size) if bits == 4 else int8_columns(e) for e in np.asarray(experts, np.float32)]
    return np.stack([v for v, _ in done]), np.stack([s for _, s in done])


def dequantize(values: np.ndarray, scales: np.ndarray, bits: int, inputs: int) -> np.ndarray:
    """``quantize``'s inverse: [experts, in, out] float32 (what both graph forms multiply by)."""
    if bits == 8:
        return ((values.astype(np.float32) - 128) * scales[..., None]).transpose(0, 2, 1)
    levels = np.stack([values & 15, values >> 4], -1).reshape(*values.shape[:-1], -1).astype(np.float32) - 8
    blocks = levels.reshape(*scales.shape, -1) * scales[..., None]
    return blocks.reshape(*scales.shape[:2], -1)[..., :inputs].transpose(0, 2, 1)


def quantize_gathered_experts(path: Path, bits: int, block_size: int, external_data_bytes: int) -> int:
    """Rewrite, in the graph at ``path`` (its ``If`` branches included), each use of a constant [experts, in, out] float
    weight (a routed layer's experts) to read its int4 / int8 values and scales instead: a ``Gather`` of the chosen
    experts gathers their values and scales and dequantizes what it gathered; a ``MatMul`` over every expert (a
    prefill's branch) dequantizes them all. Returns how many uses were rewritten (0: the graph is left as it was)."""
    import onnx_ir as ir

    from .int8 import _initializer, _node, _save

    model = ir.load(path)
    graph = model.graph
    quantized = {}  # weight name -> (values, scales) initializers, made once for every use

    def stored(weight):
        if weight.name not in quantized:
            experts = weight.const_value.numpy().astype(np.float32)
            values, scales = quantize(experts, bits, block_size)
            quantized[weight.name] = (_initializer(graph, f"{weight.name}_q{bits}", values),
                                      _initializer(graph, f"{weight.name}_scales", scales), experts.shape[1])
        return quantized[weight.name]

    uses = [(node, i) for node in ir.traversal.RecursiveGraphIterator(graph)
            for i in ((0,) if node.op_type == "Gather" else (1,) if node.op_type == "MatMul" else ())
            if node.domain == "" and _experts_weight(node, i)]
    for node, i in uses:
        weight, owner = node.inputs[i], node.graph
        values, scales, inputs = stored(weight)
        stem = f"{node.outputs[0].name}/{'chosen' if node.op_type == 'Gather' else 'every'}_experts"
        if node.op_type == "Gather":  # the chosen experts' values and scales
            chosen = node.inputs[1]
            values = _node("Gather", [values, chosen], f"{stem}/q", axis=0)
            scales = _node("Gather", [scales, chosen], f"{stem}/scales", axis=0)
            steps = [values, scales]
            values, scales = values.outputs[0], scales.outputs[0]
        else:
            steps = []
        steps += _dequantize_nodes(graph, values, scales, bits, inputs, block_size, stem)
        steps.append(_node("Transpose", [steps[-1].outputs[0]], f"{stem}/in_out", perm=[0, 2, 1]))
        if weight.dtype != ir.DataType.FLOAT:  # a float16 graph's experts: dequantized in float32, cast back
            steps.append(_node("Cast", [steps[-1].outputs[0]], f"{stem}/dequantized", to=weight.dtype.value))
        owner.insert_before(node, steps)
        if node.op_type == "Gather":  # the Gather's output is the dequantized experts now
            out = node.outputs[0]
            final = steps[-1].outputs[0]
            final.shape, final.type = out.shape, out.type
            out.replace_all_uses_with(final, replace_graph_outputs=True)
            owner.remove(node, safe=True)
            final.name = out.name
        else:  # the MatMul multiplies by them
            node.replace_input_with(i, steps[-1].outputs[0])
    for name in quantized:
        if not graph.initializers[name].uses():
            graph.initializers.pop(name)
    if uses:
        _save(model, path, external_data_bytes)
    return len(uses)


def _experts_weight(node, index: int) -> bool:
    """Whether ``node``'s input ``index`` is a constant [experts, in, out] float weight (a Gather's along axis 0)."""
    import onnx_ir as ir

    weight = node.inputs[index] if len(node.inputs) > index else None
    return (weight is not None and weight.const_value is not None and not weight.is_graph_input()
            and weight.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16) and len(weight.shape) == 3
            and (node.op_type != "Gather" or node.attributes.get_int("axis", 0) == 0))


def _dequantize_nodes(graph, values, scales, bits: int, inputs: int, block_size: int, stem: str) -> list:
    """Nodes from gathered values [m, out, in * bits / 8] and scales to float32 [m, out, in]."""
    import onnx_ir as ir

    from .int8 import _initializer, _node

    def const(suffix, array):
        return _initializer(graph, f"{stem}/constant_{suffix}", np.asarray(array))

    float32 = ir.DataType.FLOAT.value
    if bits == 8:
        cast = _node("Cast", [values], f"{stem}/float", to=float32)
        centred = _node("Sub", [cast.outputs[0], const("zero", np.array(128, np.float32))], f"{stem}/centred")
        column = _node("Unsqueeze", [scales, const("last", np.array([-1], np.int64))], f"{stem}/per_column")
        scaled = _node("Mul", [centred.outputs[0], column.outputs[0]], f"{stem}/scaled")
        return [cast, centred, column, scaled]
    low = _node("BitwiseAnd", [values, const("low_mask", np.array(15, np.uint8))], f"{stem}/low")
    high = _node("BitShift", [values, const("four", np.array(4, np.uint8))], f"{stem}/high", direction="RIGHT")
    last = const("last", np.array([-1], np.int64))
    pairs = [_node("Unsqueeze", [n.outputs[0], last], f"{stem}/{n.outputs[0].name.rsplit('/', 1)[1]}_pair")
             for n in (low, high)]
    joined = _node("Concat", [p.outputs[0] for p in pairs], f"{stem}/nibbles", axis=-1)  # [m, out, in / 2, 2]
    blocks = _node("Reshape", [joined.outputs[0], const("blocks", np.array([0, 0, -1, block_size], np.int64))],
                   f"{stem}/blocks")
    cast = _node("Cast", [blocks.outputs[0]], f"{stem}/float", to=float32)
    centred = _node("Sub", [cast.outputs[0], const("zero", np.array(8, np.float32))], f"{stem}/centred")
    per_block = _node("Unsqueeze", [scales, last], f"{stem}/per_block")
    scaled = _node("Mul", [centred.outputs[0], per_block.outputs[0]], f"{stem}/scaled")  # [m, out, blocks, block]
    flat = _node("Reshape", [scaled.outputs[0], const("flat", np.array([0, 0, -1], np.int64))], f"{stem}/flat")
    kept = _node("Slice", [flat.outputs[0], const("start", np.array([0], np.int64)),
                           const("end", np.array([inputs], np.int64)), last], f"{stem}/inputs")
    return [low, high, *pairs, joined, blocks, cast, centred, per_block, scaled, flat, kept]

