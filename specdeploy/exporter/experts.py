"""Routed experts, the feed-forward slot of a mixture of experts (``feed_forward`` has the slot and the dense MLP).

``RoutedExperts`` is what a family declares: where its router and experts are and how its checkpoints store them
(``PerExpert``, ``StackedHalves``, ``Interleaved``; a GGUF file's ``GgufStacked`` whatever the family), which config
fields give the experts' count and width and whether the chosen experts' weights are renormalized, its shared expert,
gpt-oss's clamped SwiGLU. ``settings`` reads one config (refusing in one line a count, a top-k or a size that cannot
be), ``RoutedFeedForward`` is one sparse layer: its explicit form (standard ops: each token's chosen experts gathered
in a decode or a verification, every expert over every token in a prefill chunk) and its fused form (ONNX Runtime's
MoE / QMoE, or the explicit form's gathering ops where their CPU kernels cannot take it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from .. import declared
from . import expert_weights
from .errors import ExportError
from .feed_forward import (
    Activation,
    DenseMLP,
    DenseSettings,
    LayerSettings,
    as_numpy,
    bias_of,
    biased,
    config_activation,
    fused_bias,
    optional,
)
from .fused import MS, FusedGraph
from .layers import frozen
from .registry import take


class PerExpert:
    """Experts stored one Linear each: ``{prefix}experts.{e}.{gate|up|down}.weight`` (Qwen-MoE, OLMoE: gate_proj,
    up_proj, down_proj; Mixtral: w1, w3, w2)."""

    def __init__(self, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"):
        self.gate, self.up, self.down = gate, up, down

    def read(self, weights, p: str, experts: int) -> tuple:
        def each(e):
            gate, up = take(weights, f"{p}experts.{e}.{self.gate}.weight"), take(weights, f"{p}experts.{e}.{self.up}.weight")
            return torch.cat([gate, up], dim=0).t(), take(weights, f"{p}experts.{e}.{self.down}.weight").t()

        pairs = [each(e) for e in range(experts)]
        return torch.stack([g for g, _ in pairs]), None, torch.stack([d for _, d in pairs]), None


class StackedHalves:
    """Experts stacked per layer, gate and up in one tensor (GraniteMoE: ``input_linear`` [experts, 2 * width, hidden],
    rows gate then up; ``output_linear`` [experts, hidden, width])."""

    def __init__(self, gate_up: str = "input_linear", down: str = "output_linear"):
        self.gate_up, self.down = gate_up, down

    def read(self, weights, p: str, experts: int) -> tuple:
        gate_up = take(weights, f"{p}{self.gate_up}.weight").transpose(1, 2)
        return gate_up, None, take(weights, f"{p}{self.down}.weight").transpose(1, 2), None


class Interleaved:
    """gpt-oss's experts: ``experts.gate_up_proj`` [experts, hidden, 2 * width] with gate and up interleaved (gate in the
    even columns), ``experts.down_proj`` [experts, width, hidden], each with a bias; or its checkpoints' MXFP4 form,
    ``*_blocks`` and ``*_scales``, dequantized exactly by transformers' own ``convert_moe_packed_tensors``."""

    def read(self, weights, p: str, experts: int) -> tuple:
        gate_up, down = _mxfp4_or_plain(weights, f"{p}experts.gate_up_proj"), _mxfp4_or_plain(weights, f"{p}experts.down_proj")
        bias = take(weights, f"{p}experts.gate_up_proj_bias")
        gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
        bias = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
        return gate_up, bias, down, take(weights, f"{p}experts.down_proj_bias")


def _mxfp4_or_plain(weights, name: str) -> torch.Tensor:
    if name in weights:
        return take(weights, name).to(torch.float32)
    blocks, scales = take(weights, f"{name}_blocks"), take(weights, f"{name}_scales")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


