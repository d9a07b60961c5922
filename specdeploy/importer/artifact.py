"""Folders others wrote -> an artifact dir: their graphs as they are, their contract in the manifest, every file hashed.

The graph's file is rewritten in these ways only, each recorded in the manifest (``ImportedIO.rewrites``): its external
data is renamed after its role (a target and a draft from two folders both call theirs ``model.onnx.data``), the
role it is imported as is stamped in its metadata, as ours are, and its nodes change where ``rewrites`` says (logits
cast to float32, the head computed for the positions a call asks for only). Weights are linked where the filesystem allows, else
copied; either way they are hashed, so a source file changed later is caught when the artifact is opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from ..artifact_checks import check_artifact
from ..contract import (
    GRAPH_ROLE_KEY,
    LAYOUT_FORMS,
    ContractError,
    Manifest,
    ModelSpec,
    read_tokenizer,
    sha256_file,
    tokenizer_fingerprint,
    tokenizer_problems,
)
from ..engines.vetting import check_foreign_graph, external_tensors
from ..files import MAX_JSON_BYTES, read_regular
from ..output import OutputError, file_hashes, output_dir, staged
from ..version import __version__
from .rewrites import head_trimmed, logits_in_float32
from .sources import ImportRefused, Source, graph_io, read_source

DEFAULT_CAPACITY = 2048  # cache slots when the folder allows as many and no capacity is given
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def import_artifact(target: str | Path, out: str | Path, draft: str | Path | None = None, capacity: int | None = None,
                    force: bool = False, progress=lambda step: None) -> Manifest:
    """Import an onnxruntime-genai model folder or an optimum export (``target``; optionally a ``draft`` of either kind
    with the same tokenizer) into an artifact dir at ``out``. ``capacity``: the cache slots a request may use (default:
    what the folders allow, at most DEFAULT_CAPACITY). Returns the manifest written; raises ImportRefused naming what
    is wrong before anything is written."""
    sources = {"target": read_source(Path(target))}
    if draft is not None:
        sources["draft"] = read_source(Path(draft))
    tokenizers = {role: _tokenizer(source) for role, source in sources.items()}
    fingerprints = {role: tokenizer_fingerprint(tokenizer) for role, tokenizer in tokenizers.items()}
    if draft is not None and fingerprints["draft"] != fingerprints["target"]:
        raise ImportRefused(f"{draft}: the draft's tokenizer differs from the target's (vocabulary and special tokens: "
                            f"fingerprint {fingerprints['draft'][:12]}…, target's {fingerprints['target'][:12]}…); "
                            "expected one tokenizer")
    graphs = {role: _vetted_graph(role, source) for role, source in sources.items()}
    limit = min([capacity or DEFAULT_CAPACITY] + [source.facts["capacity"] for source in sources.values()])
    if capacity is not None and capacity > limit:
        raise ImportRefused(f"capacity {capacity} exceeds what the folders allow ({limit} positions)")
    planned = {role: _plan(role, source, graphs[role], limit, fingerprints[role]) for role, source in sources.items()}
    opset = next((o.version for o in graphs["target"][0].opset_import if o.domain in ("", "ai.onnx")), 0)
    manifest = Manifest(models={role: spec for role, (spec, _) in planned.items()}, exporter_version=__version__,
                        opset=opset)
    _check(manifest, tokenizers["target"])
    try:
        out = output_dir(Path(out), force)
    except OutputError as exc:
        raise ImportRefused(str(exc)) from None
    with staged(out) as staging:  # a killed import's staging dir is removed by the next, as an export's is
        for role, source in sources.items():
            progress(f"{role}: importing {source.graph} ({source.io.source})")
            _write_model(source, graphs[role][0], planned[role], staging)
        _keep_files(sources["target"], staging)
        progress("hashing files")
        manifest.files = file_hashes(staging)
        manifest.write(staging)
        try:  # what its loader checks before any session: an artifact it would refuse is never put in place
            check_artifact(staging)
        except ContractError as exc:
            raise ImportRefused("the artifact would not load, so nothing was written: "
                                + str(exc).replace(str(staging), str(out))) from None
    progress(f"wrote {out}")
    return manifest


def _check(manifest: Manifest, tokenizer) -> None:
    """Refuse what the folders declared that a manifest may not hold (sizes, token ids), or a tokenizer whose ids reach
    beyond the models' vocabulary, as opening the artifact would, but now and naming the folder's values."""
    try:
        Manifest.from_dict(json.loads(manifest.to_json()))
    except ContractError as exc:
        raise ImportRefused(f"the folder's config does not make a valid manifest: {exc}") from None
    problems = tokenizer_problems(tokenizer, manifest)
    if problems:
        raise ImportRefused(problems[0])


def _tokenizer(source: Source):
    try:
        return read_tokenizer(source.folder / TOKENIZER)
    except ContractError as exc:
        raise ImportRefused(f"{source.folder}: no usable {TOKENIZER} ({exc}); the folder must carry its tokenizer") from exc


def _vetted_graph(role: str, source: Source) -> tuple:
    """(ModelProto without its weights, graph facts) of ``source``'s graph, vetted before ONNX Runtime sees a byte."""
    import onnx

    try:
        check_foreign_graph(source.graph)
        model = onnx.load(str(source.graph), load_external_data=False)
    except ContractError as exc:
        raise ImportRefused(f"{role}: {exc}") from exc
    except Exception as exc:  # protobuf's errors for a truncated or foreign file
        raise ImportRefused(f"{source.graph}: not a readable ONNX graph ({type(exc).__name__}: {exc})") from exc
    return model, graph_io(source, model)


