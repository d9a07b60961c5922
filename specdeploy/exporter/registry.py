"""Architectures are registered, not branched on: a decoder family is a description (``family.Family``, declared in
families.py and llama.py) over one block builder, GPT-2 a module of its own; each is an ``Architecture`` a type
checker can check against the protocols here (and ``VerifyModel`` for what its ``build`` returns)."""

from __future__ import annotations

from typing import Protocol

import torch

from .dims import Dims
from .errors import ExportError
from .fused import FusedGraph


class VerifyModel(Protocol):
    """A family's verify-v1 model (a torch module): ``forward`` is the explicit form, traced by torch.onnx, and
    ``write_fused`` writes the fused form into a ``FusedGraph``."""

    def forward(self, input_ids: torch.Tensor, past_len: torch.Tensor, *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(logits [batch, tokens, vocab] float32, new_key.0, new_value.0, ...: [batch, kv_heads, tokens, head_dim])
        of new tokens ``input_ids`` [batch, tokens] at ``past_len`` [batch] over ``cache`` (2 * layers tensors of
        [batch, kv_heads, capacity, head_dim])."""
        ...

    def write_fused(self, graph: FusedGraph, capacity: int) -> str:
        """Write the same forward as ONNX Runtime's fused ops into ``graph``; return the logits' name."""
        ...


class Architecture(Protocol):
    """A model family: the config ``model_types`` it reads, its sizes and its verify model."""

    name: str
    model_types: tuple[str, ...]

    def dims(self, config) -> Dims:
        """The sizes of a config."""
        ...

    def features(self, config) -> tuple[str, ...]:
        """What sets a config's model apart from a plain Llama, in words (the manifest's ``features``)."""
        ...

    def build(self, config, weights: dict[str, torch.Tensor], capacity: int, streamed: bool = False) -> VerifyModel:
        """The verify model of this family, filled with ``weights``; with ``streamed``, its ``write_fused`` may take
        layers from ``weights`` as it writes them (the forward then cannot run)."""
        ...


ARCHITECTURES: dict[str, Architecture] = {}
__all__ = ["ARCHITECTURES", "Architecture", "ExportError", "VerifyModel", "architecture_of", "register", "take"]


def register(arch: Architecture) -> Architecture:
    for model_type in arch.model_types:
        ARCHITECTURES[model_type] = arch
    return arch


def architecture_of(model_type: str) -> Architecture:
    """The architecture registered for ``model_type``; ExportError naming the supported ones otherwise."""
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ExportError(f"model_type {model_type!r} is not supported; supported: {supported}")
    return ARCHITECTURES[model_type]


def take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ExportError(f"checkpoint has no tensor {name!r}")
    return weights[name]
