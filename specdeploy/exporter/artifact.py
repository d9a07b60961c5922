"""Checkpoints -> an artifact dir: target.onnx, draft.onnx, tokenizer.json, manifest.json.

The dir is built in a temporary sibling and put in place only when complete (``output``), so an
interrupted export never leaves a half-written artifact behind.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable
from pathlib import Path

from ..artifact_checks import check_artifact
from ..contract import GRAPH_ROLE_KEY, ContractError, Manifest, ModelSpec, io_problems, tokenizer_fingerprint
from ..output import OutputError, file_hashes, output_dir, staged
from ..version import __version__
from . import onnx_graph
from .checkpoint import Checkpoint, gguf_vocabulary_digest, load_checkpoint, load_tokenizer_and_config
from .dims import Dims
from .expert_weights import is_router, quantize_gathered_experts
from .filled import read_filled_slots
from .fused import FusedGraph
from .int8 import Int8Error, to_int8_per_row
from .options import ExportOptions, Form
from .registry import Architecture, ExportError, architecture_of
from .tokenizer import differences

DEFAULT_CAPACITY = 2048  # cache slots when the model allows as many and no capacity is given

Progress = Callable[[str], None]


# A full garbage collection costs what the process's heap holds, not what it frees: about 0.6 s inside a test session
# (44 exports' collections were 29 s of a 113 s test file), so it runs only after a model big enough that its
# traced modules' freed memory matters to the export's peak (the demo's 1.5B target: gigabytes)
COLLECT_FROM_PARAMETERS = 50_000_000

def export_artifact(target: str | Path, out: str | Path, draft: str | Path | None = None,
                    options: ExportOptions | None = None, progress: Progress = lambda step: None,
                    **settings) -> Manifest:
    """Export a target (and optionally a draft) checkpoint to a verify-v1 artifact dir at ``out``.

    ``options``: how (``ExportOptions``; or its fields as keywords, ``capacity=96``, not both). ``progress`` is told
    each step. Returns the manifest written. Raises ExportError on bad input, before writing anything.
    """
    if options is not None and settings:
        raise TypeError(f"export_artifact: give options or its fields as keywords ({', '.join(settings)}), not both")
    options = options if options is not None else ExportOptions(**settings)
    options.check_draft(draft)
    try:
        out = output_dir(Path(out), options.force)  # refused now, not after minutes of exporting
    except OutputError as exc:
        raise ExportError(str(exc)) from None
    sources = {"target": target} if draft is None else {"target": target, "draft": draft}
    if draft is not None:
        progress("checking that draft and target share a tokenizer and vocabulary")
        _check_pair(target, draft)
        _check_draft_vocab(draft, options.draft_vocab)
    with staged(out) as staging:
        specs = {role: _export_model(role, source, staging, options, progress) for role, source in sources.items()}
        manifest = _write_manifest(staging, specs, options.capacity, progress)
        _check_written(staging, out)
    progress(f"wrote {out}")
    return manifest


def _check_written(staging: Path, out: Path) -> None:
    """Refuse to put in place an artifact its own loader would refuse (``check_artifact``): the staging dir is removed
    and nothing is written to ``out``."""
    try:
        check_artifact(staging)
    except ContractError as exc:
        message = str(exc).replace(str(staging), str(out))
        raise ExportError(f"the artifact would not load, so nothing was written: {message}") from None


def _export_model(role: str, source, staging: Path, options: ExportOptions, progress: Progress) -> ModelSpec:
    """Write ``role``'s graph from checkpoint ``source`` into ``staging`` in its final form; return its spec.

    One checkpoint in memory at a time (a 1.5B model is ~7 GB of fp32 weights), and large ones traced in a child
    process: torch keeps the heap of a traced export, which the quantizer that comes next needs."""
    form = options.form(role)
    isolated = _is_large(source) if options.isolate is None else options.isolate
    facts = (_trace_in_child if isolated else _trace)(role, source, staging, options.capacity, progress, form)
    path = staging / f"{role}.onnx"
    fmt = options.weights_of(role)
    written = "full" if form.int4 else fmt  # a fused int4 graph is quantized as it is written
    _compress(role, path, options.dtype, written, (options.block_size, options.accuracy_level), progress,
              converted=form.dtype != options.dtype, experts=fmt)
    if form.filled_slots:
        progress(f"{role}: reading only the filled slots (rounded up to {form.filled_slots}), the head over the kept "
                 "positions only")
        facts = facts | {"filled_slots": form.filled_slots, "trims_logits": _read_filled_slots(path, form.filled_slots)}
    _stamp_role(path, role)
    return ModelSpec(role=role, file=path.name, dtype=options.dtype, weights=fmt, graph=form.graph, **facts)


def _write_manifest(staging: Path, specs: dict[str, ModelSpec], capacity: int | None, progress: Progress) -> Manifest:
    """The manifest of the models in ``staging``, written there with every file's sha256. Without a ``capacity``
    given, each model's own limit: the pair serves what both allow."""
    if capacity is None:
        least = min(spec.capacity for spec in specs.values())
        specs = {role: dataclasses.replace(spec, capacity=least) for role, spec in specs.items()}
    progress("hashing files")
    manifest = Manifest(models=specs, files=file_hashes(staging), exporter_version=__version__, opset=onnx_graph.OPSET)
    manifest.write(staging)
    return manifest


