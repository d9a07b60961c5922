"""The feed-forward slot of a decoder block: a dense gated MLP, or routed experts (a mixture of experts).

A family declares its slot once (``Family.feed_forward``, a ``FeedForward``): ``DenseMLP`` here (Llama's gate/up/down;
Phi-3's one gate_up projection) or ``experts.RoutedExperts`` (a router choosing ``top_k`` of ``experts`` per token by
softmax, their weights renormalized or not, experts stored as the family's checkpoints store them, shared experts where
it has them, dense layers between sparse ones where its config says, gpt-oss's clamped SwiGLU). The slot reads its
numbers from the config (``settings``: one per layer), builds each layer's torch module from the checkpoint
(``LayerSettings.build``), and says what it is in words (``features``); the module computes the explicit form
(``forward``) and writes the fused form (``write_fused``). The block builder (``llama.DecoderVerify``,
``fused_decoder``) calls these and asks nothing else: a family's feed-forward flag lives in its slot alone.

Routed experts in the explicit form are standard ops: in a decode or a verification each token's chosen experts are
gathered ([tokens * top_k, in, out]) and multiplied, so a call costs its tokens times top_k expert weights, not every
expert; a prefill chunk, whose tokens choose more slots than there are experts, runs every expert. In the fused form they
are ONNX Runtime's ``MoE`` op (float weights) or ``QMoE`` (int4 blocks, int8 columns), which run each expert once over
the tokens that chose it, where its CPU kernel takes the case: SwiGLU experts (gate and up interleaved, its only CPU
layout; alpha, beta and limit are attributes), a softmax router (the op applies it), int4 blocks that divide both the
hidden size and the experts' width. Anything else is written in the explicit form's standard ops, said in the
manifest's features. Routers stay in full precision in every weight format (``expert_weights.is_router``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ..declared import ACTIVATIONS
from .errors import ExportError
from .fused import MS, FusedGraph
from .layers import frozen, transposed
from .registry import take


class LayerSettings(Protocol):
    """One layer's feed-forward numbers (``DenseSettings``, ``experts.RoutedSettings``)."""

    def build(self, weights, layer: str, model_type: str) -> nn.Module:
        """The layer's module from its checkpoint tensors under ``layer`` (``model.layers.{i}.``): ``forward(h)`` [batch,
        tokens, hidden] -> the same, and ``write_fused(graph, h, name)`` -> the output's name."""
        ...


class FeedForward(Protocol):
    """A family's feed-forward slot (``DenseMLP``, ``experts.RoutedExperts``). ``rules``: the declared rules
    (``specdeploy.declared``) of the config fields it reads beyond a decoder's, which exporter/checks.py applies."""

    rules: tuple

    def settings(self, config, layers: int) -> tuple[LayerSettings, ...]:
        """Each layer's numbers from ``config``, a config that cannot be refused in one line naming its field."""
        ...

    def features(self, settings: tuple[LayerSettings, ...]) -> list[str]:
        """What the slot does beyond Llama's SiLU MLP, in words (the manifest's features)."""
        ...


@dataclass(frozen=True)
class Activation:
    """How gate and up combine: "silu", ONNX Runtime's SwiGLU gate * sigmoid(alpha * gate) * (up + beta) with gate clamped
    above and up both ways at ``limit`` where one is set (SiLU: alpha 1, beta 0, no limit; gpt-oss: 1.702, 1, 7), or
    "gelu_pytorch_tanh", GELU-tanh(gate) * up."""

    kind: str = "silu"
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu_pytorch_tanh":
            return nn.functional.gelu(gate, approximate="tanh") * up
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        glu = nn.functional.silu(gate) if self.alpha == 1.0 else gate * torch.sigmoid(gate * self.alpha)
        return glu * (up + self.beta) if self.beta else glu * up

    def write(self, graph: FusedGraph, gate: str, up: str) -> str:
        """The same in ONNX nodes (FastGelu for GELU-tanh)."""
        if self.kind == "gelu_pytorch_tanh":
            return graph.node("Mul", [graph.node("FastGelu", [gate], domain=MS)[0], up])[0]
        if self.limit is not None:
            limit = graph.constant("swiglu_limit", np.array(self.limit, graph.dtype))
            gate = graph.node("Clip", [gate, "", limit])[0]
            up = graph.node("Clip", [up, graph.node("Neg", [limit])[0], limit])[0]
        scaled = gate if self.alpha == 1.0 else graph.node("Mul", [gate, scalar(graph, "swiglu_alpha", self.alpha)])[0]
        glu = graph.node("Mul", [gate, graph.node("Sigmoid", [scaled])[0]])[0]
        if self.beta:
            up = graph.node("Add", [up, scalar(graph, "swiglu_beta", self.beta)])[0]
        return graph.node("Mul", [glu, up])[0]

    def words(self) -> str | None:
        if self.kind != "silu":
            return self.kind
        if self.limit is not None or self.alpha != 1.0 or self.beta:
            return f"clamped SwiGLU (alpha {self.alpha:g}, beta {self.beta:g}, limit {self.limit:g})"
        return None


