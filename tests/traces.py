"""Each explicit-form torch trace made once per test run: the same checkpoint exported again (as a target and as its own
draft, alone and in a pair, at a capacity another test used, through ``specdeploy export`` or ``export_artifact``) gets a
copy of the graph the first export traced, instead of another ~6 s of torch.onnx.export.

Only the trace is shared. Everything around it runs for real in every export: the checkpoint is read, the verify module
is built from its weights, the graph's inputs and outputs are checked against the manifest, and int8 / int4 / float16
rewrites, role stamps and hashes are made anew. The key is what the trace is a function of: every file of the
checkpoint but its tokenizer's, the config as loaded (less the directory it was loaded from), the capacity, the form,
the module's class and the exporter's own tracing constants. A trace that writes more than its one file (external data)
is never shared, and an export in a child process (``isolate``, GGUF files) traces for itself: the patches live in this
process alone. ``ROOT/log`` says what each trace cost and which test paid: where a test could use a model another
test traces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

ROOT: Path | None = None  # set by conftest.py: a directory every xdist worker of the run shares
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
_current = threading.local()  # the key of the trace the running _write_graph asks for


def install(monkeypatch, root: Path) -> None:
    """Route ``artifact._write_graph`` and ``onnx_graph.export_graph`` through the cache at ``root``."""
    global ROOT
    from specdeploy.exporter import artifact, onnx_graph

    ROOT = root
    root.mkdir(exist_ok=True)
    write_graph, export_graph = artifact._write_graph, onnx_graph.export_graph

    def keyed_write_graph(role, arch, checkpoint, dims, capacity, form, path, progress):
        _current.key = _key(arch, checkpoint, dims, capacity, form) if form.graph == "explicit" else None
        try:
            return write_graph(role, arch, checkpoint, dims, capacity, form, path, progress)
        finally:
            _current.key = None

    def cached_export_graph(module, dims, path):
        key = getattr(_current, "key", None)
        _current.key = None  # one trace per key set: a nested or repeated call traces for itself
        if key is None or ROOT is None:
            return export_graph(module, dims, path)
        return _cached(key, type(module), lambda out: export_graph(module, dims, out), Path(path))

    monkeypatch.setattr(artifact, "_write_graph", keyed_write_graph)
    monkeypatch.setattr(onnx_graph, "export_graph", cached_export_graph)


def _cached(key: str, module_type: type, trace, path: Path) -> None:
    from filelock import FileLock

    from specdeploy.exporter import onnx_graph

    key = _digest(key, f"{module_type.__module__}.{module_type.__qualname__}", onnx_graph.OPSET,
                  onnx_graph.EXTERNAL_DATA_BYTES, onnx_graph.EXAMPLE_BATCH, onnx_graph.EXAMPLE_TOKENS,
                  onnx_graph.EXAMPLE_CAPACITY)
    entry = ROOT / f"{key}.onnx"
    with FileLock(f"{entry}.lock"):
        hit = entry.is_file()
        if not hit:
            started = time.perf_counter()
            scratch = ROOT / f"{key}.tracing"
            shutil.rmtree(scratch, ignore_errors=True)  # an earlier attempt that failed
            scratch.mkdir()
            trace(scratch / path.name)
            written = sorted(scratch.iterdir())
            if written != [scratch / path.name]:  # external data names its file: not shareable under another name
                for file in written:
                    shutil.move(file, path.parent / file.name)
                scratch.rmdir()
                _log("unshared", key, path, time.perf_counter() - started)
                return
            (scratch / path.name).replace(entry)
            scratch.rmdir()
        _log("hit" if hit else "trace", key, path, 0.0 if hit else time.perf_counter() - started)
    shutil.copyfile(entry, path)


def _log(what: str, key: str, path: Path, seconds: float) -> None:
    """A line of ROOT/log: how often a trace was shared, what each cost and which test paid (what this cache is worth,
    and where a test could share a model another has traced)."""
    worker, test = os.environ.get("PYTEST_XDIST_WORKER", "-"), os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    with open(ROOT / "log", "a") as log:
        log.write(f"{what} {key} {path.name} {seconds:.1f}s {worker} {test}\n")


def _key(arch, checkpoint, dims, capacity, form) -> str | None:
    """What the trace reads, or None (trace for real) where the checkpoint is not a local directory or file."""
    source = Path(checkpoint.source)
    if not source.exists() or not hasattr(checkpoint.config, "to_json_string"):
        return None
    files = sorted(source.rglob("*")) if source.is_dir() else [source]
    # OpenVINO's form is the explicit trace rewritten after it (``filled_slots``): one trace serves both
    traced = dataclasses.replace(form, filled_slots=0)
    # the config as loaded names the directory it came from: the same checkpoint saved elsewhere traces the same
    config = {k: v for k, v in checkpoint.config.to_dict().items() if k != "_name_or_path"}
    parts = [arch.name, repr(dims), capacity, repr(traced), json.dumps(config, sort_keys=True, default=repr)]
    for file in files:
        if file.is_file() and file.name not in _TOKENIZER_FILES:
            parts += [file.relative_to(source).as_posix() if source.is_dir() else file.name, _file_digest(file)]
    return _digest(*parts)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest(*parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]
