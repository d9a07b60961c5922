"""The described decoder (``llama.DecoderVerify``) as ONNX Runtime's fused ops, written layer by layer.

Each family feature maps onto what the ops take: GroupQueryAttention's ``scale`` (query_pre_attn_scalar, Granite's
attention multiplier), ``softcap`` (Gemma 2), ``local_window_size`` (sliding windows), ``q_norm_weight`` /
``k_norm_weight`` (per-head q/k norms, applied before its rotary: Qwen3, Gemma 3), its rotary with each layer's own
cos/sin caches (two RoPE bases; long-RoPE's factors chosen per position in the cache rows; partial rotary, Phi-4-mini's,
as caches rotary_dim / 2 wide: the op rotates twice its caches' width of each head and passes the rest through) or
none (rope-less layers); norms after attention and MLP as SimplifiedLayerNormalization, a norm over the whole q or k
projection (OLMo 2) on the packed projection's slices, multipliers and soft-capped logits as plain Mul / Tanh, attention
sinks (gpt-oss) as its ``head_sink``; the feed-forward slot writes itself (``feed_forward.py``: MatMuls for a dense MLP,
ONNX Runtime's MoE / QMoE for routed experts). What the ops cannot express is refused in one line naming the family, the
feature and ``--graph explicit``.
"""

from __future__ import annotations

import numpy as np

from .fused import MS, FusedGraph, rotary_tables, skip_outputs
from .recurrent_fused import write_mixer
from .registry import ExportError


def write_fused(model, graph: FusedGraph, capacity: int) -> str:
    """Write ``model``'s forward (a ``DecoderVerify``) into ``graph``; return the logits' name."""
    s, family = model.settings, model.family
    if model.head_dim % 16:
        raise ExportError(f"the fused graph form needs head_dim to be a multiple of 16 (ONNX Runtime's "
                          f"GroupQueryAttention rotary), got {model.head_dim}; export with --graph explicit")
    for rope in s.ropes.values():  # partial rotary: GroupQueryAttention rotates 2 x its caches' width of each head
        if rope.rotary_dim % 16:
            raise ExportError(f"{family.name}: the fused graph form needs the rotary dimension to be a multiple of 16 "
                              f"(ONNX Runtime's GroupQueryAttention takes cos/sin caches a multiple of 8 wide), got "
                              f"partial rotary {rope.rotary_dim} of head_dim {model.head_dim}; export with --graph explicit")
    lengths = graph.lengths() if "attention" in s.mixers else None
    rotary = {key: rotary_tables(graph, rope, capacity) for key, rope in s.ropes.items()}
    eps = {"epsilon": s.eps, "axis": -1}
    residual = graph.node("Gather", [graph.constant("embed", model.embed), "input_ids"])[0]
    residual = _scaled(graph, residual, s.embedding_scale, "embedding_scale")
    added = None  # the last branch's output, not yet added to the residual stream
    for i, layer in model.layers_to_write():
        h, residual = _norm(graph, residual, added, layer.before_attention, f"layers.{i}.before_attention", eps)
        if s.mixers[i] == "attention":  # the mixer slot: attention, or a recurrent layer (recurrent_fused.py)
            out = _attention(model, graph, h, layer, i, lengths, rotary, eps)
        else:
            out = write_mixer(graph, layer.mixer, i, h)
        added = _branch(graph, out, layer.after_attention, f"layers.{i}.after_attention", s.residual_scale, eps)
        h, residual = _norm(graph, residual, added, layer.before_mlp, f"layers.{i}.before_mlp", eps)
        out = layer.feed_forward.write_fused(graph, h, f"layers.{i}")  # the family's slot: a dense MLP or experts
        added = _branch(graph, out, layer.after_mlp, f"layers.{i}.after_mlp", s.residual_scale, eps)
        del layer.feed_forward, layer.mixer  # on disk now: the next layer's copies replace them
        if s.mixers[i] == "attention":
            del layer.qkv, layer.o
        graph.layer_written(i)
    h, _ = _norm(graph, residual, added, model.norm, "norm", eps)
    return graph.lm_head(h, model.lm_head, lambda logits: _logits(graph, logits, s))


