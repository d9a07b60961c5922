"""A decoder family as a description of how it differs from Llama, and the settings a config gives it.

``Family`` is what a family declares once (which norms sit where, whether q and k are normed, its feed-forward slot,
which of the config's fields mean what); ``Settings`` is what one config makes of it (epsilon, scales, soft-caps, each
layer's window, RoPE and feed-forward). The one block builder (``llama.DecoderVerify``) reads both and branches on
nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..contract import StateSpec
from .dims import Dims
from .errors import ExportError
from .feed_forward import DenseMLP, FeedForward, LayerSettings
from .recurrent import RECURRENT
from .rope import Rope, ropes


@dataclass(frozen=True)
class Norms:
    """The weight name (under ``model.layers.{i}.``) of each norm a block has, None where it has none: before
    attention, after it (on its output, before the residual add), before the MLP and after it."""

    before_attention: str | None = "input_layernorm"
    after_attention: str | None = None
    before_mlp: str | None = "post_attention_layernorm"
    after_mlp: str | None = None


GEMMA_NORMS = Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
POST_NORMS = Norms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo 2


@dataclass(frozen=True)
class Family:
    """How a decoder family differs from Llama (RMSNorm before attention and MLP, SwiGLU, rotate-half RoPE, GQA).

    ``norm_offset``: a norm's weight w scales by (offset + w) (Gemma: 1). ``qk_norm``: RMSNorm of q and k before RoPE,
    over each head ("head": Qwen3, Gemma 3) or over the whole projection ("projection": OLMo 2).
    ``scaled_embedding``: embeddings times sqrt(hidden) (Gemma). ``query_pre_attn_scalar``: scores scaled by that
    field's -1/2 power instead of head_dim's (Gemma). ``attention_softcap`` / ``final_softcap``: the config's
    ``attn_logit_softcapping`` / ``final_logit_softcapping`` are applied (cap * tanh(x / cap)). ``multipliers``:
    Granite's embedding, attention, residual and logits multipliers. ``rope_layers``: the config's
    ``no_rope_layers`` says which layers rotate (SmolLM3: 0 = no RoPE). ``fused_projections``: the checkpoint holds
    ``qkv_proj`` (Phi-3), taken as the one MatMul the graph computes anyway. ``attention_sinks``: a learned logit per
    head (``self_attn.sinks``) joins each attention softmax's denominator (gpt-oss). ``feed_forward``: the block's
    feed-forward slot (``feed_forward.DenseMLP``, the default, or ``experts.RoutedExperts``), which reads its own
    config fields and weights. ``mixers``: the mixer slot, (layer type, mixer kind) pairs saying which layers of
    ``layer_types`` run attention ("attention") and which a recurrent mixer (``recurrent.RECURRENT``: LFM2's
    "short_conv", Granite 4's "mamba2"); empty: attention on every layer. The biases, head_dim, tied embeddings, sliding
    windows (``layer_types`` or one ``sliding_window``) and RoPE scaling are read from every config alike."""

    name: str
    model_types: tuple[str, ...]
    norms: Norms = Norms()
    norm_offset: float = 0.0
    qk_norm: str | None = None
    scaled_embedding: bool = False
    query_pre_attn_scalar: bool = False
    attention_softcap: bool = False
    final_softcap: bool = False
    multipliers: bool = False
    rope_layers: bool = False
    fused_projections: bool = False
    attention_sinks: bool = False
    feed_forward: FeedForward = DenseMLP()
    mixers: tuple[tuple[str, str], ...] = ()

    def mixer_kinds(self, config, layers: int) -> tuple[str, ...]:
        """Each layer's mixer ("attention", or a recurrent kind), from the config's ``layer_types`` (the mixer slot)."""
        if not self.mixers:
            return ("attention",) * layers
        kinds, types = dict(self.mixers), getattr(config, "layer_types", None)
        if not isinstance(types, (list, tuple)) or len(types) != layers:
            got = f"{len(types)} entries" if isinstance(types, (list, tuple)) else repr(types)
            raise ExportError(f"{config.model_type}: layer_types: got {got}; expected one per layer ({layers})")
        for i, kind in enumerate(types):
            if kind not in kinds:
                raise ExportError(f"{config.model_type}: layer_types[{i}]: got {kind!r}; expected one of "
                                  f"{', '.join(kinds)}")
        return tuple(kinds[kind] for kind in types)

    def states(self, config, layers: int) -> tuple[StateSpec, ...]:
        """The recurrent states the mixer slot keeps (``contract.StateSpec``), each kind over the layers that run it."""
        kinds = self.mixer_kinds(config, layers)
        found = ()
        for kind in dict.fromkeys(k for k in kinds if k != "attention"):
            found += RECURRENT[kind].states(config, tuple(i for i, k in enumerate(kinds) if k == kind))
        return found

    def settings(self, config, dims: Dims) -> Settings:
        """What ``config`` makes of this family: every number the block builder reads."""
        if getattr(config, "clip_qkv", None) is not None:  # OLMo's clamp of q, k and v: not built
            raise ExportError(f"{config.model_type}: clip_qkv {config.clip_qkv!r} is not supported; expected none")
        embedding_scale, attention_scale = 1.0, dims.head_dim ** -0.5
        residual_scale, logits_scale = 1.0, 1.0
        if self.scaled_embedding:
            embedding_scale = math.sqrt(config.hidden_size)
        if self.query_pre_attn_scalar:
            attention_scale = config.query_pre_attn_scalar ** -0.5
        if self.multipliers:
            embedding_scale, attention_scale = config.embedding_multiplier, config.attention_multiplier
            residual_scale, logits_scale = config.residual_multiplier, 1.0 / config.logits_scaling
        table = ropes(config, dims.head_dim)
        types = getattr(config, "layer_types", None) or [None] * dims.num_layers
        rotates = [1] * dims.num_layers  # SmolLM3's no_rope_layers: 1 where a layer rotates, 0 where it does not
        if self.rope_layers and getattr(config, "no_rope_layers", None) is not None:
            rotates = list(config.no_rope_layers)
            if len(rotates) != dims.num_layers:
                raise ExportError(f"{config.model_type}: no_rope_layers has {len(rotates)} entries; expected one per "
                                  f"layer ({dims.num_layers})")
        rope_keys = tuple((t if t in table else None) if rotates[i] else NO_ROPE for i, t in enumerate(types))
        return Settings(
            eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            feed_forward=self.feed_forward.settings(config, dims.num_layers),
            embedding_scale=float(embedding_scale),
            attention_scale=float(attention_scale),
            residual_scale=float(residual_scale),
            logits_scale=float(logits_scale),
            attention_softcap=_cap(config, "attn_logit_softcapping") if self.attention_softcap else None,
            final_softcap=_cap(config, "final_logit_softcapping") if self.final_softcap else None,
            windows=_windows(config, dims.num_layers),
            rope_keys=rope_keys,
            ropes=table,
            mixers=self.mixer_kinds(config, dims.num_layers),
        )


NO_ROPE = "no_rope"  # a layer's rope key where it does not rotate (SmolLM3)


@dataclass(frozen=True)
class Settings:
    """One config's numbers: ``rope_keys[i]`` names layer i's entry of ``ropes`` (NO_ROPE: none), ``windows[i]`` its
    sliding window (None: full attention), ``feed_forward[i]`` its feed-forward slot's numbers (a dense MLP's or a
    sparse layer's), ``mixers[i]`` its mixer ("attention" or a recurrent kind); scores are scaled by
    ``attention_scale``, the residual branches by ``residual_scale``, the logits by ``logits_scale``."""

    eps: float
    feed_forward: tuple[LayerSettings, ...]
    embedding_scale: float
    attention_scale: float
    residual_scale: float
    logits_scale: float
    attention_softcap: float | None
    final_softcap: float | None
    windows: tuple[int | None, ...]
    rope_keys: tuple[str | None, ...]
    ropes: dict[str | None, Rope]
    mixers: tuple[str, ...] = ()

    def rope(self, layer: int) -> Rope | None:
        key = self.rope_keys[layer]
        return None if key == NO_ROPE else self.ropes[key]


def features(family: Family, settings: Settings, dims: Dims, tied: bool) -> tuple[str, ...]:
    """What sets this model apart from a plain Llama, in words (the manifest records them; ``inspect`` shows them)."""
    found = []
    if family.norms != Norms():
        found.append("norms " + "/".join(n for n in ("before_attention", "after_attention", "before_mlp", "after_mlp")
                                         if getattr(family.norms, n)))
    if family.norm_offset:
        found.append(f"norm weight + {family.norm_offset:g}")
    if family.qk_norm:
        found.append(f"q/k norm per {family.qk_norm}")
    found += family.feed_forward.features(settings.feed_forward)
    if family.attention_sinks:
        found.append("attention sinks")
    for name, value in (("embedding scale", settings.embedding_scale), ("residual scale", settings.residual_scale),
                        ("logits scale", settings.logits_scale)):
        if value != 1.0:
            found.append(f"{name} {value:g}")
    if not math.isclose(settings.attention_scale, dims.head_dim ** -0.5):
        found.append(f"attention scale {settings.attention_scale:g}")
    for name, cap in (("attention soft-cap", settings.attention_softcap), ("logits soft-cap", settings.final_softcap)):
        if cap:
            found.append(f"{name} {cap:g}")
    windows = sorted({w for w in settings.windows if w})
    if windows:
        count = sum(1 for w in settings.windows if w)
        found.append(f"sliding window {'/'.join(map(str, windows))} on {count} of {len(settings.windows)} layers")
    if NO_ROPE in settings.rope_keys:
        found.append(f"no RoPE on {settings.rope_keys.count(NO_ROPE)} layers")
    for key, rope in settings.ropes.items():
        where = f" ({key})" if key else ""
        if rope.rotary_dim != dims.head_dim:
            found.append(f"partial rotary {rope.rotary_dim}/{dims.head_dim}{where}")
        if rope.long_inv_freq is not None:
            found.append(f"long-RoPE from position {rope.original}{where}")
        if rope.scaling != 1.0:
            found.append(f"RoPE attention factor {rope.scaling:.4g}{where}")
    if len(settings.ropes) > 1:
        found.append("RoPE per layer type")
    for kind in dict.fromkeys(k for k in settings.mixers if k != "attention"):
        found.append(f"{kind} mixer on {settings.mixers.count(kind)} of {len(settings.mixers)} layers")
    if tied:
        found.append("tied embeddings")
    return tuple(found)


def _cap(config, field: str) -> float | None:
    value = getattr(config, field, None)
    return float(value) if value else None


def _windows(config, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers masks it: by ``layer_types`` where the config has them (Gemma 2/3,
    Qwen2/3, SmolLM3), else one ``sliding_window`` for every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        if len(types) != layers:
            raise ExportError(f"{config.model_type}: layer_types has {len(types)} entries; expected one per layer ({layers})")
        return tuple(window if t == "sliding_attention" and window else None for t in types)
    return (window or None,) * layers
