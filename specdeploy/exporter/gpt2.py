"""GPT-2: learned positions, LayerNorm, fused c_attn (Conv1D weights are already [in, out])."""

from __future__ import annotations

import math

import numpy as np
import torch
from onnx import TensorProto
from torch import nn

from .dims import Dims
from .fused import MS, FusedGraph, skip_outputs
from .layers import cached_attention, frozen, layer_norm, positions
from .registry import ExportError, register, take


class Gpt2Verify(nn.Module):
    def __init__(self, config, weights: dict[str, torch.Tensor], dims: Dims):
        super().__init__()
        self.eps = config.layer_norm_epsilon
        self.heads, self.head_dim = dims.num_heads, dims.head_dim
        self.wte = frozen(take(weights, "transformer.wte.weight"))
        self.wpe = frozen(take(weights, "transformer.wpe.weight"))
        self.lm_head = frozen(weights.get("lm_head.weight", self.wte.data).t())
        self.ln_f = nn.ParameterList([frozen(take(weights, f"transformer.ln_f.{p}")) for p in ("weight", "bias")])
        self.layers = nn.ModuleList(_Block(weights, f"transformer.h.{i}.") for i in range(dims.num_layers))

    def forward(self, input_ids, past_len, *cache):
        batch, tokens = input_ids.shape
        x = nn.functional.embedding(input_ids, self.wte) + nn.functional.embedding(positions(past_len, tokens), self.wpe)
        hidden = self.heads * self.head_dim
        new_kv = []
        for i, block in enumerate(self.layers):
            h = layer_norm(x, block.ln1_w, block.ln1_b, self.eps)
            q, k, v = (h @ block.attn_w + block.attn_b).split([hidden] * 3, dim=-1)
            q, k, v = (t.reshape(batch, tokens, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            attn = cached_attention(q * (1.0 / math.sqrt(self.head_dim)), k, v, cache[2 * i], cache[2 * i + 1], past_len)
            x = x + attn @ block.proj_w + block.proj_b
            h = layer_norm(x, block.ln2_w, block.ln2_b, self.eps)
            h = nn.functional.gelu(h @ block.fc_w + block.fc_b, approximate="tanh")
            x = x + h @ block.mlp_proj_w + block.mlp_proj_b
            new_kv += [k, v]
        logits = layer_norm(x, self.ln_f[0], self.ln_f[1], self.eps) @ self.lm_head
        return (logits.to(torch.float32), *new_kv)

    def write_fused(self, graph: FusedGraph, capacity: int) -> str:
        """The same forward as fused ONNX Runtime ops (nine nodes a layer); returns the logits' name."""
        lengths = graph.lengths()
        count = graph.node("Shape", ["input_ids"], start=1, end=2)[0]
        # learned positions are absolute: each row's first new token sits at seqlens_k + 1 - T (its past_len)
        last = graph.node("Cast", [lengths[0]], to=TensorProto.INT64)[0]
        past = graph.node("Sub", [graph.node("Add", [last, graph.constant("one", np.array([1], np.int64))])[0], count])[0]
        start = graph.node("Unsqueeze", [past, graph.constant("axis1", np.array([1], np.int64))])[0]
        steps = graph.node("Range", [graph.constant("zero", np.array(0, np.int64)), graph.node("Squeeze", [count])[0],
                                     graph.constant("step", np.array(1, np.int64))])[0]
        positions = graph.node("Add", [start, steps])[0]  # [batch, tokens]
        residual = graph.node("Add", [graph.node("Gather", [graph.constant("wte", self.wte), "input_ids"])[0],
                                      graph.node("Gather", [graph.constant("wpe", self.wpe), positions])[0]])[0]
        added = bias = None
        for i, block in enumerate(self.layers):
            h, residual = self._norm(graph, residual, added, bias, block.ln1_w, block.ln1_b, f"layers.{i}.ln1")
            qkv = graph.node("Add", [graph.matmul(h, block.attn_w, f"layers.{i}.attn"),
                                     graph.constant(f"layers.{i}.attn_b", block.attn_b)])[0]
            attn = graph.attention(qkv, i, lengths, None)
            h, residual = self._norm(graph, residual, graph.matmul(attn, block.proj_w, f"layers.{i}.proj"), block.proj_b,
                                     block.ln2_w, block.ln2_b, f"layers.{i}.ln2")
            fc = graph.node("FastGelu", [graph.matmul(h, block.fc_w, f"layers.{i}.fc"),
                                         graph.constant(f"layers.{i}.fc_b", block.fc_b)], domain=MS)[0]
            added, bias = graph.matmul(fc, block.mlp_proj_w, f"layers.{i}.mlp_proj"), block.mlp_proj_b
            graph.layer_written(i)
        h, _ = self._norm(graph, residual, added, bias, self.ln_f[0], self.ln_f[1], "ln_f")
        return graph.lm_head(h, self.lm_head)

    def _norm(self, graph: FusedGraph, residual: str, added: str | None, bias, weight, shift, name: str):
        """LayerNorm of residual + added + bias; returns (normed, the new residual stream)."""
        gamma, beta = graph.constant(f"{name}.weight", weight), graph.constant(f"{name}.bias", shift)
        if added is None:
            return graph.node("LayerNormalization", [residual, gamma, beta], epsilon=float(self.eps), axis=-1)[0], residual
        inputs = [residual, added, gamma, beta, graph.constant(f"{name}.skip_bias", bias)]
        normed, _, _, summed = graph.node("SkipLayerNormalization", inputs, skip_outputs(graph), domain=MS,
                                          epsilon=float(self.eps))
        return normed, summed


class _Block(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        names = {
            "ln1_w": "ln_1.weight", "ln1_b": "ln_1.bias", "attn_w": "attn.c_attn.weight",
            "attn_b": "attn.c_attn.bias", "proj_w": "attn.c_proj.weight", "proj_b": "attn.c_proj.bias",
            "ln2_w": "ln_2.weight", "ln2_b": "ln_2.bias", "fc_w": "mlp.c_fc.weight", "fc_b": "mlp.c_fc.bias",
            "mlp_proj_w": "mlp.c_proj.weight", "mlp_proj_b": "mlp.c_proj.bias",
        }
        for attr, name in names.items():
            setattr(self, attr, frozen(take(weights, prefix + name)))


class Gpt2Family:
    name = "gpt2"
    model_types = ("gpt2",)

    def dims(self, config) -> Dims:
        return Dims(num_layers=config.n_layer, num_heads=config.n_head, kv_heads=config.n_head,
                    head_dim=config.n_embd // config.n_head, vocab_size=config.vocab_size, max_positions=config.n_positions)

    def features(self, config) -> tuple[str, ...]:
        return ("learned positions", "LayerNorm", "gelu_new")

    def build(self, config, weights: dict[str, torch.Tensor], capacity: int,
              streamed: bool = False) -> Gpt2Verify:  # a GPT-2 is small: always built whole
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
            raise ExportError("gpt2 variants with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn are not supported")
        if not getattr(config, "scale_attn_weights", True):
            raise ExportError("gpt2 with scale_attn_weights=False is not supported")
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ExportError(f"activation_function {config.activation_function!r} is not supported; expected 'gelu_new'")
        # HF checkpoints of GPT2LMHeadModel save the body under "transformer."; GPT2Model without it.
        if "transformer.wte.weight" not in weights:
            weights = {("transformer." + k if not k.startswith("lm_head") else k): v for k, v in weights.items()}
        return Gpt2Verify(config, weights, self.dims(config)).eval()


register(Gpt2Family())