def config_activation(config) -> Activation:
    """The activation a config names (``hidden_activation`` or ``hidden_act``), refused in one line if not supported."""
    kind = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if kind not in ACTIVATIONS:
        raise ExportError(f"{config.model_type}: activation {kind!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return Activation(kind)


# ---------------------------------------------------------------------------------------------------- a dense MLP


@dataclass(frozen=True)
class DenseMLP:
    """A gated MLP's weights under ``prefix`` (below ``model.layers.{i}.``): ``gate``, ``up`` and ``down`` projections, or
    with ``gate_up`` one projection whose rows are gate then up (Phi-3's ``gate_up_proj``, Granite's shared
    ``input_linear``), taken as the one MatMul the graph computes anyway."""

    prefix: str = "mlp."
    gate_up: str | None = None
    down: str = "down_proj"
    gate: str = "gate_proj"
    up: str = "up_proj"

    rules = ()  # its width is DECODER's intermediate_size (declared.py), its activation read by config_activation

    def settings(self, config, layers: int) -> tuple[DenseSettings, ...]:
        return (DenseSettings(self, config_activation(config)),) * layers

    def features(self, settings: tuple[LayerSettings, ...]) -> list[str]:
        words = settings[0].activation.words() if settings else None
        return [words] if words else []


@dataclass(frozen=True)
class DenseSettings:
    """A dense layer: its MLP's names and activation; ``width``, where given, what its gate must measure (a shared
    expert's config size, checked against its weights)."""

    mlp: DenseMLP
    activation: Activation
    width: int | None = None
    width_field: str = ""

    def build(self, weights, layer: str, model_type: str) -> DenseFeedForward:
        return DenseFeedForward(self, weights, layer, model_type)


class DenseFeedForward(nn.Module):
    """down(act(gate(h), up(h))), gate and up one MatMul ([hidden, 2 * width], gate columns first)."""

    def __init__(self, s: DenseSettings, weights, layer: str, model_type: str):
        super().__init__()
        p = layer + s.mlp.prefix
        if s.mlp.gate_up:
            gate_up = take(weights, f"{p}{s.mlp.gate_up}.weight")
            self.gate_up_bias = bias_of(weights, f"{p}{s.mlp.gate_up}.bias")
        else:
            gate, up = take(weights, f"{p}{s.mlp.gate}.weight"), take(weights, f"{p}{s.mlp.up}.weight")
            gate_up = torch.cat([gate, up], dim=0)
            self.gate_up_bias = joined_bias(weights, [f"{p}{s.mlp.gate}", f"{p}{s.mlp.up}"])
        if s.width is not None and gate_up.shape[0] != 2 * s.width:
            raise ExportError(f"{model_type}: {s.width_field} {s.width} disagrees with {p}: its gate and up have "
                              f"{gate_up.shape[0] // 2} rows each; expected {s.width}")
        self.gate_up = transposed(gate_up)
        self.down, self.down_bias = transposed(take(weights, f"{p}{s.mlp.down}.weight")), bias_of(weights, f"{p}{s.mlp.down}.bias")
        self.activation = s.activation

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = biased(h @ self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return biased(self.activation(gate, up) @ self.down, self.down_bias)

    def write_fused(self, graph: FusedGraph, h: str, name: str) -> str:
        """The same as fused-form nodes (MatMul, or MatMulNBits for int4 weights); returns the output's name."""
        both = fused_bias(graph, graph.matmul(h, self.gate_up, f"{name}.gate_up"), self.gate_up_bias, f"{name}.gate_up_bias")
        gate, up = graph.node("Split", [both], 2, axis=-1, num_outputs=2)
        out = graph.matmul(self.activation.write(graph, gate, up), self.down, f"{name}.down")
        return fused_bias(graph, out, self.down_bias, f"{name}.down_bias")


def bias_of(weights, name: str) -> nn.Parameter | None:
    return frozen(weights[name]) if name in weights else None


def joined_bias(weights, projections: list[str]) -> nn.Parameter | None:
    """The biases of projections fused into one MatMul, joined (zeros for one without), or None if none has one."""
    biases = [weights.get(f"{p}.bias") for p in projections]
    if all(b is None for b in biases):
        return None
    sizes = [take(weights, f"{p}.weight").shape[0] for p in projections]
    return frozen(torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(biases, sizes)]))


def biased(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


def fused_bias(graph: FusedGraph, x: str, bias, name: str) -> str:
    return x if bias is None else graph.node("Add", [x, graph.constant(name, bias)])[0]


def optional(graph: FusedGraph, array, name: str) -> str:
    return "" if array is None else graph.constant(name, array)


def scalar(graph: FusedGraph, name: str, value: float) -> str:
    return graph.constant(name, np.array(value, graph.dtype))


def as_numpy(tensor) -> np.ndarray:
    return tensor.detach().to("cpu").numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
