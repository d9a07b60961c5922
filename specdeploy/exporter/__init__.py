"""Hugging Face checkpoints in, verify-v1 ONNX graphs and a manifest out."""

from . import gpt2, llama  # noqa: F401  (registers the architectures)
from .artifact import export_artifact
from .registry import ARCHITECTURES, ExportError

__all__ = ["ARCHITECTURES", "ExportError", "export_artifact"]
