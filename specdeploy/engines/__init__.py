"""Engines: one interface over ONNX Runtime (and TensorRT); nothing here knows of speculation."""

from pathlib import Path

from ..contract import Manifest
from .base import Engine, EngineInputError, EngineOutput
from .ort import OrtEngine, ProviderError


def load_engine(directory: Path, manifest: Manifest, role: str, provider: str = "cpu",
                threads: int | None = None) -> Engine:
    """The engine of ``role`` ("target" or "draft") in an artifact dir."""
    spec = manifest.models[role]
    return OrtEngine(Path(directory) / spec.file, spec, provider=provider, threads=threads)


__all__ = ["Engine", "EngineInputError", "EngineOutput", "OrtEngine", "ProviderError", "load_engine"]
