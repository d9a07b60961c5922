"""Suffix indexes by scope, and their file (``SuffixFile``).

A pipeline keeps one index of the requests it finished (scope ``"default"``); a server keeps one per API key by
default, since a draft never changes a text but its speed could tell one client whether another's answer held a
phrase (docs/serving.md). ``SuffixStore`` bounds each scope's index (tokens and sequences) and the number of scopes
(the least recently used scope goes first; what else a scope keeps, its texts' K/V, is told to go with it through
``on_evict``), and saves them all to one JSON file, written atomically (through a symlink, to the file it names). A
file is untrusted input when loaded: bounded in size, checked field by field, and refused in one line
(``SuffixFileError``) when it is corrupt, nested too deeply, too large or written for another tokenizer; a caller
starts empty then and leaves the file as it was. What is indexed of a file is what the bounds keep (each scope's latest
texts, the latest scopes), chosen before any is indexed: loading costs time and memory in proportion to the bounds,
whatever the file holds.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from ..files import FileMissing, FileRefused, read_regular
from ..values import is_integer, short
from .errors import ConfigError
from .suffix import SuffixIndex

FORMAT = "specdeploy.suffix-index"
VERSION = 1
# per scope: a few hundred chat turns, so that a full scope's index stays tens of MB (``bench_overhead --index``)
DEFAULT_TOKENS = 65_536
DEFAULT_SEQUENCES = 4096
DEFAULT_SCOPES = 16
BYTES_PER_TOKEN_IN_FILE = 8  # a token id in JSON: up to six digits, a comma and a space
# an index's worst case a token (``SuffixIndex.nbytes``: 236 bytes a token, and 170 for each of its 5 anchors when
# every one is new); the scopes' full indexes together may take half of the machine's memory at most
BYTES_PER_TOKEN_IN_MEMORY = 1_100
DEFAULT_SCOPE = "default"  # the scope of a pipeline's requests unless they name another
# a scope's index follows an earlier request's text after a match of 4 tokens or more (a request's own text, after 2):
# two tokens met again in another text say little of what follows (Spec-Bench qa at 32 tokens drafted 45 such tokens
# and kept 6), and replayed over every recorded workload and cost table the default's lowest group went 0.974x plain ->
# 0.996x at 0.2 % of the geometric mean (docs/results/replay_all)
MIN_MATCH = 4


def memory_bytes() -> int:
    """This machine's physical memory (16 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 16 * 2**30


