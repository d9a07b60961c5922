"""Rotary position embeddings as a config describes them: inverse frequencies, the attention factor that scales
cos/sin, the rotated share of each head and, for long-RoPE, the second set of frequencies past the trained length.

The frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, llama3, YaRN, long-RoPE), so a scaled
RoPE is the one transformers computes. A config whose ``rope_parameters`` are keyed by layer type (Gemma 3: a local
base for sliding layers, a global one for full layers) gives one ``Rope`` per layer type.

Long-RoPE picks short or long factors by length: transformers uses the long factors for every token of a call
whose last position is at or past ``original_max_position_embeddings``, and the short ones otherwise, so the same
token's K/V depends on how the text was split into calls. Here the choice is per position (short below the trained
length, long from it on): a token's K/V is a function of its position alone, which keeps rollback, ragged rows and
the prefix cache exact. That is what transformers computes for any text within the trained length, and for a
longer one generated token by token after a prompt within it; a single transformers call over a text that crosses
the length rotates its earlier tokens with the long factors too, which this graph does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from ..declared import SUPPORTED_ROPE
from .errors import ExportError


@dataclass(frozen=True)
class Rope:
    """One RoPE: ``inv_freq`` [rotary_dim / 2] and the ``scaling`` (attention factor) applied to cos and sin; with
    long-RoPE, ``long_inv_freq`` used from position ``original`` on."""

    inv_freq: torch.Tensor
    scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    original: int | None = None

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head are rotated (the rest pass through: partial rotary)."""
        return 2 * self.inv_freq.shape[0]

    def angles(self, pos: torch.Tensor) -> torch.Tensor:
        """pos [...] -> angles [..., rotary_dim / 2]: position times each frequency, long-RoPE's chosen per position."""
        angles = pos[..., None].to(torch.float32) * self.inv_freq
        if self.long_inv_freq is None:
            return angles
        long = pos[..., None].to(torch.float32) * self.long_inv_freq
        return torch.where(pos[..., None] >= self.original, long, angles)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for rotate-half RoPE at positions ``pos`` [batch, tokens].  # each [batch, 1, tokens, rotary_dim]"""
        angles = self.angles(pos)
        emb = torch.cat([angles, angles], dim=-1)
        return (emb.cos() * self.scaling)[:, None], (emb.sin() * self.scaling)[:, None]


def ropes(config, head_dim: int) -> dict[str | None, Rope]:
    """Each RoPE of ``config``: keyed by layer type where its ``rope_parameters`` are (Gemma 3), else under None."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    types = set(getattr(config, "layer_types", None) or ())
    if types and types <= set(params) and all(isinstance(params[t], dict) for t in types):
        return {t: _rope(config, head_dim, dict(params[t]), t) for t in sorted(types)}
    return {None: _rope(config, head_dim, params, None)}


def _rope(config, head_dim: int, params: dict, layer_type: str | None) -> Rope:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise ExportError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}")
    if rope_type == "default":
        family_init = _default_init(config.model_type)
        if family_init is not None:  # the family's own: Phi-3's rotates part of each head, Llama's ignores that share
            inv_freq, scaling = family_init(config, layer_type=layer_type)
            return Rope(inv_freq.to(torch.float32), float(scaling))
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return Rope(inv_freq)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = init(config, torch.device("cpu"), **kwargs)
    if rope_type != "longrope":
        return Rope(inv_freq.to(torch.float32), float(scaling))
    original = int(params["original_max_position_embeddings"])
    long_inv_freq, _ = init(config, torch.device("cpu"), seq_len=original + 1, **kwargs)
    return Rope(inv_freq.to(torch.float32), float(scaling), long_inv_freq.to(torch.float32), original)


@cache
def _default_init(model_type: str):
    """transformers' own default RoPE of ``model_type``'s model (its rotary embedding's
    ``compute_default_rope_parameters``: config -> (inv_freq, attention factor)), or None where it has none. Each model
    computes its own: whether a ``partial_rotary_factor`` is honoured is the model's choice (Phi-3's is, Llama's is
    not), so a stray one in a config changes here what it changes there."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None
    found = [c for c in vars(module).values() if inspect.isclass(c) and "compute_default_rope_parameters" in vars(c)]
    if len(found) != 1:
        return None
    compute = found[0].compute_default_rope_parameters
    takes_layer = "layer_type" in inspect.signature(compute).parameters

    def init(config, layer_type: str | None = None):
        return compute(config, layer_type=layer_type) if takes_layer and layer_type is not None else compute(config)

    return init