def _plan(role: str, source: Source, graph: tuple, capacity: int, fingerprint: str) -> tuple[ModelSpec, dict]:
    """``role``'s manifest entry and its weight files' new names (source name -> artifact name); the graph's proto
    (``graph[0]``) is changed to match: its external data renamed after its role, the role stamped in its metadata."""
    import onnx

    model, io_facts = graph
    renamed: dict[str, str] = {}
    for tensor in external_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location":
                renamed.setdefault(entry.value, f"{role}.{entry.value}")
                entry.value = renamed[entry.value]
    rewrites = [f"external data {old} renamed {new}" for old, new in sorted(renamed.items())]
    rewrites += logits_in_float32(model, source.io.logits)
    trimmed = head_trimmed(model, source.io.logits)
    rewrites += trimmed
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, GRAPH_ROLE_KEY: role})
    rewrites.append(f"metadata {GRAPH_ROLE_KEY} = {role}")
    io = dataclasses.replace(source.io, origin=source.graph.name, origin_sha256=sha256_file(source.graph),
                             rewrites=tuple(rewrites), position_ids=source.io.position_ids if io_facts["takes_positions"] else "")
    facts = dict(source.facts)
    facts["capacity"] = capacity
    facts["eos_token_ids"] = tuple(facts["eos_token_ids"])
    spec = ModelSpec(role=role, file=f"{role}.onnx", dtype=io_facts["dtype"], weights=_weights(model),
                     graph=LAYOUT_FORMS[io.cache], tokenizer_fingerprint=fingerprint, parameters=_parameters(model),
                     imported=io, trims_logits=bool(trimmed), **facts)
    return spec, renamed


def _write_model(source: Source, model, planned: tuple[ModelSpec, dict], staging: Path) -> None:
    """Write the planned graph (``model``, its proto as ``_plan`` changed it) and link its weights into ``staging``."""
    import onnx

    spec, renamed = planned
    for old, new in sorted(renamed.items()):
        _link(source.folder / old, staging / new)
    onnx.save_model(model, str(staging / spec.file))


def _weights(model) -> str:
    """int4 where the graph multiplies by 4-bit blocks (MatMulNBits, bits 4), int8 at 8 bits, else full."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            bits = next((a.i for a in node.attribute if a.name == "bits"), 4)
            return "int4" if bits == 4 else "int8"
    return "full"


def _parameters(model) -> int:
    """Elements of the graph's initializers (packed int4 weights count a byte per two)."""
    total = 0
    for tensor in model.graph.initializer:
        count = 1
        for dim in tensor.dims:
            count *= dim
        total += count
    return total


def _link(source: Path, target: Path) -> None:
    """A hard link where the filesystem allows one (no copy of gigabytes of weights), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _keep_files(source: Source, staging: Path) -> None:
    """The target folder's tokenizer, chat template and generation settings, beside the graphs. A chat template kept
    in chat_template.jinja goes into tokenizer_config.json, where the runtime reads it, when that has none."""
    shutil.copyfile(source.folder / TOKENIZER, staging / TOKENIZER)
    for name in source.kept:
        shutil.copyfile(source.folder / name, staging / name)
    template = source.folder / "chat_template.jinja"
    if template.is_file() and not template.is_symlink():  # both files were checked when the folder was read
        config_path = staging / TOKENIZER_CONFIG
        config = json.loads(read_regular(config_path, MAX_JSON_BYTES)) if config_path.is_file() else {}
        if config.get("chat_template") is None:
            config["chat_template"] = read_regular(template, MAX_JSON_BYTES).decode("utf-8")
            config_path.write_text(json.dumps(config, indent=2))
