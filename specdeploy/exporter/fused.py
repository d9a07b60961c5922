"""The fused graph form, written node by node from the weights (no tracing), as ONNX Runtime's model builder does.

Attention is ``GroupQueryAttention`` with the cache as a shared past/present buffer: the new tokens' K/V
are written in place at slots ``past_len .. past_len + T - 1`` (rotary inside the op), so the graph has no
K/V outputs to stage and rollback stays "move a length". Norms are ``(Skip)SimplifiedLayerNormalization``
or ``(Skip)LayerNormalization``; int4 weights become ``MatMulNBits`` as they are written, quantized by ONNX
Runtime's own block quantizer (the values its ``MatMulNBitsQuantizer`` would write). Weights stream to
the external-data file one tensor at a time, so a model is never held twice.

GroupQueryAttention takes several new tokens after a past only at batch 1 ("batch_size must be 1 when
sequence_length > 1 and past context is given"): engines run such calls row by row.

Every node runs on ONNX Runtime's CUDA EP (fp16 graphs), with no copy between host and device inside a call, so
each call shape can be captured as a CUDA graph: the graph takes GroupQueryAttention's ``seqlens_k`` as an input the
engine fills (``ModelSpec.takes_seqlens_k``), and its ``total_sequence_length``, which the op reads on the host, is
the cache's capacity, read off the cache's shape, as onnxruntime-genai's graphs read it off their static
[batch, max_length] attention mask under CUDA graphs. Lengths computed from ``past_len`` in the graph (int64 Add,
Sub, ReduceMax, Cast) were placed on the CPU EP by ONNX Runtime's ``GetCpuPreferredNodes`` (they feed the op's
host input), and their seqlens_k then needed a host-to-device copy, which rules capture out.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..contract import IR_VERSION, kv_layers, slot_input_names
from .dims import Dims
from .onnx_graph import EXTERNAL_DATA_BYTES, OPSET

MS = "com.microsoft"
ALIGN = 4096  # external tensors start on page boundaries: ONNX Runtime may memory-map them


class FusedGraph:
    """Collects nodes and streams initializers to ``path``'s external-data file; ``save`` writes the graph."""

    def __init__(self, path: Path, dims: Dims, dtype=np.float32, int4: tuple[int, int] | None = None,
                 vocab_kept: int | None = None, progress=lambda step: None):
        self.path, self.dims, self.dtype, self.int4 = Path(path), dims, np.dtype(dtype), int4
        self.progress = progress
        self.vocab_kept = vocab_kept
        self.data_path = self.path.with_name(self.path.name + ".data")
        self.data = open(self.data_path, "wb")
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.bytes = 0
        self._names: dict[str, int] = {}
        self._node_names: dict[str, int] = {}  # nodes have their own namespace: "layers.3.down" names both
        self._shared: dict[str, object] = {}  # values every layer reads, made once (``shared``)
        layers, kv_heads, head_dim = dims.num_layers, dims.kv_heads, dims.head_dim
        elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        cache = ["batch", kv_heads, "capacity", head_dim]
        self.attention_layers = kv_layers(layers, dims.states)
        kv = [f"{kind}.{i}" for i in self.attention_layers for kind in ("key", "value")]
        # a recurrent state's buffer, written in place as the K/V are: [batch, slots (capacity where positional), *shape]
        states = [(f"{state.name}.{i}", ["batch", state.slots or "capacity", *state.shape]) for state in dims.states
                  for i in state.layers]
        self.inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
                       helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"])]  # ModelSpec.takes_seqlens_k
        self.inputs += [helper.make_tensor_value_info(f"cache_{name}", elem, cache) for name in kv]
        self.inputs += [helper.make_tensor_value_info(f"cache_{name}", elem, shape) for name, shape in states]
        # each state's slots, filled by the engine (ModelSpec.takes_state_slots): [batch, lookback] read, [batch, written]
        slots = [["batch", state.lookback] if kind == "read" else ["batch", f"written_{state.name}"] for state in dims.states
                 for kind in ("read", "write")]
        self.inputs += [helper.make_tensor_value_info(name, TensorProto.INT64, shape)
                        for name, shape in zip(slot_input_names(dims.states), slots)]
        self.inputs += [helper.make_tensor_value_info("num_logits", TensorProto.INT64, [1])]  # ModelSpec.trims_logits
        self.outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "kept", dims.vocab_size])]
        self.outputs += [helper.make_tensor_value_info(f"present_{name}", elem, cache) for name in kv]
        self.outputs += [helper.make_tensor_value_info(f"present_{name}", elem, shape) for name, shape in states]
        self.outputs += [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "kept"])]  # ModelSpec.argmax_ids

    def name(self, stem: str, taken: dict[str, int] | None = None) -> str:
        """A fresh value (or, with ``taken=self._node_names``, node) name starting with ``stem``."""
        taken = self._names if taken is None else taken
        count = taken.get(stem, 0)
        taken[stem] = count + 1
        return stem if count == 0 else f"{stem}_{count}"

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", label: str = "",
             **attributes) -> list[str]:
        """Append a node (named after ``label`` when given, e.g. the weight it multiplies by, so that profiles
        read "layers.3.down"); return its output names (fresh ones when ``outputs`` is a count)."""
        if isinstance(outputs, int):
            outputs = [self.name(f"/{op}") for _ in range(outputs)]
        name = self.name(label or op, self._node_names)
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attributes))
        return outputs

    def constant(self, name: str, array) -> str:
        """An initializer holding ``array`` (floats in the model's dtype); written to the data file now."""
        array = np.asarray(array)
        if array.dtype.kind == "f" and array.dtype != self.dtype:
            array = array.astype(self.dtype)
        array = np.ascontiguousarray(array)
        name = self.name(name)
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        if array.nbytes < 1024:  # shapes, axes, eps: inline
            tensor.raw_data = array.tobytes()
        else:
            offset = -self.data.tell() % ALIGN
            self.data.write(b"\0" * offset)
            start = self.data.tell()
            self.data.write(array.tobytes())
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.data_path.name), ("offset", start), ("length", array.nbytes)):
                tensor.external_data.add(key=key, value=str(value))
            self.bytes += array.nbytes
        self.initializers.append(tensor)
        return name

    def scalar(self, name: str, value, dtype=np.int64) -> str:
        """An initializer holding one number as a 0-d tensor (``constant`` writes a 0-d array as [1]): what Range's
        inputs and a Gather that drops its axis need. Floats take the model's dtype."""
        array = np.array(value, self.dtype if np.dtype(dtype).kind == "f" else dtype)
        tensor = TensorProto(name=self.name(name), data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=[])
        tensor.raw_data = array.tobytes()
        self.initializers.append(tensor)
        return tensor.name

    def matmul(self, x: str, weight, name: str) -> str:
        """x @ weight ([in, out]); with int4 weights a MatMulNBits over the block-quantized weight."""
        weight = _numpy(weight)
        if self.int4 is None:
            return self.node("MatMul", [x, self.constant(name, weight)], label=name)[0]
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

        block_size, accuracy_level = self.int4
        config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level)
        packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight.astype(np.float32))
        rows, cols = weight.shape
        attributes = {"K": rows, "N": cols, "bits": 4, "block_size": block_size}
        if accuracy_level:
            attributes["accuracy_level"] = accuracy_level
        inputs = [x, self.constant(f"{name}_Q4", packed), self.constant(f"{name}_scales", scales)]
        return self.node("MatMulNBits", inputs, domain=MS, label=name, **attributes)[0]

    def layer_written(self, layer: int) -> None:
        """Report progress at each quarter of the layers: a 1.5B's dequantized, quantized layers take ~45 s."""
        layers = self.dims.num_layers
        if (layer + 1) * 4 // layers > layer * 4 // layers:
            self.progress(f"{layer + 1}/{layers} layers written")

    def lm_head(self, x: str, weight, then=lambda logits: logits) -> str:
        """Logits: x @ weight ([hidden, vocab]). With ``vocab_kept`` (a draft), only the first vocab_kept columns
        are computed and the rest are -inf: the head is a quarter of a 0.5B draft's weights, and a drafter never
        proposes what it scores -inf, so the target's verification stays exact (``export --draft-vocab``;
        tests/runtime/test_draft_vocab.py).

        Only each row's last ``num_logits`` positions reach the head: a prefill chunk needs none of its logits
        and a catch-up one position's (``ModelSpec.trims_logits``). ``then`` writes what follows the head on the
        computed logits (scaling, soft-capping), before the -inf columns are padded on."""
        starts = self.node("Neg", ["num_logits"])[0]
        ends = self.constant("to_the_end", np.array([np.iinfo(np.int64).max], np.int64))
        x = self.node("Slice", [x, starts, ends, self.constant("tokens_axis", np.array([1], np.int64))])[0]
        if self.vocab_kept is None:
            return then(self.matmul(x, weight, "lm_head"))
        vocab = weight.shape[1]
        logits = then(self.matmul(x, _numpy(weight)[:, : self.vocab_kept], "lm_head"))
        pads = self.constant("lm_head_pads", np.array([0, 0, 0, 0, 0, vocab - self.vocab_kept], np.int64))
        return self.node("Pad", [logits, pads, self.constant("minus_inf", np.array(-np.inf, self.dtype))])[0]

    def lengths(self) -> tuple[str, str]:
        """GroupQueryAttention's ``seqlens_k`` (the graph input: past_len + T - 1 per row, int32) and
        ``total_sequence_length`` (an int32 scalar the op reads on the host): the cache's capacity. Shape, Gather and
        Cast of a shape run on the host and feed the op's host input, so no value crosses to the device. The op's
        rotary positions and attention span come from seqlens_k alone; a total above the longest row's only makes
        a call of T > 1 tokens a "subsequent prompt", which is how the engines run them anyway (row by row)."""
        shape = self.node("Shape", [f"cache_key.{self.attention_layers[0]}"])[0]
        capacity = self.node("Gather", [shape, self.constant("capacity_axis", np.array(2, np.int64))], axis=0)[0]
        return "seqlens_k", self.node("Cast", [capacity], to=TensorProto.INT32)[0]

    def shared(self, key: str, make):
        """A value every layer reads (the call's token count, a recurrent state's slot indices): ``make()``'s result,
        made when first asked for under ``key``, then the same one."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def attention(self, qkv: str, layer: int, lengths: tuple[str, str], rotary: tuple[str, str] | None,
                  **attributes) -> str:
        """GroupQueryAttention over packed q/k/v [batch, T, (heads + 2 kv_heads) * head_dim], cache in place;
        ``attributes``: the op's ``scale``, ``softcap``, ``local_window_size``."""
        dims = self.dims
        inputs = [qkv, "", "", f"cache_key.{layer}", f"cache_value.{layer}", *lengths]
        attributes = {"num_heads": dims.num_heads, "kv_num_heads": dims.kv_heads, **attributes}
        if rotary is not None:
            inputs += list(rotary)
            attributes.update(do_rotary=1, rotary_interleaved=0)
        outputs = [self.name(f"/attn.{layer}"), f"present_key.{layer}", f"present_value.{layer}"]
        return self.node("GroupQueryAttention", inputs, outputs, domain=MS, label=f"layers.{layer}.attention", **attributes)[0]

    def save(self, logits: str) -> list[Path]:
        """Write the graph (weights inline when small, as ``onnx_graph.save`` does); return the files written.
        ``ids`` is the argmax of the float32 logits (the first of equal maxima, as NumPy's argmax picks)."""
        self.node("Cast", [logits], ["logits"], to=TensorProto.FLOAT)
        self.node("ArgMax", ["logits"], ["ids"], axis=-1, keepdims=0)
        self.data.close()
        graph = helper.make_graph(self.nodes, "verify", self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                                  producer_name="specdeploy", ir_version=IR_VERSION)
        if self.bytes >= EXTERNAL_DATA_BYTES:
            onnx.save_model(model, str(self.path))
            return [self.path, self.data_path]
        onnx.external_data_helper.load_external_data_for_model(model, str(self.path.parent))
        os.unlink(self.data_path)
        onnx.save_model(model, str(self.path))
        return [self.path]