def max_tokens_for(scopes: int) -> int:
    """The most tokens a scope's index may be bounded by, so that ``scopes`` full indexes fit in half of this
    machine's memory (``--suffix-tokens``' upper bound)."""
    return max(1, memory_bytes() // 2 // (scopes * BYTES_PER_TOKEN_IN_MEMORY))


class FromScope:
    """The default of ``Pipeline.start``'s ``suffix_index``: the index of the request's scope in the store (the default
    scope's where its scope is None)."""

    def __repr__(self) -> str:
        return "its scope's index"


FROM_SCOPE = FromScope()


class SuffixFileError(ValueError):
    """A suffix index file that cannot be used: the message names the file and what is wrong, in one line."""


class SuffixStore:
    """Suffix indexes by scope name, each bounded by ``max_tokens`` and ``max_sequences``, at most ``max_scopes``."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, max_sequences: int = DEFAULT_SEQUENCES,
                 max_scopes: int = DEFAULT_SCOPES):
        for name, value in (("max_tokens", max_tokens), ("max_sequences", max_sequences), ("max_scopes", max_scopes)):
            if not is_integer(value) or value < 1:
                raise ConfigError(f"suffix index {name}: got {short(value)}; expected an integer >= 1")
        most = max_tokens_for(max_scopes)
        if max_tokens > most:
            raise ConfigError(f"suffix index max_tokens: got {max_tokens:,}; expected at most {most:,} ({max_scopes} "
                              f"scopes of up to {BYTES_PER_TOKEN_IN_MEMORY:,} bytes a token in half of this machine's "
                              f"{memory_bytes() / 2**30:.1f} GiB)")
        self.max_tokens, self.max_sequences, self.max_scopes = max_tokens, max_sequences, max_scopes
        self._scopes: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._evicted: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def on_evict(self, forget: Callable[[str], None]) -> None:
        """Call ``forget(name)`` whenever scope ``name`` is evicted: what else keeps things for a scope (the prefix
        cache's K/V) lets them go with its index. ``off_evict`` stops it."""
        with self._lock:
            self._evicted.append(forget)

    def off_evict(self, forget: Callable[[str], None]) -> None:
        """Call ``forget`` no more (one that ``on_evict`` was given; its owner is closing): the store no longer holds it."""
        with self._lock:
            self._evicted = [f for f in self._evicted if f != forget]

    def index(self, name: str) -> SuffixIndex:
        """The index of scope ``name`` (made on first use; the least recently used scope evicted past the bound)."""
        evicted = []
        with self._lock:
            index = self._scopes.get(name)
            if index is None:
                index = self._scopes[name] = SuffixIndex(self.max_tokens, self.max_sequences, MIN_MATCH)
                while len(self._scopes) > self.max_scopes:
                    evicted.append(self._scopes.popitem(last=False)[0])
            self._scopes.move_to_end(name)
            listeners = list(self._evicted)
        for gone in evicted:  # outside the lock: a listener may take its own
            for forget in listeners:
                forget(gone)
        return index

    def stats(self) -> dict[str, int]:
        """Scopes holding a text, their sequences, tokens and estimated bytes, all together (the server's metrics)."""
        with self._lock:
            indexes = [index for index in self._scopes.values() if len(index)]  # scopes that hold a text
        return {"scopes": len(indexes), "sequences": sum(len(i) for i in indexes),
                "tokens": sum(i.tokens for i in indexes), "bytes": sum(i.nbytes() for i in indexes)}

    def save(self, path: Path, tokenizer: str, vocab_size: int) -> None:
        """Write every scope that holds a text to ``path`` atomically (a reader sees the old file or the new one).
        A symlink is written through: the file it names is replaced, and the link stays a link."""
        with self._lock:
            scopes = {name: index.sequences() for name, index in self._scopes.items() if len(index)}
        data = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size, "scopes": scopes}
        path = Path(os.path.realpath(path))  # renaming over a link would make it a file, its target never updated
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
            raise SuffixFileError(f"suffix index {path}: not JSON ({exc}); expected a file `--suffix-file` wrote") from None
        except RecursionError:  # the parser's depth is the interpreter's stack; a file we wrote is 4 levels deep
            raise SuffixFileError(f"suffix index {path}: nested too deeply to be a suffix index (it is 4 levels "
                                  "deep); expected a file `--suffix-file` wrote") from None
        scopes = _checked(data, path, tokenizer, vocab_size)
        for name, sequences in list(scopes.items())[-self.max_scopes :]:
            index = self.index(name)
            first = len(sequences) - len(kept := self._kept(sequences))
            for number, tokens in enumerate(kept, first):
                index.add(f"saved-{name}-{number}", tokens)  # drafted from "saved-...": a text of an earlier process
        return sum(len(s) for s in scopes.values())

    def _kept(self, sequences: list[list[int]]) -> list[list[int]]:
        """What an index of this store's bounds keeps of ``sequences`` added in order, found before indexing any: the
        latest that fit together, and none from before one that alone is over ``max_tokens`` (adding it evicted every
        earlier one, then itself)."""
        kept, tokens = [], 0
        for sequence in reversed(sequences):
            if len(kept) == self.max_sequences or tokens + len(sequence) > self.max_tokens:
                break
            kept.append(sequence)
            tokens += len(sequence)
        return kept[::-1]


class SuffixFile:
    """The file a store's indexes are kept in between processes (``--suffix-file``, ``Pipeline.load(suffix_file=)``),
    for one tokenizer (``tokenizer``: its fingerprint, ``vocab_size``): ``read`` at start, ``write`` at the end. A file
    refused when read is the user's (a larger index, another artifact's, a file named by mistake): it is left as it was
    and never written."""

    def __init__(self, store: SuffixStore, path: str | Path, tokenizer: str, vocab_size: int):
        self.store, self.path, self.tokenizer, self.vocab_size = store, Path(path), tokenizer, vocab_size
        self.refused = False

    def read(self, log: Callable[[str], None] | None = None) -> int:
        """Add the file's texts to the store (a missing file: none, created by ``write``); returns the sequences read.
        A refused file is told in one line to ``log`` (default: ``warnings.warn``) and leaves the store as it was."""
        try:
            return self.store.load(self.path, self.tokenizer, self.vocab_size)
        except SuffixFileError as exc:
            self.refused = True
            (log or (lambda message: warnings.warn(message, stacklevel=4)))(
                f"{exc}; starting with an empty index, which will not be saved ({self.path} is left as it is)")
            return 0

    def write(self) -> Path | None:
        """Write the store's indexes to the file, atomically; returns its path, or None where it was refused (nothing
        written)."""
        if self.refused:
            return None
        self.store.save(self.path, self.tokenizer, self.vocab_size)
        return self.path


def row_scopes(store: SuffixStore, indexes, scopes, rows: int) -> list[tuple[SuffixIndex | None, str | None]]:
    """``Pipeline.start``'s ``suffix_index`` and ``scope`` as (index, scope name) per row; ConfigError for anything
    else. The scope name is whose K/V a row reuses and keeps (None: none); the index is what it drafts from and adds
    its text to (``FROM_SCOPE``: its scope's index in ``store``, the default scope's where the name is None; None: the
    row's own text alone). Each is the caller's to give: an index never names a scope."""
    given = list(indexes) if isinstance(indexes, (list, tuple)) else [indexes] * rows
    if len(given) != rows or not all(i is FROM_SCOPE or i is None or isinstance(i, SuffixIndex) for i in given):
        raise ConfigError(f"suffix_index: got {short(indexes)}; expected a SuffixIndex, None for none, or one of "
                          f"either per prompt ({rows})")
    names = list(scopes) if isinstance(scopes, (list, tuple)) else [scopes] * rows
    if len(names) != rows or not all(n is None or (isinstance(n, str) and n) for n in names):
        raise ConfigError(f"scope: got {short(scopes)}; expected a scope name, None for no K/V reuse, or one of "
                          f"either per prompt ({rows})")
    rows_scopes = []
    for index, name in zip(given, names):
        if index is FROM_SCOPE:
            index = store.index(name if name is not None else DEFAULT_SCOPE)
        rows_scopes.append((index, name))
    return rows_scopes


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