def _attention(model, graph: FusedGraph, h: str, layer, i: int, lengths, rotary: dict, eps: dict) -> str:
    """Layer ``i``'s attention on ``h``: the q/k/v projection (q/k normed where the family has it), GroupQueryAttention
    over the cache in place, the output projection."""
    s, family = model.settings, model.family
    qkv = _biased(graph, graph.matmul(h, layer.qkv, f"layers.{i}.qkv"), layer.qkv_bias, f"layers.{i}.qkv_bias")
    if family.qk_norm:
        qkv = _qk_norms(model, graph, qkv, layer, i, eps)
    rope = s.rope(i)
    attributes = {} if s.attention_scale == model.head_dim ** -0.5 else {"scale": s.attention_scale}
    if s.attention_softcap:
        attributes["softcap"] = s.attention_softcap
    if s.windows[i]:
        attributes["local_window_size"] = s.windows[i]
    sinks = None if layer.sinks is None else graph.constant(f"layers.{i}.sinks", layer.sinks)
    attn = graph.attention(qkv, i, lengths, None if rope is None else rotary[s.rope_keys[i]], sinks, **attributes)
    return _biased(graph, graph.matmul(attn, layer.o, f"layers.{i}.o"), layer.o_bias, f"layers.{i}.o_bias")


def _norm(graph: FusedGraph, residual: str, added: str | None, weight, name: str, eps: dict) -> tuple[str, str]:
    """RMSNorm of residual + added (weight None: no norm there, OLMo 2); returns (normed, the new residual stream)."""
    if weight is None:
        summed = residual if added is None else graph.node("Add", [residual, added])[0]
        return summed, summed
    weight = graph.constant(name, weight)
    if added is None:
        return graph.node("SimplifiedLayerNormalization", [residual, weight], **eps)[0], residual
    normed, _, _, summed = graph.node("SkipSimplifiedLayerNormalization", [residual, added, weight], skip_outputs(graph),
                                      domain=MS, epsilon=eps["epsilon"])
    return normed, summed


def _branch(graph: FusedGraph, out: str, weight, name: str, scale: float, eps: dict) -> str:
    """A block's attention or MLP output as it joins the residual stream: normed after (Gemma, OLMo 2), scaled (Granite)."""
    if weight is not None:
        out = graph.node("SimplifiedLayerNormalization", [out, graph.constant(name, weight)], **eps)[0]
    return _scaled(graph, out, scale, f"{name}_scale")


def _qk_norms(model, graph: FusedGraph, qkv: str, layer, i: int, eps: dict) -> str:
    """RMSNorm of q and k on the packed projection's slices, re-packed for GroupQueryAttention, whose rotary then
    follows as the family has it: over each head (Qwen3, Gemma 3: reshaped to [batch, T, heads, head_dim]) or over
    the whole projection (OLMo 2). GroupQueryAttention's own q_norm_weight / k_norm_weight inputs would do the per-head
    norm, but ONNX Runtime 1.32 implements them only on the CUDA and WebGPU EPs (its CPU kernel refuses them)."""
    q_size, kv_size = model.heads * model.head_dim, model.kv_heads * model.head_dim
    sizes = graph.constant(f"layers.{i}.qkv_sizes", np.array([q_size, kv_size, kv_size], np.int64))
    q, k, v = graph.node("Split", [qkv, sizes], 3, axis=-1)
    per_head = model.family.qk_norm == "head"
    if per_head:
        heads = graph.constant("per_head", np.array([0, 0, -1, model.head_dim], np.int64))
        q, k = (graph.node("Reshape", [x, heads])[0] for x in (q, k))
    q = graph.node("SimplifiedLayerNormalization", [q, graph.constant(f"layers.{i}.q_norm", layer.q_norm)], **eps)[0]
    k = graph.node("SimplifiedLayerNormalization", [k, graph.constant(f"layers.{i}.k_norm", layer.k_norm)], **eps)[0]
    if per_head:
        flat = graph.constant("flat", np.array([0, 0, -1], np.int64))
        q, k = (graph.node("Reshape", [x, flat])[0] for x in (q, k))
    return graph.node("Concat", [q, k, v], axis=-1)[0]


def _logits(graph: FusedGraph, logits: str, s) -> str:
    """Granite's logits scaling and Gemma's final soft-cap, on the logits the head computed (before any padding)."""
    logits = _scaled(graph, logits, s.logits_scale, "logits_scale")
    if s.final_softcap:
        inside = _scaled(graph, logits, 1.0 / s.final_softcap, "softcap_in")
        logits = _scaled(graph, graph.node("Tanh", [inside])[0], s.final_softcap, "softcap_out")
    return logits


def _scaled(graph: FusedGraph, x: str, scale: float, name: str) -> str:
    if scale == 1.0:
        return x
    return graph.node("Mul", [x, graph.constant(name, np.array(scale, graph.dtype))])[0]


def _biased(graph: FusedGraph, x: str, bias, name: str) -> str:
    return x if bias is None else graph.node("Add", [x, graph.constant(name, bias)])[0]
