"""Llama family: Llama, Mistral, Qwen2 (q/k/v bias); covers SmolLM, TinyLlama and Qwen2.5.

Grouped-query attention, rotate-half RoPE (default, ``linear`` and ``llama3`` scaling), RMSNorm,
SwiGLU, tied or untied embeddings.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .dims import Dims
from .fused import MS, FusedGraph, rotary_tables, skip_outputs
from .layers import apply_rope, cached_attention, frozen, positions, rms_norm, rope_tables, transposed
from .registry import ExportError, register, take

SUPPORTED_ROPE = ("default", "linear", "llama3")


def _rope(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise ExportError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(scaling)


class LlamaVerify(nn.Module):
    def __init__(self, config, weights: dict[str, torch.Tensor], dims: Dims, streamed: bool = False):
        """``streamed``: build each layer from ``weights`` only when ``write_fused`` reaches it, so that no
        more than one layer's fp32 weights is ever held (the fused form; ``forward`` needs them all)."""
        super().__init__()
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = dims.num_heads, dims.kv_heads, dims.head_dim
        inv_freq, self.rope_scaling = _rope(config, self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.embed = frozen(take(weights, "model.embed_tokens.weight"))
        self.lm_head = transposed(weights.pop("lm_head.weight", self.embed.data))
        self.norm = frozen(take(weights, "model.norm.weight"))
        self.num_layers = dims.num_layers
        self.pending = weights if streamed else None  # the checkpoint's layers, taken one by one by write_fused
        # streamed: no layers here, so that ``forward`` fails loudly instead of running none
        self.layers = None if streamed else nn.ModuleList(
            _consumed(weights, f"model.layers.{i}.") for i in range(self.num_layers))

    def forward(self, input_ids, past_len, *cache):
        batch, tokens = input_ids.shape
        x = nn.functional.embedding(input_ids, self.embed)
        cos, sin = rope_tables(positions(past_len, tokens), self.inv_freq, self.rope_scaling)
        new_kv = []
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln1, self.eps)
            qkv = h @ layer.qkv
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.reshape(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
            k = k.reshape(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.reshape(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            q = apply_rope(q, cos, sin) * (1.0 / math.sqrt(self.head_dim))
            k = apply_rope(k, cos, sin)
            attn = cached_attention(q, k, v, cache[2 * i], cache[2 * i + 1], past_len)
            x = x + attn @ layer.o
            h = rms_norm(x, layer.ln2, self.eps)
            gate, up = (h @ layer.gate_up).chunk(2, dim=-1)
            x = x + (nn.functional.silu(gate) * up) @ layer.down
            new_kv += [k, v]
        logits = rms_norm(x, self.norm, self.eps) @ self.lm_head
        return (logits.to(torch.float32), *new_kv)

    def write_fused(self, graph: FusedGraph, capacity: int) -> str:
        """The same forward as fused ONNX Runtime ops, about a dozen nodes a layer; returns the logits' name."""
        if self.head_dim % 16:
            raise ExportError(f"the fused graph form needs head_dim to be a multiple of 16 (ONNX Runtime's "
                              f"GroupQueryAttention rotary), got {self.head_dim}; export with --graph explicit")
        lengths = graph.lengths()
        rotary = rotary_tables(graph, self.inv_freq, self.rope_scaling, capacity)
        residual = graph.node("Gather", [graph.constant("embed", self.embed), "input_ids"])[0]
        mlp_out, eps = None, {"epsilon": float(self.eps), "axis": -1}
        for i in range(self.num_layers):
            layer = _consumed(self.pending, f"model.layers.{i}.") if self.pending is not None else self.layers[i]
            h, residual = _norm(graph, residual, mlp_out, graph.constant(f"layers.{i}.ln1", layer.ln1), eps)
            qkv = graph.matmul(h, layer.qkv, f"layers.{i}.qkv")
            if layer.qkv_bias is not None:
                qkv = graph.node("Add", [qkv, graph.constant(f"layers.{i}.qkv_bias", layer.qkv_bias)])[0]
            attn = graph.attention(qkv, i, lengths, rotary)
            h, residual = _norm(graph, residual, graph.matmul(attn, layer.o, f"layers.{i}.o"),
                                graph.constant(f"layers.{i}.ln2", layer.ln2), eps)
            gate, up = graph.node("Split", [graph.matmul(h, layer.gate_up, f"layers.{i}.gate_up")], 2, axis=-1, num_outputs=2)
            silu = graph.node("Mul", [gate, graph.node("Sigmoid", [gate])[0]])[0]
            mlp_out = graph.matmul(graph.node("Mul", [silu, up])[0], layer.down, f"layers.{i}.down")
            del layer.qkv, layer.o, layer.gate_up, layer.down  # on disk now: the next layer's copies replace them
            graph.layer_written(i)
        h, _ = _norm(graph, residual, mlp_out, graph.constant("norm", self.norm), eps)
        return graph.lm_head(h, self.lm_head)


def _norm(graph: FusedGraph, residual: str, added: str | None, weight: str, eps: dict) -> tuple[str, str]:
    """RMSNorm of residual + added; returns (normed, the new residual stream)."""
    if added is None:
        return graph.node("SimplifiedLayerNormalization", [residual, weight], **eps)[0], residual
    normed, _, _, summed = graph.node("SkipSimplifiedLayerNormalization", [residual, added, weight], skip_outputs(graph), domain=MS,
                                      epsilon=eps["epsilon"])
    return normed, summed


def _consumed(weights: dict[str, torch.Tensor], prefix: str) -> _Layer:
    """A layer built from its checkpoint tensors, which then leave ``weights``: the module holds its own
    (transposed, fused) copies, so building layer by layer never holds two copies of the whole model."""
    layer = _Layer(weights, prefix)
    for name in [name for name in weights if name.startswith(prefix)]:
        del weights[name]
    return layer


class _Layer(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        # q, k, v (and gate, up) are fused into one MatMul each: fewer, larger kernels per layer.
        self.qkv = transposed(torch.cat([take(weights, f"{attn}{p}_proj.weight") for p in "qkv"], dim=0))
        biases = [weights.get(f"{attn}{p}_proj.bias") for p in "qkv"]
        if any(b is not None for b in biases):
            sizes = [take(weights, f"{attn}{p}_proj.weight").shape[0] for p in "qkv"]
            biases = [b if b is not None else torch.zeros(n) for b, n in zip(biases, sizes)]
            self.qkv_bias = frozen(torch.cat(biases))
        else:
            self.qkv_bias = None
        if f"{attn}o_proj.bias" in weights or f"{mlp}down_proj.bias" in weights:
            raise ExportError(f"{prefix}: output-projection biases are not supported by the llama exporter")
        self.o = transposed(take(weights, f"{attn}o_proj.weight"))
        gate, up = take(weights, f"{mlp}gate_proj.weight"), take(weights, f"{mlp}up_proj.weight")
        self.gate_up = transposed(torch.cat([gate, up], dim=0))
        self.down = transposed(take(weights, f"{mlp}down_proj.weight"))
        self.ln1 = frozen(take(weights, prefix + "input_layernorm.weight"))
        self.ln2 = frozen(take(weights, prefix + "post_attention_layernorm.weight"))


class LlamaFamily:
    name = "llama"
    model_types = ("llama", "mistral", "qwen2")

    def dims(self, config) -> Dims:
        heads = config.num_attention_heads
        return Dims(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            max_positions=getattr(config, "max_position_embeddings", None),
        )

    def build(self, config, weights: dict[str, torch.Tensor], capacity: int, streamed: bool = False) -> LlamaVerify:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ExportError(f"hidden_act {act!r} is not supported for {config.model_type}; expected 'silu'")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and capacity > window:
            raise ExportError(
                f"capacity {capacity} exceeds the model's sliding_window {window}; export with --capacity <= {window}"
            )
        return LlamaVerify(config, weights, self.dims(config), streamed).eval()


register(LlamaFamily())
