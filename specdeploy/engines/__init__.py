"""Engines: one interface over ONNX Runtime (and TensorRT); nothing here knows of speculation."""

from pathlib import Path

from ..contract import ContractError, Manifest
from .base import Engine, EngineInputError, EngineOutput
from .ort import OrtEngine, ProviderError


def load_engine(directory: Path, manifest: Manifest, role: str, provider: str = "cpu",
                threads: int | None = None) -> Engine:
    """The engine of ``role`` ("target" or "draft") in an artifact dir.

    The graph's external-data references are checked before ONNX Runtime sees the file: each must
    name a plain file of the artifact that the manifest lists (ONNX loaders have had
    path-traversal bugs here, CVE-2024-27318).
    """
    spec = manifest.models[role]
    path = Path(directory) / spec.file
    check_external_data(path, manifest)
    return OrtEngine(path, spec, provider=provider, threads=threads)


def check_external_data(path: Path, manifest: Manifest) -> None:
    """Refuse external-data locations that are absolute, climb out (``..``), go through links or are unlisted."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    for tensor in graph.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        where = Path(location)
        target = path.parent / where
        if (where.is_absolute() or len(where.parts) != 1 or where.name in ("", ".", "..")
                or location not in manifest.files or target.is_symlink()):
            raise ContractError(
                f"{path.name}: initializer {tensor.name!r} points its external data at {location!r}; expected a "
                f"plain file inside the artifact dir that the manifest lists ({sorted(manifest.files)})"
            )


__all__ = ["Engine", "EngineInputError", "EngineOutput", "OrtEngine", "ProviderError", "load_engine"]
