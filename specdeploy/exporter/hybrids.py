"""Hybrid families: attention layers and recurrent layers in one stack, each a description over the one block builder
(``llama.DecoderVerify``) whose mixer slot runs attention or a recurrent mixer per layer as ``layer_types`` says
(``family.Family.mixers``; the recurrent mixers and their states in recurrent.py).

- LFM2 (``lfm2``): short convolutions and attention with per-head q/k norms. Its checkpoint names its parts its own way
  (``operator_norm``, ``feed_forward.w1``, ``out_proj``, ``embedding_norm``); they are read under the builder's names
  (``Renamed``), and its ``norm_eps`` is the builder's epsilon.
- Granite 4.0-H (``granitemoehybrid``): Mamba-2 layers and attention, Granite's four multipliers, RoPE only where
  ``position_embedding_type`` is "rope", a shared MLP (``shared_mlp``: gate and up in one tensor) and, where
  ``num_local_experts`` > 0, Granite MoE's routed experts beside it (its feed-forward slot: ``experts.RoutedExperts``
  with the shared MLP as its shared expert; 0 experts, the shared MLP alone).
"""

from __future__ import annotations

import copy

from .dims import Dims
from .experts import RoutedExperts, SharedExpert
from .families import GRANITE_EXPERTS, WeightsView
from .family import Family
from .feed_forward import DenseMLP
from .llama import DecoderVerify, DescribedArchitecture
from .registry import ExportError, register

LFM2 = Family("lfm2", ("lfm2",), qk_norm="head", mixers=(("conv", "short_conv"), ("full_attention", "attention")))
GRANITE_HYBRID = Family("granitemoehybrid", ("granitemoehybrid",), multipliers=True, rope_layers=True,
                        mixers=(("linear_attention", "mamba2"), ("full_attention", "attention")),
                        feed_forward=RoutedExperts(**GRANITE_EXPERTS, optional=True, shared=SharedExpert(
                            DenseMLP(), "shared_intermediate_size")))  # shared_mlp, read as mlp (GRANITE_HYBRID_NAMES)

# (a dotted part of the checkpoint's names, the builder's: one name, or several that split the tensor's rows evenly)
LFM2_NAMES = (("operator_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
              ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"),
              ("feed_forward.w2", "mlp.down_proj"), ("self_attn.out_proj", "self_attn.o_proj"),
              ("self_attn.q_layernorm", "self_attn.q_norm"), ("self_attn.k_layernorm", "self_attn.k_norm"),
              ("model.embedding_norm", "model.norm"))
GRANITE_HYBRID_NAMES = (("shared_mlp.input_linear", ("mlp.gate_proj", "mlp.up_proj")),
                        ("shared_mlp.output_linear", "mlp.down_proj"))


class HybridArchitecture(DescribedArchitecture):
    """A hybrid family as the registry's ``Architecture``: the builder's family over the checkpoint's weights under the
    builder's names (``names``) and the config as the builder reads it (``adapted``)."""

    def __init__(self, family: Family, names: tuple, adapt):
        super().__init__(family)
        self.names, self.adapt = names, adapt

    def dims(self, config) -> Dims:
        return super().dims(self.adapt(config))

    def features(self, config) -> tuple[str, ...]:
        return super().features(self.adapt(config))

    def build(self, config, weights, capacity: int, streamed: bool = False) -> DecoderVerify:
        return super().build(self.adapt(config), Renamed(weights, self.names), capacity, streamed)


def lfm2_config(config):
    """LFM2's config as the builder reads it: its ``norm_eps`` as ``rms_norm_eps``."""
    adapted = copy.copy(config)
    adapted.rms_norm_eps = config.norm_eps
    return adapted


def granite_hybrid_config(config):
    """Granite 4.0-H's config as the builder reads it: RoPE on no layer unless ``position_embedding_type`` is "rope"
    (SmolLM3's ``no_rope_layers``)."""
    adapted = copy.copy(config)
    rope = getattr(config, "position_embedding_type", None) == "rope"
    adapted.no_rope_layers = [int(rope)] * config.num_hidden_layers
    return adapted


class Renamed(WeightsView):
    """A checkpoint's weights under the builder's (Llama's) names. Each rule maps a dotted part of a checkpoint name to
    the builder's (LFM2's ``feed_forward.w1`` -> ``mlp.gate_proj``), or to several, which split the tensor's rows into
    as many equal parts (Granite's ``shared_mlp.input_linear`` -> gate and up, as its MLP chunks them); other names
    pass as they are. Deleting a name deletes (releases) the checkpoint's tensor once no other name reads it."""

    def __init__(self, weights, rules: tuple):
        self.weights, self.names = weights, {}  # ours -> (theirs, part, parts)
        for name in weights:
            dotted = f".{name}."
            for theirs, ours in rules:
                if f".{theirs}." in dotted:
                    parts = (ours,) if isinstance(ours, str) else ours
                    for k, our in enumerate(parts):
                        self.names[dotted.replace(f".{theirs}.", f".{our}.", 1)[1:-1]] = (name, k, len(parts))
                    break
            else:
                self.names[name] = (name, 0, 1)

    def __getitem__(self, name: str):
        theirs, part, parts = self.names[name]
        tensor = self.weights[theirs]
        if parts == 1:
            return tensor
        if tensor.shape[0] % parts:
            raise ExportError(f"checkpoint tensor {theirs}: {tensor.shape[0]} rows do not split into {parts} equal parts")
        return tensor.chunk(parts, dim=0)[part]

    def __delitem__(self, name: str) -> None:
        theirs = self.names.pop(name)[0]
        if all(other != theirs for other, _, _ in self.names.values()):
            del self.weights[theirs]


register(HybridArchitecture(LFM2, LFM2_NAMES, lfm2_config))
register(HybridArchitecture(GRANITE_HYBRID, GRANITE_HYBRID_NAMES, granite_hybrid_config))
