"""Engines: one interface over ONNX Runtime (and TensorRT); nothing here knows of speculation."""

import warnings
from pathlib import Path

from ..contract import REEXPORT_INT8, ContractError, Manifest, saturating_int8
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
        return OrtEngine(path, spec, provider=provider, threads=threads)
    except ProviderError:
        raise
    except Exception as exc:  # ONNX Runtime's own load errors: empty graph, unknown ops, bad opset
        raise ContractError(f"{spec.file}: ONNX Runtime cannot load it ({type(exc).__name__}: {exc})") from exc


def check_external_data(path: Path, manifest: Manifest) -> None:
    """Refuse external-data locations that are absolute, climb out (``..``), go through links or are
    unlisted, wherever the tensor sits: initializers, Constant nodes and any attribute, in any subgraph.
    The locations a graph names are read once per file identity (``digests``): parsing an 800 MB graph
    with its weights inline takes over a second."""
    from ..digests import remembered_fact

    for location, owner in remembered_fact(path, "external_data", _external_locations).items():
        where = Path(location)
        target = path.parent / where
        if (where.is_absolute() or len(where.parts) != 1 or where.name in ("", ".", "..")
                or location not in manifest.files or target.is_symlink()):
            raise ContractError(
                f"{path.name}: {owner} points its external data at {location!r}; expected a plain file inside "
                f"the artifact dir that the manifest lists ({sorted(manifest.files)})"
            )


def _external_locations(path: Path) -> dict[str, str]:
    """Each external-data location a graph names -> the first tensor that names it."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    locations: dict[str, str] = {}
    for owner, tensor in _tensors(graph.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            locations.setdefault(location, owner)
    return locations


def _tensors(graph, where: str = ""):
    """(owner, tensor) for every tensor a graph holds, its subgraphs' included."""
    for tensor in graph.initializer:
        yield f"{where}initializer {tensor.name!r}", tensor
    for sparse in graph.sparse_initializer:
        yield f"{where}sparse initializer {sparse.values.name!r}", sparse.values
        yield f"{where}sparse initializer {sparse.values.name!r}", sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            owner = f"{where}node {node.name or node.op_type!r} attribute {attr.name!r}"
            held = [attr.t] if attr.HasField("t") else []
            held += list(attr.tensors)
            for sparse in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors):
                held += [sparse.values, sparse.indices]
            for tensor in held:
                yield owner, tensor
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _tensors(sub, f"{owner} > ")


__all__ = ["Engine", "EngineInputError", "EngineOutput", "OrtEngine", "ProviderError", "load_engine"]
