"""Engines: one interface over ONNX Runtime (and TensorRT); nothing here knows of speculation."""

import warnings
from pathlib import Path

from ..contract import REEXPORT_INT8, ContractError, Manifest, saturating_int8
from .base import Engine, EngineClosedError, EngineInputError, EngineOutput, KVCache
from .genai import GenaiEngine
from .optimum import OptimumEngine
from .ort import OrtEngine
from .providers import Provider, ProviderError
from .vetting import check_external_data

# the engine of each cache layout: ours (None), and one adapter per contract of graphs we did not write
ADAPTERS = {None: OrtEngine, "shared": GenaiEngine, "concatenated": OptimumEngine}


def load_engine(directory: Path, manifest: Manifest, role: str, provider: str | Provider = "cpu",
                threads: int | None = None) -> Engine:
    """The engine of ``role`` ("target" or "draft") in an artifact dir, on ``provider`` (a word of
    ``providers.PROVIDERS`` or a ``Provider`` with its options).

    The graph's external-data references are checked before ONNX Runtime sees the file: each must
    name a plain file of the artifact that the manifest lists (ONNX loaders have had
    path-traversal bugs here, CVE-2024-27318).
    """
    spec = manifest.models[role]
    path = Path(directory) / spec.file
    wrong = saturating_int8(manifest).get(role)
    if wrong:
        warnings.warn(f"{directory}: {wrong}: {REEXPORT_INT8}", stacklevel=2)
    try:
        check_external_data(path, manifest)
    except ContractError:
        raise
    except Exception as exc:  # protobuf's errors for a truncated or foreign file
        raise ContractError(f"{spec.file}: not a readable ONNX graph ({type(exc).__name__}: {exc})") from exc
    try:
        return ADAPTERS[spec.imported.cache if spec.imported else None](path, spec, provider=provider, threads=threads)
    except ProviderError:
        raise
    except Exception as exc:  # ONNX Runtime's own load errors: empty graph, unknown ops, bad opset
        raise ContractError(f"{spec.file}: ONNX Runtime cannot load it ({type(exc).__name__}: {exc})") from exc


__all__ = ["Engine", "EngineClosedError", "EngineInputError", "EngineOutput", "KVCache", "OrtEngine", "Provider",
           "ProviderError", "load_engine"]