def _check_pair(target, draft) -> None:
    """Refuse a pair whose tokenizers or vocab sizes differ, before any weight is loaded."""
    digest = gguf_vocabulary_digest(target)
    if digest is not None and digest == gguf_vocabulary_digest(draft):
        return  # the same tokenizer metadata, byte for byte: building both tokenizers would only confirm it
    (t_tok, t_config), (d_tok, d_config) = load_tokenizer_and_config(target), load_tokenizer_and_config(draft)
    problems = differences(t_tok, d_tok)
    if problems:
        raise ExportError("the draft's tokenizer differs from the target's:\n  " + "\n  ".join(problems))
    t_vocab, d_vocab = _vocab_size(t_config), _vocab_size(d_config)
    if t_vocab != d_vocab:
        raise ExportError(
            f"vocab_size differs: target {t_vocab}, draft {d_vocab}; "
            "the logits of both must index the same tokens"
        )


def _check_draft_vocab(draft, draft_vocab: int | None) -> None:
    """Refuse a ``draft_vocab`` that leaves nothing out of the draft's vocabulary: now, not after minutes of
    exporting the target."""
    if draft_vocab is None:
        return
    vocab = _vocab_size(load_tokenizer_and_config(draft, tokenizer=False)[1])
    if draft_vocab >= vocab:
        raise ExportError(f"draft_vocab {draft_vocab} leaves nothing out of the vocabulary of {vocab}; "
                          "give fewer tokens, or none")


def _vocab_size(config) -> int:
    """A config's vocabulary: its text config's, for a multimodal one (Gemma 3's has no vocab_size of its own)."""
    return config.get_text_config().vocab_size


