"""Prompts to token ids and back (``TextCodec``), and chat templates: messages rendered to a prompt as transformers'
``apply_chat_template`` renders them.

A prompt is text (tokenized, BOS first where the tokenizer config says so), token ids (checked against the vocabulary)
or a conversation (rendered by the chat template, then tokenized). A text is bounded before it is tokenized: past
``CHARS_PER_TOKEN_BOUND`` characters a slot of the capacity it is measured from its start, as tokenizing holds the
interpreter (a server's event loop included).

A template comes from the artifact's tokenizer_config.json (kept, and hashed, by the exporter) and is
untrusted code: it runs in Jinja's immutable sandbox, with the globals and filters transformers gives it
(``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML), so the same template
renders the same string here as there. It runs in a child process (``chat_worker``) with a time limit,
an output-size limit and a memory limit: a template that loops, computes or repeats without end is
stopped, and said to be the artifact's fault (``ChatTemplateError``), while messages the template
refuses (its ``raise_exception``) or that are malformed are the client's (``ConfigError``).

The time limit counts the CPU time the render consumes, not the wall time: on a busy machine a harmless
template waits for a core and is not blamed for it (the wall clock is only a backstop, ``WALL_FACTOR`` times
longer, for a worker that stops being scheduled at all). A template that fails on the client's ``tools``
(it renders the same messages without them) is the client's fault: malformed tool schemas are data the
template cannot be expected to take, while its failing on messages it was given is the artifact's.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..artifact_checks import DEFAULT_TEMPLATE, read_tokenizer_config, template_of, token_of
from ..contract import ContractError
from ..values import short
from .config import ConfigError, check_unicode, checked_token_ids

MAX_MESSAGES = 1024
TIME_LIMIT = 2.0  # CPU seconds a render may take: real templates take a millisecond or less
WALL_FACTOR, WALL_GRACE = 10.0, 5.0  # the wall-clock backstop: WALL_FACTOR x the CPU limit + WALL_GRACE seconds
MAX_RENDERED_CHARS = 16 * 2**20  # output characters; far beyond any prompt an artifact's capacity takes
WORKERS = 4  # child processes rendering at once; more requests wait for one
CHARS_PER_TOKEN_BOUND = 64  # beyond this many characters a token each, a text's start is measured first


class ChatTemplateError(RuntimeError):
    """The artifact's chat template failed on its own: it raised an error, recursed, or overran its time, output
    or memory limit. A fault of the artifact, not of the messages (a server answers 500, naming the template)."""


class TemplateTimeout(ChatTemplateError):
    """The chat template used more than its CPU-time limit (``seconds``), or its worker stopped answering."""

    def __init__(self, message: str, seconds: float):
        super().__init__(message)
        self.seconds = seconds


class ChatTemplate:
    """A tokenizer's chat template with its BOS/EOS tokens and whether plain prompts start with BOS.

    ``config`` is tokenizer_config.json's content, in any shape transformers accepts: ``chat_template`` a string,
    a list of ``{"name", "template"}`` or a mapping of names to templates (the one named "default" is used);
    ``bos_token``/``eos_token`` a string or a serialised AddedToken (``{"content": ...}``); ``add_bos_token``
    true or false (a string is refused: transformers would take "false" as true). ContractError names the field
    otherwise. ``source`` names the template in errors; ``time_limit`` and ``max_chars`` bound a render.
    """

    def __init__(self, config: dict, source: str = "chat template", time_limit: float = TIME_LIMIT,
                 max_chars: int = MAX_RENDERED_CHARS):
        if not isinstance(config, dict):
            raise ContractError(f"{source}: expected a JSON object, got {type(config).__name__}")
        self.source, self.time_limit, self.max_chars = source, time_limit, max_chars
        self.template, self.named = template_of(config.get("chat_template"), source)
        self.bos_token = token_of(config.get("bos_token"), "bos_token", source)
        self.eos_token = token_of(config.get("eos_token"), "eos_token", source)
        add_bos = config.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise ContractError(f"{source}: add_bos_token: got {short(add_bos)} ({type(add_bos).__name__}); expected true "
                                "or false")
        self.add_bos_token = add_bos

    @classmethod
    def read(cls, path: Path) -> ChatTemplate:
        """The chat template of a tokenizer_config.json (a regular file of at most MAX_JSON_BYTES, its fields checked and
        its templates compiled: ``artifact_checks.read_tokenizer_config``)."""
        return cls(read_tokenizer_config(Path(path)), source=f"{path}")

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               time_limit: float | None = None, max_chars: int | None = None) -> str:
        """The prompt text of ``messages`` ([{"role": ..., "content": ...}, ...]), ending with the assistant's
        turn opened when ``add_generation_prompt``; ``tools`` (JSON schemas, as transformers takes them) go to the
        template as its ``tools`` variable. ``time_limit`` (CPU seconds; a server's setting) replaces this template's
        own for one render, and ``max_chars`` (output characters: what the caller's context could ever hold) tightens
        its own.

        Raises ConfigError for messages that are malformed, too long for ``max_chars`` themselves, or that the
        template refuses (``raise_exception``), and for tools the template fails on; ChatTemplateError when the
        template fails on its own or overruns its limits (TemplateTimeout: its time)."""
        if self.template is None:
            if self.named:
                raise ChatTemplateError(f"{self.source}: has named chat templates ({', '.join(self.named)}) and none "
                                        f"named {DEFAULT_TEMPLATE!r}, which is the one used without tools")
            raise ConfigError("messages: this artifact's tokenizer has no chat template; give a plain prompt instead")
        seconds = self.time_limit if time_limit is None else time_limit
        chars = self.max_chars if max_chars is None else min(max_chars, self.max_chars)
        messages = _checked(messages)
        _check_size(messages, tools, chars)
        answer = self._answer(messages, add_generation_prompt, tools, seconds, chars)
        if "error" in answer and tools and "refused" not in answer:
            plain = self._answer(messages, add_generation_prompt, None, seconds, chars)
            if "text" in plain:  # the same conversation renders without the client's tools: they are the cause
                raise ConfigError(f"tools: the chat template fails on them ({answer['error']}: {answer['message']}); "
                                  "expected OpenAI function tools: {'type': 'function', 'function': {'name': str, "
                                  "'description': str, 'parameters': a JSON schema object}}")
        return self._text(answer, seconds)

    def _answer(self, messages: list[dict], add_generation_prompt: bool, tools, seconds: float, chars: int) -> dict:
        variables = {"messages": messages, "add_generation_prompt": bool(add_generation_prompt), "tools": tools,
                     "documents": None, "bos_token": self.bos_token, "eos_token": self.eos_token}
        return renderer().render(self.template, variables, seconds, chars, self.source)

    def _text(self, answer: dict, seconds: float) -> str:
        """The rendered text of the worker's ``answer``, or the error it says."""
        if "refused" in answer:
            raise ConfigError(f"chat template: {answer['refused']}")
        if answer.get("error") == "TimeLimit":
            raise TemplateTimeout(f"{self.source}: the chat template took longer than {seconds:g} s of CPU time; "
                                  "rendering was stopped", seconds)
        if answer.get("error") == "SecurityError":
            raise ChatTemplateError(f"{self.source}: the chat template was refused by the sandbox ({answer['message']})")
        if "error" in answer:
            raise ChatTemplateError(f"{self.source}: the chat template failed on its own ({answer['error']}: "
                                    f"{answer['message']})")
        try:
            check_unicode(answer["text"], "rendered")
        except ConfigError as exc:  # a surrogate the messages did not bring: the template's own text has it
            raise ChatTemplateError(f"{self.source}: the chat template's output is not valid Unicode ({exc})") from exc
        return answer["text"]


class TextCodec:
    """An artifact's tokenizer and chat template: a prompt (text or ids) or a conversation to token ids inside the
    vocabulary (``vocab_size``), and ids back to text. Prompts longer than ``capacity`` slots could ever hold are refused
    from their start. Plain prompts start with BOS exactly when the tokenizer config says so (transformers'
    ``add_bos_token``)."""

    def __init__(self, tokenizer, template: ChatTemplate, vocab_size: int, capacity: int):
        self.tokenizer, self.template, self.vocab_size, self.capacity = tokenizer, template, vocab_size, capacity
        bos = template.bos_token
        self.bos = tokenizer.token_to_id(bos) if template.add_bos_token and bos else None

    def encode(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Token ids of a prompt: text, or a flat sequence of integer ids inside the vocabulary. Returns [tokens] int64.

        Text must be valid Unicode (a lone surrogate is refused, naming where), and every id it encodes to must
        be inside the model's vocabulary: a tokenizer that maps a word beyond it is refused here, before any engine
        call, rather than failing the batch the prompt joins."""
        vocab = self.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt: got an empty string; expected at least one token")
            check_unicode(prompt, "prompt")
            ids = self._tokenize(prompt)
            if self.bos is not None and ids[:1] != [self.bos]:
                ids = [self.bos, *ids]
            ids = np.array(ids, np.int64)
            if ids.size and ids.max() >= vocab:
                outside = int(ids[ids >= vocab][0])
                raise ConfigError(f"prompt: encodes to token id {outside} ({short(self.tokenizer.id_to_token(outside))}), "
                                  f"outside the model's vocabulary [0, {vocab}): the artifact's tokenizer does not fit its "
                                  "models")
        elif isinstance(prompt, bytes) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise ConfigError(f"prompt: got {short(prompt)}; expected a string or a list of token ids")
        else:
            ids = checked_token_ids(prompt, vocab, "prompt ids")
        if ids.size == 0:
            raise ConfigError("prompt: encodes to no tokens; expected at least one")
        return ids

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    time_limit: float | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template, as transformers'
        ``apply_chat_template(messages, tools=tools, tokenize=True)`` gives them (the template places BOS itself).
        ``time_limit``: CPU seconds the render may take (the template's own limit when None). The rendered text is
        bounded by what the capacity could ever hold (``CHARS_PER_TOKEN_BOUND`` a slot), before it is tokenized."""
        text = self.template.render(messages, add_generation_prompt, tools, time_limit=time_limit,
                                    max_chars=CHARS_PER_TOKEN_BOUND * self.capacity)
        return self._tokenize(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (integers inside the vocabulary; ConfigError otherwise), special tokens skipped."""
        ids = checked_token_ids(token_ids, self.vocab_size, "token_ids")
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def _tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; a text longer than ``CHARS_PER_TOKEN_BOUND`` characters a slot of the capacity is
        refused having tokenized no more than that much of it (a 12 MB prompt, or one enormous word, costs no more than
        its first part)."""
        capacity = self.capacity
        head = CHARS_PER_TOKEN_BOUND * capacity
        if len(text) > head:
            tokens = len(self.tokenizer.encode(text[:head], add_special_tokens=False).ids)
            if tokens >= capacity:
                raise ConfigError(f"prompt: {len(text):,} characters, and its first {head:,} alone are {tokens:,} "
                                  f"tokens, over the artifact's capacity of {capacity} tokens")
            raise ConfigError(f"prompt: {len(text):,} characters; expected at most {head:,} ({CHARS_PER_TOKEN_BOUND} "
                              f"a token of the artifact's capacity of {capacity}: no text that fits is longer)")
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _check_size(messages: list[dict], tools, chars: int) -> None:
    """Refuse a conversation whose own text (its strings, and the tools as JSON) is already more than a render may
    produce: the client's doing, found before any template runs."""
    size = sum(len(value) for message in messages for value in message.values() if isinstance(value, str))
    if tools:
        try:
            size += len(json.dumps(tools))
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"tools: not JSON data ({exc})") from exc
    if size > chars:
        raise ConfigError(f"messages: {size:,} characters{' with the tools' if tools else ''}, more than the {chars:,} "
                          "that a prompt of this model's context can hold; shorten them")


def _checked(messages) -> list[dict]:
    """The client's messages, as JSON data the child can take; ConfigError naming what is wrong."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ConfigError(f"messages: got {type(messages).__name__}; expected a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        raise ConfigError(f"messages: got {len(messages)}; expected at most {MAX_MESSAGES}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ConfigError(f"messages[{i}]: got {short(message)}; expected {{'role': str, 'content': str}}")
        for key, value in message.items():
            if isinstance(value, str):
                check_unicode(value, f"messages[{i}].{key}")
    try:
        json.dumps(messages)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"messages: not JSON data ({exc}); expected strings, numbers, lists and objects") from exc
    return [dict(message) for message in messages]


class TemplateRenderer:
    """Child processes (``chat_worker``) rendering templates, at most ``workers`` at once. A worker serves one
    request at a time and is reused; one that overruns its request's time is killed (the next request starts a
    fresh one: ~0.1 s). Thread-safe."""

    def __init__(self, workers: int = WORKERS):
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def render(self, template: str, variables: dict, seconds: float, max_chars: int, source: str) -> dict:
        """The worker's answer to one request: {"text"}, {"refused"} or {"error", "message"} ("TimeLimit" past ``seconds``
        of CPU time); TemplateTimeout where the worker did not answer within the wall-clock backstop, ChatTemplateError
        where it died (out of memory, say). Time waiting for a free worker is not counted."""
        wall = seconds * WALL_FACTOR + WALL_GRACE
        request = json.dumps({"template": template, "variables": variables, "max_chars": max_chars, "seconds": seconds,
                              "wall_seconds": wall})
        with self._slots:
            worker = self._sent(request.encode() + b"\n")
            try:
                line = _read_line(worker.stdout, time.monotonic() + wall)
            except BaseException:
                _stop(worker)
                raise
            if line is None:
                _stop(worker)
                code = worker.returncode
                if code in (None, -9, -14):  # killed here, or by its own alarm: it stopped answering
                    raise TemplateTimeout(f"{source}: the chat template took longer than {wall:g} s of wall time (its "
                                          f"limit is {seconds:g} s of CPU time); rendering was stopped", seconds)
                raise ChatTemplateError(f"{source}: the chat template ended its process (exit code {code}); rendering "
                                        "was stopped")
            with self._lock:
                self._idle.append(worker)
        return json.loads(line)

    def _sent(self, request: bytes) -> subprocess.Popen:
        """A worker that has been sent ``request``: an idle one, or a fresh one if it has gone meanwhile."""
        for attempt in (1, 2):
            worker = self._take()
            try:
                worker.stdin.write(request)
                worker.stdin.flush()
                return worker
            except OSError as exc:  # it ended while idle (killed from outside): once more, with a fresh one
                _stop(worker)
                if attempt == 2:
                    raise ChatTemplateError(f"the process rendering chat templates ended ({exc})") from exc
        raise AssertionError("unreachable")

    def _take(self) -> subprocess.Popen:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.poll() is None:
                    return worker
        try:
            return subprocess.Popen([sys.executable, str(Path(__file__).with_name("chat_worker.py"))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as exc:
            raise ChatTemplateError(f"cannot start a process to render chat templates ({exc})") from exc

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            _stop(worker)


def _read_line(stream, deadline: float) -> bytes | None:
    """One line from a worker's stdout, or None if it has not come by ``deadline`` (monotonic) or the worker ended.
    ``poll``, not ``select``: a server may hold more than 1,024 descriptors."""
    descriptor, chunks = stream.fileno(), []
    waiting = select.poll()
    waiting.register(descriptor, select.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not waiting.poll(remaining * 1000):
            return None
        chunk = os.read(descriptor, 1 << 20)
        if not chunk:
            return None
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def _stop(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
    for stream in (worker.stdin, worker.stdout):
        stream.close()


_renderer: TemplateRenderer | None = None
_renderer_lock = threading.Lock()


def renderer() -> TemplateRenderer:
    """The process's renderer, made on first use; its workers are stopped at exit."""
    global _renderer
    with _renderer_lock:
        if _renderer is None:
            _renderer = TemplateRenderer()
            atexit.register(_renderer.close)
        return _renderer
