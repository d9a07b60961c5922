"""K/V of earlier requests' texts, for later prompts that begin the same way (``PrefixCache``).

A conversation's next turn sends the whole conversation again, and chat templates start every prompt with the same
system text: the target (and the draft) already computed the K/V of that prefix for an earlier request. A finished
request's caches are kept here (its prompt and answer, as far as each model saw them); a new request of the same
scope whose prompt starts with a kept text takes those slots and prefills only the rest. Its text is the same
either way: a slot's K/V depends on the tokens up to it alone, whichever call computed it (up to the last bits of
floating point, as between chunked and whole prefills).

Texts are kept by scope name (``RowSettings.scope``, the names a ``SuffixStore`` uses; None: no reuse): a request
reuses only its own scope's texts, since how fast a prompt starts would say whether someone else's began the same way
(docs/serving.md). A name is all it holds of a scope, so the bound covers everything it keeps alive: in bytes, the
least recently used text first; a text that a newer one of its scope extends is dropped, and ``forget`` drops a scope's
texts when its store lets the scope go (no later request could match them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..engines.memory import settle

DEFAULT_BYTES = 1 << 30  # ~18,000 tokens of a 1.5B target's fp32 K/V (57 KB a token; docs/results/prefix_cache)


@dataclass
class Kept:
    """One kept text: its scope, its tokens, and each model's K/V of the first ``seen`` of them (a [kv_heads, seen,
    head_dim] array per cache tensor; the draft's None where it saw none)."""

    scope: str
    tokens: np.ndarray
    target: list[np.ndarray]
    draft: list[np.ndarray] | None

    @property
    def bytes(self) -> int:
        return self.tokens.nbytes + sum(a.nbytes for a in [*self.target, *(self.draft or [])])


class PrefixCache:
    """Kept texts and their K/V, at most ``max_bytes`` together (0: nothing is kept). Thread-safe: a pipeline's
    generations may run on several threads."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[int, Kept] = OrderedDict()  # least recently used first
        self._ids = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, scope: str | None, tokens: np.ndarray, target_cache, row: int, draft_cache=None) -> None:
        """Keep row ``row`` of the caches (their ``past_len`` says how much each saw) with ``tokens`` [capacity]."""
        seen = int(target_cache.past_len[row])
        if scope is None or seen < 2 or self.max_bytes <= 0:
            return
        drafted = 0 if draft_cache is None else min(seen, int(draft_cache.past_len[row]))
        kept = Kept(scope, np.array(tokens[:seen], np.int64), _slots(target_cache.stacked, row, seen),
                    _slots(draft_cache.stacked, row, drafted) if drafted else None)
        if kept.bytes > self.max_bytes:
            return
        with self._lock:
            for key in [key for key, old in self._kept.items() if old.scope == scope and _starts(kept.tokens, old.tokens)]:
                self._drop(key)  # the new text holds all of it
            self._ids += 1
            self._kept[self._ids] = kept
            self.bytes += kept.bytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._kept)))

    def reuse(self, scope: str | None, prompt: np.ndarray, target_cache, row: int, draft_cache=None) -> int:
        """Fill row ``row`` of the caches (which have seen nothing of it) with the K/V of the longest kept start of
        ``prompt`` in ``scope``, all but the prompt's last token at most (a cycle starts from it); returns the tokens
        reused (0: none) and commits each cache's ``past_len`` of that row."""
        if scope is None or not self._kept:
            return 0
        with self._lock:
            best, matched = None, 0
            for key, kept in self._kept.items():
                if kept.scope == scope:
                    n = _common(kept.tokens, prompt[: len(prompt) - 1])
                    if n > matched:
                        best, matched = key, n
            if best is None:
                return 0
            kept = self._kept[best]
            self._kept.move_to_end(best)
        _fill(target_cache, row, kept.target, matched)
        if draft_cache is not None and kept.draft is not None:
            _fill(draft_cache, row, kept.draft, min(matched, kept.draft[0].shape[1]))
        return matched

    def forget(self, scope: str) -> None:
        """Drop every text kept for ``scope`` (its store evicted it: no later request of it could match them)."""
        with self._lock:
            for key in [key for key, kept in self._kept.items() if kept.scope == scope]:
                self._drop(key)

    def scopes(self) -> set[str]:
        """The scopes that have a text kept."""
        with self._lock:
            return {kept.scope for kept in self._kept.values()}

    def held_in(self) -> set[str]:
        """The array types the kept K/V is held in: "numpy.ndarray" (host memory), "cupy.ndarray" (a GPU's, where the
        engines compute: a reuse then copies nothing across PCIe)."""
        with self._lock:
            return {f"{type(a).__module__.split('.')[0]}.{type(a).__name__}" for kept in self._kept.values()
                    for a in [*kept.target, *(kept.draft or [])]}

    def _drop(self, key: int) -> None:
        self.bytes -= self._kept.pop(key).bytes


def _slots(stacked, row: int, n: int) -> list:
    """Copies of the first ``n`` slots of ``row``, one [kv_heads, n, head_dim] array per cache tensor: each a few MB,
    which the allocator serves from memory it has, where one copy of all would be mapped afresh page by page (a
    1,024-token text took 130 ms so, 15 ms so: docs/results/prefix_cache)."""
    return [stacked[i, row, :, :n].copy() for i in range(stacked.shape[0])]


def _fill(cache, row: int, slots: list, n: int) -> None:
    """Row ``row`` of ``cache`` takes the first ``n`` of ``slots`` and has seen them."""
    for i, layer in enumerate(slots):
        cache.stacked[i, row, :, :n] = layer[:, :n]
    settle(cache.stacked)
    cache.commit_row(row, n)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _starts(longer: np.ndarray, shorter: np.ndarray) -> bool:
    return len(shorter) <= len(longer) and _common(longer, shorter) == len(shorter)
