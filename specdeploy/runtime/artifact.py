"""Opening an artifact dir: files checked against the manifest, tokenizer and models agreeing, engines loaded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..artifact_checks import TOKENIZER_CONFIG, check_bos, read_tokenizer_config
from ..contract import ContractError, Manifest, read_tokenizer, tokenizer_facts, tokenizer_problems, verify_files
from ..digests import remembered_fact
from ..engines import Engine, Provider, load_engine
from ..engines.vetting import check_graph_facts
from .chat import ChatTemplate

SHOWN_PROBLEMS = 10  # file problems listed in full when loading; the rest are counted (`specdeploy doctor` lists more)


def open_artifact(directory: Path, provider: str | Provider = "cpu", threads: int | None = None,
                  verify_hashes: bool = True, draft_provider: str | Provider | None = None,
                  ) -> tuple[Manifest, object, ChatTemplate, Engine, Engine | None]:
    """The manifest, tokenizer, chat template, target engine and draft engine (None without a draft) of
    ``directory``, the target on ``provider`` and the draft on ``draft_provider`` (None: ``provider``). The chat
    template (and BOS handling) comes from tokenizer_config.json when the manifest lists it; otherwise there is none,
    and prompts get no BOS.

    Every file's sha256 is checked against the manifest before any byte reaches ONNX Runtime,
    unless ``verify_hashes=False``; a file unchanged since this user last hashed it (same device,
    inode, size, mtime and ctime: ``specdeploy.digests``) is not hashed again. Both models must have
    been exported with the artifact's tokenizer and share a vocabulary.
    """
    manifest = Manifest.read(directory)
    if verify_hashes:
        problems = verify_files(directory, manifest, remembered=True)
        if problems:
            more = len(problems) - SHOWN_PROBLEMS
            listed = problems[:SHOWN_PROBLEMS] + ([f"… and {more:,} more ({len(problems):,} in all)"] if more > 0 else [])
            raise ContractError(f"{directory}: artifact files do not match the manifest:\n  " + "\n  ".join(listed))
    draft_spec = manifest.draft
    if draft_spec is not None and draft_spec.vocab_size != manifest.target.vocab_size:
        raise ContractError(f"draft vocab {draft_spec.vocab_size} differs from target vocab {manifest.target.vocab_size}")
    roles = ["target"] if draft_spec is None else ["target", "draft"]
    # ONNX Runtime builds a session without holding the GIL: both models and the tokenizer load at once
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdeploy-load") as pool:
        providers = {"target": provider, "draft": provider if draft_provider is None else draft_provider}
        engines = [pool.submit(_engine, directory, manifest, role, providers[role], threads) for role in roles]
        tokenizer, chat = _tokenizer(directory, manifest)  # a refused tokenizer is raised once the sessions end
        target, draft = [engine.result() for engine in engines] + [None] * (2 - len(engines))
    return manifest, tokenizer, chat, target, draft


def _engine(directory: Path, manifest: Manifest, role: str, provider: str | Provider, threads: int | None) -> Engine:
    """The engine of ``role``, once what its graph states of itself agrees with the manifest (heads, positions)."""
    engine = load_engine(directory, manifest, role, provider, threads)
    spec = manifest.models[role]
    check_graph_facts(directory / spec.file, spec)  # read with the external-data vetting: remembered, no second parse
    return engine


def _tokenizer(directory: Path, manifest: Manifest) -> tuple[object, ChatTemplate]:
    """The artifact's tokenizer, checked against its models, and its chat template."""
    path = directory / manifest.tokenizer
    tokenizer = read_tokenizer(path)
    # a function of the file's bytes alone, and dear for a large vocabulary: computed once per file identity
    facts = remembered_fact(path, "tokenizer_facts", lambda _: tokenizer_facts(tokenizer))
    problems = tokenizer_problems(tokenizer, manifest, facts)
    if problems:
        raise ContractError(f"{directory}: " + "; ".join(problems))
    return tokenizer, chat_template(directory, manifest, tokenizer)


def chat_template(directory: Path, manifest: Manifest, tokenizer) -> ChatTemplate:
    """The artifact's chat template and BOS settings, from tokenizer_config.json when the manifest lists it (none
    otherwise); ContractError where it cannot be read or names a BOS token the tokenizer lacks."""
    if TOKENIZER_CONFIG not in manifest.files:
        return ChatTemplate({})
    path = directory / TOKENIZER_CONFIG
    config = read_tokenizer_config(path)  # its size bound, fields and templates' syntax, as an export checked them
    check_bos(config, tokenizer, path, manifest.tokenizer)
    return ChatTemplate(config, source=str(path))
