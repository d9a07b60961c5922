"""Importing graphs we did not write: onnxruntime-genai model folders and optimum exports, into an artifact dir whose
manifest records each graph's own contract (``ImportedIO``); the engines drive each through one adapter."""

from .artifact import import_artifact
from .sources import ImportRefused, read_source

__all__ = ["ImportRefused", "import_artifact", "read_source"]