class GgufStacked:
    """A GGUF file's experts, as llama.cpp's converter writes every mixture's (``gguf_weights`` names them under the
    layer by their GGUF names): ``ffn_{gate,up,down}_exps`` stacked per layer ([experts, out, in]; gate and up as one
    ``ffn_gate_up_exps`` where the converter fused them), their ``.bias`` where the family has them (gpt-oss)."""

    def read(self, weights, p: str, experts: int) -> tuple:
        if f"{p}ffn_gate_up_exps.weight" in weights:
            gate_up = take(weights, f"{p}ffn_gate_up_exps.weight")
        else:
            gate_up = torch.cat([take(weights, f"{p}ffn_gate_exps.weight"), take(weights, f"{p}ffn_up_exps.weight")], dim=1)
        bias = None
        if f"{p}ffn_gate_up_exps.bias" in weights:
            bias = take(weights, f"{p}ffn_gate_up_exps.bias")
        elif f"{p}ffn_gate_exps.bias" in weights:
            bias = torch.cat([take(weights, f"{p}ffn_gate_exps.bias"), take(weights, f"{p}ffn_up_exps.bias")], dim=-1)
        down, down_bias = take(weights, f"{p}ffn_down_exps.weight"), weights.get(f"{p}ffn_down_exps.bias")
        return gate_up.transpose(1, 2), bias, down.transpose(1, 2), down_bias


GGUF_ROUTER = "ffn_gate_inp"  # a GGUF file's router, under the layer: its experts are GgufStacked
GGUF_SHARED = DenseMLP("", gate="ffn_gate_shexp", up="ffn_up_shexp", down="ffn_down_shexp")


@dataclass(frozen=True)
class SharedExpert:
    """An MLP every token passes through beside its routed experts: its weights' names (``mlp``, under the layer), the
    config field of its width (``width``; 0: none), and ``gate``, a weight [1, hidden] whose sigmoid scales its output
    (Qwen2-MoE's ``mlp.shared_expert_gate``), or None (Granite's ``shared_mlp``)."""

    mlp: DenseMLP
    width: str
    gate: str | None = None


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture of experts: under ``prefix`` a router (``{router}.weight`` [experts, hidden], and its ``.bias`` where the
    checkpoint has one) and experts as ``stored``; the config fields of the experts' count (``count``) and each expert's
    width (``width``), whether the chosen experts' weights are renormalized (``normalized``: a config field, or the
    family's fixed choice); a ``shared`` expert where the family has one; gpt-oss's ``clamped_swiglu`` (the config's
    ``swiglu_alpha`` and ``swiglu_limit``, up + 1). Layers listed in the config's ``mlp_only_layers``, or off its
    ``decoder_sparse_step``, are dense (``dense``, ``intermediate_size`` wide), as transformers builds them.
    ``optional``: a config may declare 0 experts, every layer then its shared expert alone (Granite 4.0-H). The config
    fields it reads have their rules in ``declared.experts`` (``rules``), checked before ``settings`` reads them."""

    prefix: str = "mlp."
    router: str = "gate"
    stored: object = field(default_factory=PerExpert)
    count: str = "num_experts"
    width: str = "moe_intermediate_size"
    normalized: str | bool = "norm_topk_prob"
    shared: SharedExpert | None = None
    clamped_swiglu: bool = False
    dense: DenseMLP = DenseMLP()

    optional: bool = False

    @property
    def rules(self) -> tuple:
        """The rules of the config fields this slot reads (``declared.experts``), under its family's names: the checks
        (exporter/checks.py) refuse a config that breaks them before ``settings`` reads it."""
        return declared.experts(self.count, self.width, self.shared.width if self.shared else None,
                                self.normalized if isinstance(self.normalized, str) else None, self.clamped_swiglu,
                                self.optional)

    def settings(self, config, layers: int) -> tuple[LayerSettings, ...]:
        """Each layer's numbers, from a config its ``rules`` passed."""
        count, width = _spelled(config, self.count), _spelled(config, self.width)  # as its config.json spells them
        experts, top_k = getattr(config, count), config.num_experts_per_tok
        activation = config_activation(config)
        if self.clamped_swiglu:
            activation = Activation("silu", float(config.swiglu_alpha), 1.0, float(config.swiglu_limit))
        normalized = getattr(config, self.normalized) if isinstance(self.normalized, str) else self.normalized
        size = getattr(config, self.shared.width, 0) if self.shared is not None else 0
        shared = DenseSettings(self.shared.mlp, activation, size, self.shared.width) if size else None
        if self.optional and experts == 0:  # no routed experts: the shared MLP is each layer's dense MLP
            return (DenseSettings(self.shared.mlp, activation),) * layers
        routed = RoutedSettings(self, experts, top_k, bool(normalized), activation, getattr(config, width), shared,
                                (count, width))
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", None) or 1
        dense = DenseSettings(self.dense, config_activation(config))
        return tuple(routed if i not in only and (i + 1) % step == 0 else dense for i in range(layers))

    def features(self, settings: tuple[LayerSettings, ...]) -> list[str]:
        routed = [s for s in settings if isinstance(s, RoutedSettings)]
        if not routed:
            return []
        s = routed[0]
        found = [f"{s.experts} experts, top-{s.top_k} by softmax{', renormalized' if s.normalized else ''}"
                 + (f", on {len(routed)} of {len(settings)} layers" if len(routed) < len(settings) else "")]
        if s.shared is not None:
            found.append(f"shared expert {s.shared.width}{' (sigmoid-gated)' if self.shared.gate else ''}")
        words = s.activation.words()
        return found + ([words] if words else [])


