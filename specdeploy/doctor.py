"""Checks behind ``specdeploy doctor``: each problem comes with what to do about it."""

from __future__ import annotations

from pathlib import Path

from .contract import REEXPORT_INT8, ContractError, Manifest, read_tokenizer, saturating_int8, tokenizer_problems, verify_files

MIN_OPSET = 17
UNREADABLE = ("PermissionError", "Permission denied")  # what a file this user may not read says, wherever it is read
READABLE_FIX = ("the file may well be intact: make it readable by the user running specdeploy (chmod a+r, or chown), "
                "or run as the artifact's owner; no re-export is needed")
MISSING_FIX = "restore the file that the export wrote there (a regular file), or re-export the artifact"
CHANGED_FIX = "the file changed after export: re-export, or restore the original file"


def _fixed(problem: str, fix: str) -> tuple[str, str]:
    """(problem, what to do): a file this user may not read is a matter of permissions, whatever ``fix`` the check
    that met it would give for a broken file."""
    return (problem, READABLE_FIX) if any(mark in problem for mark in UNREADABLE) else (problem, fix)


def diagnose(directory: Path, provider=None, draft_provider=None) -> list[tuple[str, str]]:
    """(problem, fix) pairs for an artifact dir; empty when all is well. ``provider`` (a ``Provider``, default the
    CPU's): the graphs are loaded on it (the draft's on ``draft_provider`` where given), so one it lacks or would run
    only in pieces is a problem."""
    from .runtime.artifact import chat_template

    try:
        manifest = Manifest.read(directory)
    except ContractError as exc:
        return [_fixed(str(exc), "re-export the artifact with `specdeploy export`")]
    problems = []
    for line in verify_files(directory, manifest):
        problems.append(_fixed(line, MISSING_FIX if line.endswith("missing or not a regular file") else CHANGED_FIX))
    if manifest.opset and manifest.opset < MIN_OPSET:
        problems.append((f"opset {manifest.opset} < {MIN_OPSET}", "re-export with this version of specdeploy"))
    problems += [(what, REEXPORT_INT8) for what in saturating_int8(manifest).values()]
    tokenizer_path = Path(directory) / manifest.tokenizer
    if tokenizer_path.is_file():
        try:
            tokenizer = read_tokenizer(tokenizer_path, manifest.tokenizer)
        except ContractError as exc:
            problems.append(_fixed(str(exc), "re-export the artifact"))
        else:
            problems += [(problem, "export draft and target together, with the target's own tokenizer")
                         for problem in tokenizer_problems(tokenizer, manifest)]
            try:
                chat_template(Path(directory), manifest, tokenizer)
            except ContractError as exc:
                problems.append(_fixed(str(exc), "re-export the artifact from a checkpoint whose tokenizer_config.json "
                                                 "is sound"))
    draft, target = manifest.draft, manifest.target
    if draft is not None:
        if draft.vocab_size != target.vocab_size:
            problems.append((f"vocab sizes differ: target {target.vocab_size}, draft {draft.vocab_size}",
                             "use a draft from the target's model family"))
        if draft.capacity < target.capacity:
            problems.append((f"draft capacity {draft.capacity} < target capacity {target.capacity}: requests are "
                             f"limited to {draft.capacity} slots", "re-export both with the same --capacity"))
    if not problems:
        problems += _check_graphs(directory, manifest, provider, draft_provider)
    return problems


def _check_graphs(directory: Path, manifest: Manifest, provider=None, draft_provider=None) -> list[tuple[str, str]]:
    """Load each graph into ONNX Runtime on ``provider`` (default the CPU's; the draft's on ``draft_provider`` where
    given) and compare its inputs/outputs with the manifest."""
    from .engines import ProviderError, load_engine
    from .engines.vetting import check_graph_facts

    problems = []
    for role, spec in manifest.models.items():
        try:
            own = draft_provider if role == "draft" and draft_provider is not None else provider
            load_engine(directory, manifest, role, own or "cpu").close()
            check_graph_facts(Path(directory) / spec.file, spec)
        except ProviderError as exc:  # missing, a graph it would run in pieces, or one that disagrees with the manifest
            problems.append((exc.problem, exc.fix) if exc.fix else _fixed(str(exc), "re-export the artifact"))
        except ContractError as exc:  # unreadable, or ONNX Runtime refused it
            problems.append(_fixed(str(exc), "re-export the artifact"))
        except Exception as exc:  # ONNX Runtime's own load errors (corrupt graph, bad opset)
            problems.append((f"{role}: ONNX Runtime cannot load {manifest.models[role].file}: {exc}",
                             "re-export the artifact"))
    return problems


def diagnose_pair(target: str, draft: str | None) -> list[tuple[str, str]]:
    """(problem, fix) pairs for checkpoints about to be exported together."""
    from .exporter import ExportError
    from .exporter.checkpoint import load_checkpoint
    from .exporter.registry import architecture_of
    from .exporter.tokenizer import differences

    loaded = {}
    problems = []
    for role, path in (("target", target), ("draft", draft)):
        if path is None:
            continue
        try:
            loaded[role] = load_checkpoint(path)
            architecture_of(loaded[role].config.model_type)
        except ExportError as exc:
            problems.append((f"{role}: {exc}", "fix the checkpoint, or pick a supported one"))
    if len(loaded) == 2:
        for line in differences(loaded["target"].tokenizer, loaded["draft"].tokenizer):
            problems.append((f"tokenizers: {line}", "use a draft from the target's model family"))
        if loaded["target"].config.vocab_size != loaded["draft"].config.vocab_size:
            problems.append((f"vocab_size: target {loaded['target'].config.vocab_size}, draft "
                             f"{loaded['draft'].config.vocab_size}", "use a draft from the target's model family"))
    return problems


def describe(directory: Path | None, target: str | None = None, draft: str | None = None) -> list[str]:
    """One line per model: the family it was (or would be) exported as and what sets it apart from a plain Llama;
    from the artifact's manifest, or from each checkpoint's config (no weights read)."""
    if directory is not None:
        manifest = Manifest.read(directory)
        return [described(spec.role, spec.family or spec.architecture, spec.features) for spec in manifest.models.values()]
    from .exporter.checkpoint import load_tokenizer_and_config
    from .exporter.registry import architecture_of

    lines = []
    for role, path in (("target", target), ("draft", draft)):
        if path is not None:
            config = load_tokenizer_and_config(path, tokenizer=False)[1]
            arch = architecture_of(config.model_type)
            lines.append(described(role, arch.name, arch.features(config)))
    return lines


def described(role: str, family: str, features) -> str:
    return f"{role}: family {family}" + (f"; {', '.join(features)}" if features else " (as Llama)")
