"""The one decoder-block builder, Llama's block with what a family's description (``family.Family``) changes, and
the Llama family itself: Llama, Mistral, Qwen2 (q/k/v bias); covers SmolLM, TinyLlama and Qwen2.5.

Grouped-query attention, rotate-half RoPE (default, linear, llama3, YaRN and long-RoPE scaling), RMSNorm, a gated
MLP, tied or untied embeddings; per family: norms before and after attention and MLP, q/k norms, GELU-tanh, scaled
embeddings, multipliers, soft-caps, sliding windows per layer, RoPE per layer type, layers without RoPE. The
other families' descriptions are in families.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ..contract import kv_layers
from .dims import Dims
from .family import Family, Settings, features
from .fused import FusedGraph
from .layers import apply_rope, cached_attention, frozen, positions, rms_norm, softcap, transposed
from .recurrent import RECURRENT
from .registry import ExportError, register, take

NORM_SLOTS = ("before_attention", "after_attention", "before_mlp", "after_mlp")


class DecoderVerify(nn.Module):
    """A described family's verify-v1 model: ``forward`` (the explicit form) and ``write_fused`` read the family's
    description and its config's ``Settings``, nothing else."""

    def __init__(self, family: Family, config, weights: dict[str, torch.Tensor], dims: Dims, streamed: bool = False):
        """``streamed``: build each layer from ``weights`` only when ``write_fused`` reaches it, so that no
        more than one layer's fp32 weights is ever held (the fused form; ``forward`` needs them all)."""
        super().__init__()
        self.family, self.settings, self.config = family, family.settings(config, dims), config
        self.eps = self.settings.eps
        self.states = dims.states  # the recurrent states of the mixer slot's recurrent layers (contract.StateSpec)
        self.heads, self.kv_heads, self.head_dim = dims.num_heads, dims.kv_heads, dims.head_dim
        self.embed = frozen(take(weights, "model.embed_tokens.weight"))
        self.lm_head = transposed(weights.pop("lm_head.weight", self.embed.data))
        self.norm = frozen(take(weights, "model.norm.weight") + family.norm_offset)
        self.num_layers = dims.num_layers
        self.pending = weights if streamed else None  # the checkpoint's layers, taken one by one by write_fused
        # streamed: no layers here, so that ``forward`` fails loudly instead of running none
        self.layers = None if streamed else nn.ModuleList(self.layer(weights, i) for i in range(self.num_layers))

    def layer(self, weights: dict[str, torch.Tensor], i: int) -> _Layer:
        """Layer ``i`` built from its checkpoint tensors, which then leave ``weights``: the module holds its own
        (transposed, fused) copies, so building layer by layer never holds two copies of the whole model."""
        prefix = f"model.layers.{i}."
        layer = _Layer(self.family, weights, prefix, self.settings.mixers[i], self.config, self.eps)
        for name in [name for name in weights if name.startswith(prefix)]:
            del weights[name]
        return layer

    def forward(self, input_ids, past_len, *cache):
        batch, tokens = input_ids.shape
        s = self.settings
        x = _scaled(nn.functional.embedding(input_ids, self.embed), s.embedding_scale)
        pos = positions(past_len, tokens)
        tables = {key: rope.tables(pos) for key, rope in s.ropes.items()}
        kv, states = _cache_by_layer(cache, self.num_layers, self.states)
        new_kv, new_states = [], {}
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.before_attention)
            if s.mixers[i] == "attention":  # the mixer slot: attention over K/V, or a recurrent layer over its states
                attn, k, v = self._attention(layer, i, h, tables, *kv[i], past_len)
                new_kv += [k, v]
            else:
                attn, new = layer.mixer(h, past_len, *states[i])
                new_states[i] = new
            x = x + _scaled(self._norm(attn, layer.after_attention), s.residual_scale)
            h = self._norm(x, layer.before_mlp)
            gate, up = _biased(h @ layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            act = nn.functional.silu(gate) if s.activation == "silu" else nn.functional.gelu(gate, approximate="tanh")
            mlp = _biased((act * up) @ layer.down, layer.down_bias)
            x = x + _scaled(self._norm(mlp, layer.after_mlp), s.residual_scale)
        logits = _scaled(rms_norm(x, self.norm, self.eps) @ self.lm_head, s.logits_scale)
        if s.final_softcap:
            logits = softcap(logits, s.final_softcap)
        # the contract's order: K/V by layer, then each state kind's new states by layer (a mixer returns its kinds in
        # the order its StateSpecs declare them, as ``_cache_by_layer`` hands them in)
        pending = {i: iter(new) for i, new in new_states.items()}
        ordered = [next(pending[i]) for state in self.states for i in state.layers]
        return (logits.to(torch.float32), *new_kv, *ordered)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.eps)

    def _attention(self, layer: _Layer, i: int, h, tables, cache_k, cache_v, past_len):
        """(attention output [batch, tokens, hidden], the new tokens' K and V [batch, kv_heads, tokens, head_dim])."""
        batch, tokens, _ = h.shape
        s = self.settings
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = _biased(h @ layer.qkv, layer.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
        if self.family.qk_norm == "projection":
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        q = q.reshape(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.family.qk_norm == "head":
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        if s.rope(i) is not None:
            cos, sin = tables[s.rope_keys[i]]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = cached_attention(q * s.attention_scale, k, v, cache_k, cache_v, past_len, s.windows[i], s.attention_softcap)
        return _biased(attn @ layer.o, layer.o_bias), k, v

    def write_fused(self, graph: FusedGraph, capacity: int) -> str:
        """The same forward as fused ONNX Runtime ops, about a dozen nodes a layer; returns the logits' name."""
        from .fused_decoder import write_fused

        return write_fused(self, graph, capacity)

    def layers_to_write(self):
        """(index, layer) of each layer in turn: built from the checkpoint as reached where streamed."""
        for i in range(self.num_layers):
            yield i, (self.layer(self.pending, i) if self.pending is not None else self.layers[i])


def _cache_by_layer(cache: tuple, num_layers: int, states) -> tuple[dict, dict]:
    """The forward's cache inputs (``contract.input_names``' order) by layer: {layer: (K, V)} for attention layers and
    {layer: [its states' buffers, in declared order]} for recurrent ones."""
    attention = kv_layers(num_layers, states)
    kv = {layer: (cache[2 * j], cache[2 * j + 1]) for j, layer in enumerate(attention)}
    at, recurrent = 2 * len(attention), {}
    for state in states:
        for layer in state.layers:
            recurrent.setdefault(layer, []).append(cache[at])
            at += 1
    return kv, recurrent


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else x * scale


def _biased(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class _Layer(nn.Module):
    def __init__(self, family: Family, weights: dict[str, torch.Tensor], prefix: str, mixer: str = "attention",
                 config=None, eps: float = 1e-6):
        super().__init__()
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        # the mixer slot: a recurrent layer (recurrent.RECURRENT) holds its own weights; attention's are these
        self.mixer = None if mixer == "attention" else RECURRENT[mixer](weights, prefix, config, eps)
        # q, k, v (and gate, up) are fused into one MatMul each: fewer, larger kernels per layer. A checkpoint that
        # stores them fused (Phi-3: rows q, k, v and gate, up) is taken as it is.
        if family.fused_projections:
            self.qkv = transposed(take(weights, f"{attn}qkv_proj.weight"))
            self.qkv_bias = _bias(weights, f"{attn}qkv_proj.bias")
            self.gate_up = transposed(take(weights, f"{mlp}gate_up_proj.weight"))
            self.gate_up_bias = _bias(weights, f"{mlp}gate_up_proj.bias")
        else:
            if self.mixer is None:
                self.qkv = transposed(torch.cat([take(weights, f"{attn}{p}_proj.weight") for p in "qkv"], dim=0))
                self.qkv_bias = _joined_bias(weights, [f"{attn}{p}_proj" for p in "qkv"])
            gate, up = take(weights, f"{mlp}gate_proj.weight"), take(weights, f"{mlp}up_proj.weight")
            self.gate_up = transposed(torch.cat([gate, up], dim=0))
            self.gate_up_bias = _joined_bias(weights, [f"{mlp}gate_proj", f"{mlp}up_proj"])
        if self.mixer is None:
            self.o, self.o_bias = transposed(take(weights, f"{attn}o_proj.weight")), _bias(weights, f"{attn}o_proj.bias")
        self.down = transposed(take(weights, f"{mlp}down_proj.weight"))
        self.down_bias = _bias(weights, f"{mlp}down_proj.bias")
        for slot in NORM_SLOTS:
            name = getattr(family.norms, slot)
            setattr(self, slot, None if name is None else frozen(take(weights, f"{prefix}{name}.weight") + family.norm_offset))
        if family.qk_norm and self.mixer is None:
            self.q_norm = frozen(take(weights, f"{attn}q_norm.weight") + family.norm_offset)
            self.k_norm = frozen(take(weights, f"{attn}k_norm.weight") + family.norm_offset)


def _bias(weights: dict[str, torch.Tensor], name: str) -> nn.Parameter | None:
    return frozen(weights[name]) if name in weights else None


def _joined_bias(weights: dict[str, torch.Tensor], projections: list[str]) -> nn.Parameter | None:
    """The biases of projections fused into one MatMul, joined (zeros for one without), or None if none has one."""
    biases = [weights.get(f"{p}.bias") for p in projections]
    if all(b is None for b in biases):
        return None
    sizes = [take(weights, f"{p}.weight").shape[0] for p in projections]
    return frozen(torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(biases, sizes)]))


class DescribedArchitecture:
    """A described family as the registry's ``Architecture``: its sizes and its verify model."""

    def __init__(self, family: Family):
        self.family, self.name, self.model_types = family, family.name, family.model_types

    def dims(self, config) -> Dims:
        heads = config.num_attention_heads
        return Dims(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            max_positions=getattr(config, "max_position_embeddings", None),
            states=self.family.states(config, config.num_hidden_layers),
        )

    def features(self, config) -> tuple[str, ...]:
        dims = self.dims(config)
        return features(self.family, self.family.settings(config, dims), dims, bool(getattr(config, "tie_word_embeddings", False)))

    def build(self, config, weights: dict[str, torch.Tensor], capacity: int, streamed: bool = False) -> DecoderVerify:
        return DecoderVerify(self.family, config, weights, self.dims(config), streamed).eval()


LLAMA = Family("llama", ("llama", "mistral", "qwen2"))

register(DescribedArchitecture(LLAMA))

__all__ = ["LLAMA", "DescribedArchitecture", "DecoderVerify", "ExportError", "Settings"]