@dataclass(frozen=True)
class RoutedSettings:
    """A sparse layer's numbers: ``experts``, ``top_k`` chosen per token, ``normalized`` (the chosen experts' softmax
    weights divided by their sum), each expert's ``width``, the ``activation``, the ``shared`` expert (or None)."""

    declared: RoutedExperts
    experts: int
    top_k: int
    normalized: bool
    activation: Activation
    width: int
    shared: DenseSettings | None
    fields: tuple[str, str] = ("num_experts", "moe_intermediate_size")  # the count's and width's fields, as spelled

    def build(self, weights, layer: str, model_type: str) -> RoutedFeedForward:
        return RoutedFeedForward(self, weights, layer, model_type)


class RoutedFeedForward(nn.Module):
    """A sparse layer: ``router`` [hidden, experts] (a weight the formats leave in full precision: its name ends with
    ``expert_weights.ROUTER`` in both forms), experts ``gate_up`` [experts, hidden, 2 * width] (gate columns first) and
    ``down`` [experts, width, hidden], their biases where the checkpoint has them, and a shared expert (with its
    ``shared_router`` [hidden, 1] where a sigmoid gates it)."""

    def __init__(self, s: RoutedSettings, weights, layer: str, model_type: str):
        super().__init__()
        d, p = s.declared, layer + s.declared.prefix
        gguf = f"{layer}{GGUF_ROUTER}.weight" in weights  # a GGUF file's layer: llama.cpp's names, whatever the family
        router_name = f"{layer}{GGUF_ROUTER}" if gguf else f"{p}{d.router}"
        router = take(weights, f"{router_name}.weight")
        if router.shape[0] != s.experts:
            raise ExportError(f"{model_type}: {s.fields[0]} {s.experts} disagrees with {router_name}.weight "
                              f"{list(router.shape)}; expected {s.experts} rows, one per expert")
        self.router, self.router_bias = frozen(router.t()), bias_of(weights, f"{router_name}.bias")
        stored, p = (GgufStacked(), layer) if gguf else (d.stored, p)
        gate_up, gate_up_bias, down, down_bias = stored.read(weights, p, s.experts)
        if tuple(gate_up.shape) != (s.experts, router.shape[1], 2 * s.width):
            raise ExportError(f"{model_type}: {s.fields[1]} {s.width} and {s.fields[0]} {s.experts} disagree with {p}'s experts "
                              f"(gate and up {list(gate_up.shape)}); expected [{s.experts}, {router.shape[1]}, {2 * s.width}]")
        self.gate_up, self.down = frozen(gate_up), frozen(down)
        self.gate_up_bias = None if gate_up_bias is None else frozen(gate_up_bias)
        self.down_bias = None if down_bias is None else frozen(down_bias)
        self.settings = s
        shared = s.shared if s.shared is None or not gguf else replace(s.shared, mlp=GGUF_SHARED)
        self.shared = None if shared is None else shared.build(weights, layer, model_type)
        gate = None if s.shared is None else d.shared.gate
        if gguf and gate is not None:  # llama.cpp's name for the shared expert's gate
            gate = f"{GGUF_ROUTER}_shexp"
        self.shared_router = None if gate is None else frozen(take(weights, f"{layer}{gate}.weight").reshape(1, -1).t())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [batch, tokens, hidden] -> [batch, tokens, hidden]: each token's top_k experts, weighted.

        A call whose tokens choose fewer expert slots than there are experts (decoding, a verification) gathers each
        token's chosen experts: it reads tokens x top_k experts' weights, not every expert's. One whose tokens choose
        more (a prefill chunk) runs every expert over every token, its weight 0 where a token did not choose it: a
        chunk of 512 tokens would otherwise gather 512 x top_k copies of an expert's weights. One ``If`` in the graph
        (``torch.cond``), on the call's token count."""
        s, hidden = self.settings, h.shape[-1]
        logits = biased(h @ self.router, self.router_bias).reshape(-1, s.experts)  # [n, experts]
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), s.top_k, dim=-1)  # [n, top_k]
        if s.normalized:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        x = h.reshape(-1, hidden)
        out = torch.cond(x.shape[0] * s.top_k > s.experts, self._every_expert, self._chosen_experts, (x, weights, chosen))
        out = out.reshape(h.shape)
        if self.shared is not None:
            shared = self.shared(h)
            out = out + (shared if self.shared_router is None else shared * torch.sigmoid(h @ self.shared_router))
        return out

    def _chosen_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [n, hidden], the chosen experts' weights and indices [n, top_k] -> [n, hidden], each token's experts gathered
        (``Gather`` of [experts, in, out]: the int4 / int8 formats gather quantized ones instead)."""
        s, hidden = self.settings, x.shape[-1]
        flat = chosen.reshape(-1)
        both = (x.reshape(-1, 1, 1, hidden) @ _chosen(self.gate_up, flat, s.top_k)).reshape(-1, s.top_k, 2 * s.width)
        if self.gate_up_bias is not None:
            both = both + _chosen(self.gate_up_bias, flat, s.top_k)
        act = s.activation(*both.chunk(2, dim=-1))[:, :, None, :]  # [n, top_k, 1, width]
        out = (act @ _chosen(self.down, flat, s.top_k)).reshape(-1, s.top_k, hidden)
        if self.down_bias is not None:
            out = out + _chosen(self.down_bias, flat, s.top_k)
        return (out * weights[..., None]).sum(dim=1)

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The same, every expert over every token ([experts, n, ...]), weighted by 0 where a token did not choose it."""
        s = self.settings
        spread = torch.zeros(x.shape[0], s.experts, dtype=x.dtype).scatter(1, chosen, weights)  # [n, experts]
        both = x[None] @ self.gate_up  # [experts, n, 2 * width]
        if self.gate_up_bias is not None:
            both = both + self.gate_up_bias[:, None, :]
        out = s.activation(*both.chunk(2, dim=-1)) @ self.down  # [experts, n, hidden]
        if self.down_bias is not None:
            out = out + self.down_bias[:, None, :]
        return (out * spread.t()[..., None]).sum(dim=0)

    def write_fused(self, graph: FusedGraph, h: str, name: str) -> str:
        """ONNX Runtime's MoE / QMoE over the layer, or the explicit form's standard ops where its CPU kernel does not
        take the case (said once in the manifest's features); then the shared expert. Returns the output's name."""
        logits = graph.node("MatMul", [h, graph.constant(f"{name}.{expert_weights.ROUTER}", self.router)])[0]
        logits = fused_bias(graph, logits, self.router_bias, f"{name}.router_bias")
        unsupported = self._unsupported(graph)
        if unsupported:
            graph.note(f"experts in standard ops: {unsupported}")
            out = self._write_standard(graph, h, logits, name)
        else:
            out = self._write_op(graph, h, logits, name)
        if self.shared is not None:
            shared = self.shared.write_fused(graph, h, f"{name}.shared")
            if self.shared_router is not None:
                gate = graph.node("MatMul", [h, graph.constant(f"{name}.shared_{expert_weights.ROUTER}", self.shared_router)])
                shared = graph.node("Mul", [shared, graph.node("Sigmoid", gate)[0]])[0]
            out = graph.node("Add", [out, shared])[0]
        return out

    def _unsupported(self, graph: FusedGraph) -> str | None:
        """Why ONNX Runtime 1.32's CPU MoE / QMoE kernels cannot run this layer as the graph asks, or None."""
        s, hidden = self.settings, self.gate_up.shape[1]
        if s.activation.kind != "silu":
            return f"{s.activation.kind} experts (ONNX Runtime's CPU MoE kernel takes SwiGLU experts only)"
        if graph.int4 is not None and (hidden % graph.int4[0] or s.width % graph.int4[0]):
            return (f"int4 blocks of {graph.int4[0]} must divide hidden {hidden} and expert width {s.width} (ONNX "
                    "Runtime's QMoE)")
        return None

    def _write_op(self, graph: FusedGraph, h: str, logits: str, name: str) -> str:
        s, hidden = self.settings, self.gate_up.shape[1]
        # the op's only CPU layout for SwiGLU: gate and up interleaved, column by column ([experts, in, out] here)
        gate_up = as_numpy(self.gate_up).reshape(s.experts, hidden, 2, s.width).transpose(0, 1, 3, 2).reshape(
            s.experts, hidden, 2 * s.width)
        gate_up_bias = None if self.gate_up_bias is None else as_numpy(self.gate_up_bias).reshape(
            s.experts, 2, s.width).transpose(0, 2, 1).reshape(s.experts, 2 * s.width)
        down = as_numpy(self.down)
        attributes = {"k": s.top_k, "activation_type": "swiglu", "swiglu_fusion": 1,
                      "normalize_routing_weights": int(s.normalized), "activation_alpha": s.activation.alpha,
                      "activation_beta": s.activation.beta}
        if s.activation.limit is not None:
            attributes["swiglu_limit"] = s.activation.limit
        bits = 4 if graph.int4 is not None else 8 if graph.int8 else None
        if bits is None:
            op = "MoE"
            graph.note("experts on ONNX Runtime's MoE")
            weights = [graph.constant(f"{name}.experts_fc1", gate_up.transpose(0, 2, 1)),
                       optional(graph, gate_up_bias, f"{name}.experts_fc1_bias"),
                       graph.constant(f"{name}.experts_fc2", down.transpose(0, 2, 1)),
                       optional(graph, self.down_bias, f"{name}.experts_fc2_bias")]
        else:
            op = "QMoE"
            block, accuracy = graph.int4 if bits == 4 else (0, 0)
            graph.note(f"experts on ONNX Runtime's QMoE (int{bits}, " + (f"blocks of {block})" if bits == 4 else "per column)"))
            attributes |= {"expert_weight_bits": bits}
            if bits == 4:
                attributes |= {"block_size": block, "accuracy_level": accuracy}
            weights = []
            for fc, experts, bias in (("fc1", gate_up, gate_up_bias), ("fc2", down, self.down_bias)):
                values, scales = expert_weights.quantize(experts, bits, block)
                weights += [graph.constant(f"{name}.experts_{fc}_q{bits}", values),
                            graph.constant(f"{name}.experts_{fc}_scales", scales.astype(graph.dtype)),
                            optional(graph, bias, f"{name}.experts_{fc}_bias")]
        flat = graph.node("Reshape", [h, graph.constant("rows_of_hidden", np.array([-1, hidden], np.int64))])[0]
        routes = graph.node("Reshape", [logits, graph.constant(f"rows_of_{s.experts}", np.array([-1, s.experts], np.int64))])[0]
        if op == "QMoE" and not s.normalized:
            # ONNX Runtime 1.32's CPU QMoE renormalizes whatever normalize_routing_weights says (measured), but weighs by
            # its router_weights input where given: the softmax over every expert, as the family weighs them
            weights += ["", "", "", "", "", "", graph.node("Softmax", [routes], axis=-1)[0]]  # inputs 8 .. 14
        out = graph.node(op, [flat, routes, *weights], domain=MS, label=f"{name}.experts", **attributes)[0]
        return graph.node("Reshape", [out, graph.node("Shape", [h])[0]])[0]

    def _write_standard(self, graph: FusedGraph, h: str, logits: str, name: str) -> str:
        """``forward`` as standard ops: the chosen experts gathered (``Gather`` of [experts, in, out] weights: the int4 /
        int8 weight formats then gather quantized experts, ``expert_weights.quantize_gathered_experts``), whatever the
        call's length: a fallback for what QMoE refuses, without the explicit form's every-expert branch for a prefill
        (a long chunk copies its tokens x top_k experts' weights)."""
        s, hidden, k = self.settings, self.gate_up.shape[1], self.settings.top_k

        def shape(*dims):
            return graph.constant("experts_shape", np.array(dims, np.int64))

        def chosen(weight, tail, label):
            gathered = graph.node("Gather", [graph.constant(label, weight), flat], axis=0)[0]
            return graph.node("Reshape", [gathered, shape(-1, k, *tail)])[0]

        probs = graph.node("Softmax", [graph.node("Reshape", [logits, shape(-1, s.experts)])[0]], axis=-1)[0]
        weights, picked = graph.node("TopK", [probs, graph.constant("top_k", np.array([k], np.int64))], 2, axis=-1)
        if s.normalized:
            total = graph.node("ReduceSum", [weights, graph.constant("last_axis", np.array([-1], np.int64))], keepdims=1)
            weights = graph.node("Div", [weights, total[0]])[0]
        flat = graph.node("Reshape", [picked, shape(-1)])[0]
        x = graph.node("Reshape", [h, shape(-1, 1, 1, hidden)])[0]
        both = graph.node("Reshape", [graph.node("MatMul", [x, chosen(self.gate_up, (hidden, 2 * s.width),
                                                                    f"{name}.experts_gate_up")])[0], shape(-1, k, 2 * s.width)])[0]
        if self.gate_up_bias is not None:
            both = graph.node("Add", [both, chosen(self.gate_up_bias, (2 * s.width,), f"{name}.experts_gate_up_bias")])[0]
        gate, up = graph.node("Split", [both], 2, axis=-1, num_outputs=2)
        act = graph.node("Reshape", [s.activation.write(graph, gate, up), shape(-1, k, 1, s.width)])[0]
        out = graph.node("Reshape", [graph.node("MatMul", [act, chosen(self.down, (s.width, hidden), f"{name}.experts_down")])[0],
                                     shape(-1, k, hidden)])[0]
        if self.down_bias is not None:
            out = graph.node("Add", [out, chosen(self.down_bias, (hidden,), f"{name}.experts_down_bias")])[0]
        weighted = graph.node("Mul", [out, graph.node("Reshape", [weights, shape(-1, k, 1)])[0]])[0]
        summed = graph.node("ReduceSum", [weighted, graph.constant("experts_axis", np.array([1], np.int64))], keepdims=0)[0]
        return graph.node("Reshape", [summed, graph.node("Shape", [h])[0]])[0]


def _chosen(weight: torch.Tensor, flat: torch.Tensor, top_k: int) -> torch.Tensor:
    """``weight`` [experts, ...] of each token's chosen experts (``flat`` [n * top_k]) -> [n, top_k, ...]: a Gather."""
    return torch.index_select(weight, 0, flat).reshape(-1, top_k, *weight.shape[1:])


def _spelled(config, name: str) -> str:
    """A config field's name as the config stores it (transformers maps Qwen3-MoE's num_experts to num_local_experts)."""
    return getattr(config, "attribute_map", {}).get(name, name)
