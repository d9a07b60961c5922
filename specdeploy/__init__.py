"""specdeploy: speculative decoding deployed on ONNX Runtime (and TensorRT) with a NumPy runtime.

The public API: ``Pipeline.load(artifact_dir)``, ``pipeline.generate(prompts, GenerationConfig(...))``,
``pipeline.stream(prompt, config)``; ``export`` (needs the ``export`` extra) writes artifacts.
"""

__version__ = "0.3.4"

from .contract import Manifest, ModelSpec  # noqa: E402
from .runtime.config import GenerationConfig  # noqa: E402
from .runtime.pipeline import GenerationResult, Pipeline  # noqa: E402


def export(*args, **kwargs):
    """Export checkpoints to a verify-v1 artifact dir; see ``specdeploy.exporter.export_artifact``."""
    from .exporter import export_artifact

    return export_artifact(*args, **kwargs)


__all__ = ["GenerationConfig", "GenerationResult", "Manifest", "ModelSpec", "Pipeline", "__version__", "export"]
