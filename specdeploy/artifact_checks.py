"""What opening an artifact checks before any session is made, in one place for the runtime's loader, ``doctor``, and
the export and import that write artifacts: an export or an import ends only with an artifact these checks accept,
and one they refuse is never put in place (``output.staged`` removes its staging dir).

The manifest (``Manifest.read``: fields, sizes, names), the tokenizer (a readable file within its size bound, made
for these models, its ids inside their vocabulary), both models sharing one vocabulary, and ``tokenizer_config.json``
where the manifest lists it: within MAX_JSON_BYTES, a JSON object whose chat template is a string or named templates,
whose BOS/EOS tokens are strings, ``add_bos_token`` true or false, every template compiling, and a BOS token the
tokenizer has. A package leaf beside the contract (no runtime, no engine, no exporter): the exporter and the importer
may not load the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

from .contract import ContractError, Manifest, read_tokenizer, tokenizer_problems
from .files import MAX_JSON_BYTES, FileRefused, read_regular
from .values import short

TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_TEMPLATE = "default"  # the template used among named ones, as transformers chooses it without tools


def check_artifact(directory: Path) -> Manifest:
    """The manifest of the artifact at ``directory`` once the checks above pass (its files' hashes are not checked
    here: the loader checks them, and a writer has just computed them); ContractError, one line, naming the file."""
    directory = Path(directory)
    manifest = Manifest.read(directory)
    draft = manifest.draft
    if draft is not None and draft.vocab_size != manifest.target.vocab_size:
        raise ContractError(f"draft vocab {draft.vocab_size} differs from target vocab {manifest.target.vocab_size}")
    tokenizer = read_tokenizer(directory / manifest.tokenizer, manifest.tokenizer)
    problems = tokenizer_problems(tokenizer, manifest)
    if problems:
        raise ContractError(f"{directory}: {problems[0]}")
    if TOKENIZER_CONFIG in manifest.files:
        check_bos(read_tokenizer_config(directory / TOKENIZER_CONFIG), tokenizer, directory / TOKENIZER_CONFIG,
                  manifest.tokenizer)
    return manifest


def read_tokenizer_config(path: Path) -> dict:
    """A tokenizer_config.json (a regular file of at most MAX_JSON_BYTES) as a dict whose chat template, tokens and
    ``add_bos_token`` pass ``check_tokenizer_config``; ContractError naming the file otherwise."""
    try:
        data = json.loads(read_regular(Path(path), MAX_JSON_BYTES).decode("utf-8"))
    except FileRefused as exc:
        raise ContractError(str(exc)) from exc
    except RecursionError as exc:
        raise ContractError(f"{path}: nested too deeply to be a tokenizer config") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ContractError(f"{path}: not a readable tokenizer config ({type(exc).__name__}: {short(str(exc), 200)})"
                            ) from exc
    check_tokenizer_config(data, str(path))
    return data


def check_tokenizer_config(config, source: str) -> None:
    """Refuse (ContractError naming ``source``) a tokenizer config the chat template reader would refuse, or whose
    templates do not compile."""
    if not isinstance(config, dict):
        raise ContractError(f"{source}: expected a JSON object, got {type(config).__name__}")
    template, named = template_of(config.get("chat_template"), source)
    token_of(config.get("bos_token"), "bos_token", source)
    token_of(config.get("eos_token"), "eos_token", source)
    add_bos = config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):  # transformers would take "false" as true
        raise ContractError(f"{source}: add_bos_token: got {short(add_bos)} ({type(add_bos).__name__}); expected true "
                            "or false")
    value = config.get("chat_template")
    templates = {t["name"]: t["template"] for t in value} if isinstance(value, list) else (
        value if isinstance(value, dict) else {"": template} if template is not None else {})
    for name, text in templates.items():
        compile_template(text, f"{source}: chat_template" + (f" {name!r}" if name else ""))


def compile_template(text: str, where: str) -> None:
    """Refuse a chat template that does not compile (parsed, never run): one line with the reason and line."""
    from jinja2 import TemplateSyntaxError

    from .chat_syntax import parse

    try:
        parse(text)
    except TemplateSyntaxError as exc:
        raise ContractError(f"{where}: does not compile ({short(exc.message or str(exc), 200, quoted=False)}, line "
                            f"{exc.lineno})") from exc
    except (RecursionError, MemoryError) as exc:  # Jinja's parser recurses once per nested block
        raise ContractError(f"{where}: nested too deeply to compile ({type(exc).__name__})") from exc


def check_bos(config: dict, tokenizer, source: Path, tokenizer_name: str) -> None:
    """Refuse a config that starts plain prompts with a BOS token the tokenizer does not have."""
    bos = token_of(config.get("bos_token"), "bos_token", str(source))
    if config.get("add_bos_token") and bos is not None and tokenizer.token_to_id(bos) is None:
        raise ContractError(f"{source}: bos_token {bos!r} is not a token of {tokenizer_name}; expected one of its "
                            "tokens (add_bos_token starts plain prompts with it)")


def template_of(value, source: str) -> tuple[str | None, list[str]]:
    """(the template to use, the names of all when there are several) of a tokenizer config's ``chat_template``: a
    string, a list of ``{"name", "template"}`` or a mapping of names to templates (the one named "default" is used)."""
    if value is None or isinstance(value, str):
        return value, []
    if isinstance(value, list):  # transformers saves several as [{"name": ..., "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise ContractError(f"{source}: chat_template: expected a string or a list of {{'name': str, 'template': "
                                f"str}}, got {short(value, 80)}")
        value = {t["name"]: t["template"] for t in value}
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value.get(DEFAULT_TEMPLATE), sorted(value)
    raise ContractError(f"{source}: chat_template: expected a string or a list of named templates, got "
                        f"{type(value).__name__}")


def token_of(value, name: str, source: str) -> str | None:
    """A tokenizer config's BOS or EOS token: a string, or a serialised AddedToken's ``{"content": ...}``."""
    if isinstance(value, dict):  # a serialised AddedToken: {"content": ..., "__type": "AddedToken", ...}
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ContractError(f"{source}: {name}: expected a string or an AddedToken's {{'content': str}}, got "
                            f"{type(value).__name__}")
    return value