def _trace(role: str, source, staging: Path, capacity: int | None, progress: Progress, form: Form = Form()) -> dict:
    """Load a checkpoint and write its verify graph to ``staging/role.onnx``; return the model's facts (the
    ``ModelSpec`` fields it fills). The target's tokenizer files are written beside it."""
    progress(f"loading {role} {source}")
    checkpoint = load_checkpoint(source)
    if role == "target":
        checkpoint.tokenizer.save(str(staging / "tokenizer.json"))
        if checkpoint.tokenizer_config is not None:  # chat template, BOS/EOS, add_bos_token: hashed like the rest
            (staging / "tokenizer_config.json").write_text(json.dumps(checkpoint.tokenizer_config, indent=2))
    arch = architecture_of(checkpoint.config.model_type)
    dims = arch.dims(checkpoint.config)
    capacity = _capacity(role, capacity, dims)
    fused = form.graph == "fused"
    facts = {
        "capacity": capacity,
        "architecture": checkpoint.config.model_type,
        "family": arch.name,
        "features": arch.features(checkpoint.config),
        **dims.spec_fields(),
        "tokenizer_fingerprint": tokenizer_fingerprint(checkpoint.tokenizer),
        "eos_token_ids": tuple(checkpoint.eos_token_ids),
        "parameters": checkpoint.parameters,
        "vocab_kept": form.vocab_kept,
        "trims_logits": fused,
        "takes_seqlens_k": fused,
        "argmax_ids": fused,
        "takes_state_slots": fused and bool(dims.states),  # exporter/recurrent_fused.py
        "slot_attention": not fused,  # layers.cached_attention
    }
    progress(f"{role}: building the verify graph ({arch.name}, {dims.num_layers} layers)")
    notes = _write_graph(role, arch, checkpoint, dims, capacity, form, staging / f"{role}.onnx", progress)
    facts["features"] = (*facts["features"], *notes)  # how this form computes what the family's features name
    large = checkpoint.parameters >= COLLECT_FROM_PARAMETERS
    del checkpoint
    if large:  # the traced modules' cycles hold gigabytes until collected; a tiny model's, nothing worth a full pass
        gc.collect()
    traced = ModelSpec(role=role, file=f"{role}.onnx", dtype=form.dtype, weights="full", graph=form.graph, **facts)
    problems = io_problems(traced, onnx_graph.declared_io(staging / f"{role}.onnx"))
    if problems:  # a config that disagrees with its own weights (vocab_size, heads, head_dim)
        raise ExportError(f"{role}: the checkpoint's config.json disagrees with its weights: " + "; ".join(problems[:3]))
    return facts


def _capacity(role: str, capacity: int | None, dims: Dims) -> int:
    """The cache slots ``role`` is exported for: ``capacity``, which the model must allow, or its own limit (at most
    DEFAULT_CAPACITY)."""
    if capacity is None:
        return min(DEFAULT_CAPACITY, dims.max_positions or DEFAULT_CAPACITY)
    if dims.max_positions and capacity > dims.max_positions:
        raise ExportError(f"{role}: capacity {capacity} exceeds the model's max_position_embeddings {dims.max_positions}")
    return capacity


def _write_graph(role: str, arch: Architecture, checkpoint: Checkpoint, dims: Dims, capacity: int, form: Form, path: Path,
                 progress: Progress) -> tuple[str, ...]:
    """Write ``checkpoint``'s verify graph at ``path`` in ``form``: the fused form written layer by layer, each built
    from the checkpoint as it is reached; the explicit form traced by torch.onnx. Returns what the graph says of how it
    computes (``FusedGraph.note``: which op runs a mixture's experts)."""
    import torch

    with torch.no_grad():
        module = arch.build(checkpoint.config, checkpoint.weights, capacity, streamed=form.graph == "fused")
        if form.graph == "fused":
            progress(f"{role}: writing the fused graph" + (" (int4 weights)" if form.int4 else ""))
            graph = FusedGraph(path, dims, dtype=form.dtype, int4=form.int4, vocab_kept=form.vocab_kept,
                               progress=lambda step: progress(f"{role}: {step}"), int8=form.int8)
            graph.save(module.write_fused(graph, capacity))
            return tuple(graph.notes)
        checkpoint.weights.clear()  # the module holds its own (transposed) copies
        progress(f"{role}: exporting to ONNX")
        onnx_graph.export_graph(module, dims, path)
        return ()


