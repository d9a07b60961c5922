"""specdeploy: speculative decoding deployed on ONNX Runtime (and TensorRT) with a NumPy runtime.

The public API: ``Pipeline.load(artifact_dir)``, ``pipeline.generate(prompts, GenerationConfig(...))``,
``pipeline.stream(prompt, config)``; ``export`` (needs the ``export`` extra) writes artifacts. Names load
lazily (PEP 562): ``import specdeploy.contract`` does not load the runtime, and an export never does.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "__version__": "specdeploy.version",
    "Manifest": "specdeploy.contract",
    "ModelSpec": "specdeploy.contract",
    "GenerationConfig": "specdeploy.runtime.config",
    "GenerationResult": "specdeploy.runtime.results",
    "Pipeline": "specdeploy.runtime.pipeline",
    "Provider": "specdeploy.engines.providers",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdeploy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


def export(*args, **kwargs):
    """Export checkpoints to a verify-v1 artifact dir; see ``specdeploy.exporter.export_artifact`` (and its options,
    ``specdeploy.exporter.ExportOptions``)."""
    from .exporter import export_artifact

    return export_artifact(*args, **kwargs)


__all__ = ["GenerationConfig", "GenerationResult", "Manifest", "ModelSpec", "Pipeline", "Provider", "__version__", "export"]
