"""Opening an artifact dir: files checked against the manifest, tokenizer and models agreeing, engines loaded."""

from __future__ import annotations

from pathlib import Path

from ..contract import ContractError, Manifest, tokenizer_fingerprint, verify_files
from ..engines import Engine, load_engine
from .chat import ChatTemplate

TOKENIZER_CONFIG = "tokenizer_config.json"


def open_artifact(directory: Path, provider: str = "cpu", threads: int | None = None,
                  verify_hashes: bool = True) -> tuple[Manifest, object, ChatTemplate, Engine, Engine | None]:
    """The manifest, tokenizer, chat template, target engine and draft engine (None without a draft) of
    ``directory``. The chat template (and BOS handling) comes from tokenizer_config.json when the manifest
    lists it; otherwise there is none, and prompts get no BOS.

    Every file's sha256 is checked against the manifest before any byte reaches ONNX Runtime,
    unless ``verify_hashes=False``; both models must have been exported with the artifact's tokenizer
    and share a vocabulary.
    """
    from tokenizers import Tokenizer

    manifest = Manifest.read(directory)
    if verify_hashes:
        problems = verify_files(directory, manifest)
        if problems:
            raise ContractError(f"{directory}: artifact files do not match the manifest:\n  " + "\n  ".join(problems))
    try:
        tokenizer = Tokenizer.from_file(str(directory / manifest.tokenizer))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
        raise ContractError(f"{directory / manifest.tokenizer}: not a readable tokenizer ({exc})") from exc
    fingerprint = tokenizer_fingerprint(tokenizer)
    for spec in manifest.models.values():
        if spec.tokenizer_fingerprint != fingerprint:
            raise ContractError(
                f"{directory}: the {spec.role} model was exported with another tokenizer "
                f"(fingerprint {spec.tokenizer_fingerprint[:12]}…, artifact tokenizer {fingerprint[:12]}…)"
            )
    chat = ChatTemplate({})
    if TOKENIZER_CONFIG in manifest.files:
        try:
            chat = ChatTemplate.read(directory / TOKENIZER_CONFIG)
        except (OSError, ValueError, RecursionError, AttributeError) as exc:
            raise ContractError(f"{directory / TOKENIZER_CONFIG}: not a readable tokenizer config ({exc})") from exc
    words = tokenizer.get_vocab_size(with_added_tokens=True)
    if words > manifest.target.vocab_size:
        raise ContractError(f"{manifest.tokenizer}: {words} tokens, more than the models' vocabulary of "
                            f"{manifest.target.vocab_size}: ids it produces would be out of range")
    draft_spec = manifest.draft
    if draft_spec is not None and draft_spec.vocab_size != manifest.target.vocab_size:
        raise ContractError(f"draft vocab {draft_spec.vocab_size} differs from target vocab {manifest.target.vocab_size}")
    target = load_engine(directory, manifest, "target", provider, threads)
    draft = load_engine(directory, manifest, "draft", provider, threads) if draft_spec else None
    return manifest, tokenizer, chat, target, draft