def _trace_in_child(role: str, source, staging: Path, capacity: int | None, progress: Progress, form: Form) -> dict:
    """``_trace`` in a fresh process, relaying its progress; its memory goes back to the OS when it ends."""
    import multiprocessing
    import queue as queues

    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    process = context.Process(target=_trace_child, args=(role, str(source), str(staging), capacity, form, messages))
    process.start()
    try:
        while True:
            try:
                kind, payload = messages.get(timeout=1.0)
            except queues.Empty:
                if not process.is_alive():
                    raise ExportError(f"{role}: the export process died (exit code {process.exitcode}; "
                                      "-9 means it ran out of memory)") from None
                continue
            if kind == "progress":
                progress(payload)
            elif kind == "error":
                raise ExportError(payload)
            else:
                return payload
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()


def _trace_child(role: str, source: str, staging: str, capacity: int | None, form: Form, messages) -> None:
    try:
        facts = _trace(role, source, Path(staging), capacity, lambda m: messages.put(("progress", m)), form)
    except ExportError as exc:
        messages.put(("error", str(exc)))
    except Exception as exc:  # any failure reaches the parent as one clear message
        messages.put(("error", f"{role}: {type(exc).__name__}: {exc}"))
    else:
        messages.put(("done", facts))


def _is_large(source) -> bool:
    """GGUF files, hub ids and checkpoints over 256 MB are traced in a child process."""
    path = Path(source)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors")) > 256 << 20
    return True


def _compress(role: str, path: Path, dtype: str, fmt: str, quant: tuple[int, int], progress: Progress,
              converted: bool = True, experts: str | None = None) -> None:
    """int8 / int4 weights and fp16, rewriting the traced graph at ``path`` in place. ``converted``: the graph was
    written in float32 and float16 comes from converting it (false where it was written in float16). ``experts``: the
    format of a mixture's gathered experts (the explicit form's, and a fused graph's written in standard ops), which
    the MatMul rewrites do not reach (default: ``fmt``)."""
    experts = fmt if experts is None else experts
    if experts in ("int8", "int4"):
        bits = 8 if experts == "int8" else 4
        if quantize_gathered_experts(path, bits, quant[0], onnx_graph.EXTERNAL_DATA_BYTES):
            progress(f"{role}: quantized the experts to int{bits}")
    if fmt == "int8":
        progress(f"{role}: quantizing MatMul weights to int8 (per column; activations per row)")
        try:
            to_int8_per_row(path, onnx_graph.EXTERNAL_DATA_BYTES, lambda message: progress(f"{role}: {message}"),
                            kept=is_router)
        except Int8Error as exc:
            raise ExportError(f"{role}: {exc}") from None
    to_float16 = dtype == "float16" and converted
    if fmt == "int4" or to_float16:
        model = onnx_graph.load(path)
        if fmt == "int4":
            progress(f"{role}: quantizing MatMul weights to int4 (MatMulNBits, block {quant[0]}, accuracy {quant[1]})")
            model = onnx_graph.to_int4(model, block_size=quant[0], accuracy_level=quant[1])
        if to_float16:
            progress(f"{role}: converting to float16")
            model = onnx_graph.to_float16(model)
        progress(f"{role}: writing {role}.onnx")
        onnx_graph.save(model, path)


def _read_filled_slots(path: Path, bucket: int) -> bool:
    """Rewrite the explicit graph at ``path`` so that its attention reads only the filled slots (``filled``) and its
    head runs over the last ``num_logits`` positions only; returns whether the head could be trimmed. Only the graph's
    own proto is rewritten: weights in an external-data file stay where they are."""
    import onnx

    from ..importer.rewrites import head_trimmed

    model = onnx.load(str(path), load_external_data=False)
    read_filled_slots(model, bucket)
    trimmed = bool(head_trimmed(model, "logits"))
    onnx.save_model(model, str(path))
    return trimmed


def _stamp_role(path: Path, role: str) -> None:
    """Record in the graph's metadata which role it was exported as (``GRAPH_ROLE_KEY``). Only the graph's own
    proto is rewritten: weights in an external-data file stay where they are."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, GRAPH_ROLE_KEY: role})
    onnx.save_model(model, str(path))