def skip_outputs(graph: FusedGraph) -> list[str]:
    """Outputs of a Skip(Simplified)LayerNormalization: the normed value and the residual sum, not the statistics."""
    return [graph.name("/normed"), "", "", graph.name("/residual")]


def rotary_tables(graph: FusedGraph, rope, capacity: int) -> tuple[str, str]:
    """cos/sin caches [capacity, rotary_dim / 2] of a ``rope.Rope`` for GroupQueryAttention's rotary (its attention factor
    folded in; long-RoPE's long factors in the rows from its trained length on, as the explicit form chooses them). The
    op rotates the first 2 x width dims of each head and passes the rest through, which is partial rotary (Phi-4-mini's
    96 of 128), as onnxruntime-genai's builder writes it; the width must be a multiple of 8."""
    pos = np.arange(capacity, dtype=np.float64)[:, None]
    angles = pos * _numpy(rope.inv_freq).astype(np.float64)[None, :]
    if rope.long_inv_freq is not None:
        angles = np.where(pos >= rope.original, pos * _numpy(rope.long_inv_freq).astype(np.float64)[None, :], angles)
    return (graph.constant("cos_cache", (np.cos(angles) * rope.scaling).astype(np.float32)),
            graph.constant("sin_cache", (np.sin(angles) * rope.scaling).astype(np.float32)))


def _numpy(tensor) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    return tensor.detach().to("cpu").numpy()
