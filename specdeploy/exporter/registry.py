"""Architectures are registered, not branched on: one small module per family."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ExportError(ValueError):
    """A checkpoint or option the exporter cannot turn into a verify-v1 artifact."""


class Architecture(Protocol):
    name: str
    model_types: tuple[str, ...]

    def dims(self, config) -> dict:
        """num_layers, num_heads, kv_heads, head_dim, vocab_size, max_positions of a config."""

    def build(self, config, weights: dict[str, torch.Tensor], capacity: int, streamed: bool = False) -> nn.Module:
        """The explicit verify-v1 forward of this family, filled with ``weights``; with ``streamed``, its
        ``write_fused`` may take layers from ``weights`` as it writes them (the forward then cannot run)."""


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    for model_type in arch.model_types:
        ARCHITECTURES[model_type] = arch
    return arch


def lookup(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ExportError(f"model_type {model_type!r} is not supported; supported: {supported}")
    return ARCHITECTURES[model_type]


def take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ExportError(f"checkpoint has no tensor {name!r}")
    return weights[name]
