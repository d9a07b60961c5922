"""Shared suffix indexes by scope, and their file.

A pipeline keeps one index of the requests it finished (scope ``"shared"``); a server keeps one per API key by
default, since a draft never changes a text but its speed could tell one client whether another's answer held a
phrase (docs/serving.md). ``SuffixStore`` bounds each scope's index (tokens and sequences) and the number of scopes
(the least recently used scope goes first), and saves them all to one JSON file, written atomically. A file is
untrusted input when loaded: bounded in size, checked field by field, and refused in one line (``SuffixFileError``)
when it is corrupt, too large or written for another tokenizer; a caller starts empty then.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

from ..files import FileMissing, FileRefused, read_regular
from .errors import ConfigError
from .shorten import short
from .suffix import SuffixIndex

FORMAT = "specdeploy.suffix-index"
VERSION = 1
# per scope: a few hundred chat turns, so that a full scope's index stays tens of MB (``bench_overhead --index``)
DEFAULT_TOKENS = 65_536
DEFAULT_SEQUENCES = 4096
DEFAULT_SCOPES = 16
BYTES_PER_TOKEN_IN_FILE = 8  # a token id in JSON: up to six digits, a comma and a space
SHARED_SCOPE = "shared"  # a pipeline's own index, in its store


class Shared:
    """The default of ``Pipeline.start``'s ``suffix_index``: the pipeline's shared index (None means none)."""

    def __repr__(self) -> str:
        return "the pipeline's shared index"


SHARED = Shared()


class SuffixFileError(ValueError):
    """A suffix index file that cannot be used: the message names the file and what is wrong, in one line."""


class SuffixStore:
    """Suffix indexes by scope name, each bounded by ``max_tokens`` and ``max_sequences``, at most ``max_scopes``."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, max_sequences: int = DEFAULT_SEQUENCES,
                 max_scopes: int = DEFAULT_SCOPES):
        for name, value in (("max_tokens", max_tokens), ("max_sequences", max_sequences), ("max_scopes", max_scopes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"suffix index {name}: got {value!r}; expected an integer >= 1")
        self.max_tokens, self.max_sequences, self.max_scopes = max_tokens, max_sequences, max_scopes
        self._scopes: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._lock = threading.Lock()

    def scope(self, name: str) -> SuffixIndex:
        """The index of scope ``name`` (made on first use; the least recently used scope evicted past the bound)."""
        with self._lock:
            index = self._scopes.get(name)
            if index is None:
                index = self._scopes[name] = SuffixIndex(self.max_tokens, self.max_sequences)
                while len(self._scopes) > self.max_scopes:
                    self._scopes.popitem(last=False)
            self._scopes.move_to_end(name)
            return index

    def stats(self) -> dict[str, int]:
        """Scopes holding a text, their sequences, tokens and estimated bytes, all together (the server's metrics)."""
        with self._lock:
            indexes = [index for index in self._scopes.values() if len(index)]  # scopes that hold a text
        return {"scopes": len(indexes), "sequences": sum(len(i) for i in indexes),
                "tokens": sum(i.tokens for i in indexes), "bytes": sum(i.nbytes() for i in indexes)}

    def save(self, path: Path, tokenizer: str, vocab_size: int) -> None:
        """Write every scope that holds a text to ``path`` atomically (a reader sees the old file or the new one)."""
        with self._lock:
            scopes = {name: index.sequences() for name, index in self._scopes.items() if len(index)}
        data = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size, "scopes": scopes}
        path = Path(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            partial.write_text(json.dumps(data, separators=(",", ":")))
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)

    def load(self, path: Path, tokenizer: str, vocab_size: int) -> int:
        """Add the sequences ``save`` wrote to ``path`` (for this tokenizer) to their scopes; returns how many.
        A missing file is an empty store (0). SuffixFileError, in one line, for anything else that is wrong."""
        path = Path(path)
        limit = BYTES_PER_TOKEN_IN_FILE * self.max_tokens * self.max_scopes + 2**20
        try:
            raw = read_regular(path, limit)
        except FileMissing:
            return 0
        except FileRefused as exc:
            raise SuffixFileError(f"suffix index {exc}") from None
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SuffixFileError(f"suffix index {path}: not JSON ({exc}); expected a file `--suffix-cache` wrote") from None
        scopes = _checked(data, path, tokenizer, vocab_size)
        for name, sequences in list(scopes.items())[-self.max_scopes :]:
            index = self.scope(name)
            for number, tokens in enumerate(sequences):
                index.add(f"saved-{name}-{number}", tokens)  # drafted from "saved-...": a text of an earlier process
        return sum(len(s) for s in scopes.values())


def row_indexes(given, rows: int) -> list[SuffixIndex | None]:
    """``Pipeline.start``'s ``suffix_index`` as one index (or None) per row; ConfigError for anything else."""
    indexes = list(given) if isinstance(given, (list, tuple)) else [given] * rows
    if len(indexes) != rows or not all(index is None or isinstance(index, SuffixIndex) for index in indexes):
        raise ConfigError(f"suffix_index: got {short(given)}; expected a SuffixIndex, None for none, or one of "
                          f"either per prompt ({rows})")
    return indexes


def _checked(data, path: Path, tokenizer: str, vocab_size: int) -> dict[str, list[list[int]]]:
    """The scopes of a loaded file, each field checked; SuffixFileError naming the first that is wrong."""
    def refuse(what: str) -> SuffixFileError:
        return SuffixFileError(f"suffix index {path}: {what}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise refuse(f"not a suffix index (format {short(data.get('format') if isinstance(data, dict) else data)}; "
                     f"expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise refuse(f"version {short(data.get('version'))}; expected {VERSION}")
    if data.get("tokenizer") != tokenizer or data.get("vocab_size") != vocab_size:
        raise refuse("written for another tokenizer (its fingerprint or vocabulary differs from this artifact's)")
    scopes = data.get("scopes")
    if not isinstance(scopes, dict):
        raise refuse(f"scopes: got {type(scopes).__name__}; expected an object of scope -> sequences")
    for name, sequences in scopes.items():
        if not isinstance(sequences, list):
            raise refuse(f"scope {short(name)}: got {type(sequences).__name__}; expected a list of sequences")
        for sequence in sequences:
            if not isinstance(sequence, list) or not all(type(t) is int and 0 <= t < vocab_size for t in sequence):
                raise refuse(f"scope {short(name)}: a sequence that is not a list of token ids in [0, {vocab_size})")
    return scopes

