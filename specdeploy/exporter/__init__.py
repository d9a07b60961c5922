"""Hugging Face checkpoints in, verify-v1 ONNX graphs and a manifest out."""

from . import families, gpt2, hybrids, llama  # noqa: F401  (registers the architectures)
from .artifact import export_artifact
from .dims import Dims
from .errors import ExportError
from .options import ExportOptions
from .registry import ARCHITECTURES

__all__ = ["ARCHITECTURES", "Dims", "ExportError", "ExportOptions", "export_artifact"]
