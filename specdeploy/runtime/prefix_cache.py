"""K/V of earlier requests' texts, for later prompts that begin the same way (``PrefixCache``).

A conversation's next turn sends the whole conversation again, and chat templates start every prompt with the same
system text: the target (and the draft) already computed the K/V of that prefix for an earlier request. A finished
request's caches are kept here (its prompt and answer, as far as each model saw them); a new request of the same
scope whose prompt starts with a kept text takes those slots and prefills only the rest. Its text is the same
either way: a slot's K/V depends on the tokens up to it alone, whichever call computed it (up to the last bits of
floating point, as between chunked and whole prefills).

A hybrid model's recurrent states (``ModelSpec.states``) are kept beside its K/V. A positional state (a short
convolution's inputs, one a slot) is reused at any length, as K/V is. A ring keeps only the last positions' states,
so a text is resumed from it only where the text ended (a conversation's next turn, whose prompt holds the whole
earlier text): a prompt resumes the longest kept text it can, and where it matches only texts that ran on past it,
it reuses nothing and ``refused`` counts it under its reason. A ring model's text is therefore not dropped when a newer
one extends it: its end is a state the newer text does not hold (a turn asked again resumes where the turn before
it ended).

Texts are kept by scope name (``RowSettings.scope``, the names a ``SuffixStore`` uses; None: no reuse): a request
reuses only its own scope's texts, since how fast a prompt starts would say whether someone else's began the same way
(docs/serving.md). A name is all it holds of a scope, so the bound covers everything it keeps alive: in bytes, the
least recently used text first; a text that a newer one of its scope extends and can resume is dropped, and ``forget``
drops a scope's texts when its store lets the scope go (no later request could match them).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..engines.memory import settle

DEFAULT_BYTES = 1 << 30  # ~18,000 tokens of a 1.5B target's fp32 K/V (57 KB a token; docs/results/prefix_cache)
RING_PARTIAL = "a ring of recurrent states resumes a text only where it ended"  # ``refused``'s reason


@dataclass
class Slots:
    """What one model's cache held of a kept text's first ``seen`` tokens: K/V (a [kv_heads, seen, head_dim] array per
    cache tensor) and each recurrent state's slots ([layers, min(seen, slots), *shape] a state; ``ring``: whether any is
    a ring, which resumes the text at ``seen`` alone)."""

    seen: int
    kv: list[np.ndarray]
    states: list[np.ndarray] = field(default_factory=list)
    ring: bool = False

    def resumes(self, n: int) -> int:
        """The tokens a row can resume from of the first ``n`` matched: n, or 0 where a ring holds no state at n."""
        return n if not self.ring or n == self.seen else 0

    @property
    def bytes(self) -> int:
        return sum(a.nbytes for a in [*self.kv, *self.states])


@dataclass
class Kept:
    """One kept text: its scope, its tokens, and what each model's cache held of them (``Slots``; the draft's None
    where it saw none)."""

    scope: str
    tokens: np.ndarray
    target: Slots
    draft: Slots | None

    @property
    def bytes(self) -> int:
        return self.tokens.nbytes + self.target.bytes + (self.draft.bytes if self.draft else 0)


class PrefixCache:
    """Kept texts and their K/V, at most ``max_bytes`` together (0: nothing is kept). Thread-safe: a pipeline's
    generations may run on several threads."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[int, Kept] = OrderedDict()  # least recently used first
        self._ids = 0
        self._lock = threading.Lock()
        self.refused: Counter[str] = Counter()  # matches that reused nothing, by reason (RING_PARTIAL)

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, scope: str | None, tokens: np.ndarray, target_cache, row: int, draft_cache=None) -> None:
        """Keep row ``row`` of the caches (their ``past_len`` says how much each saw) with ``tokens`` [capacity]."""
        seen = int(target_cache.past_len[row])
        if scope is None or seen < 2 or self.max_bytes <= 0:
            return
        drafted = 0 if draft_cache is None else min(seen, int(draft_cache.past_len[row]))
        kept = Kept(scope, np.array(tokens[:seen], np.int64), _slots(target_cache, row, seen),
                    _slots(draft_cache, row, drafted) if drafted else None)
        if kept.bytes > self.max_bytes:
            return
        with self._lock:
            for key in [key for key, old in self._kept.items() if old.scope == scope and _starts(kept.tokens, old.tokens)
                        and kept.target.resumes(len(old.tokens))]:
                self._drop(key)  # the new text holds all of it (a ring's state at the old text's end it does not)
            self._ids += 1
            self._kept[self._ids] = kept
            self.bytes += kept.bytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._kept)))

    def reuse(self, scope: str | None, prompt: np.ndarray, target_cache, row: int, draft_cache=None) -> int:
        """Fill row ``row`` of the caches (which have seen nothing of it) with the K/V of the longest kept start of
        ``prompt`` in ``scope`` the target can resume from (``Slots.resumes``), all but the prompt's last token at most
        (a cycle starts from it); returns the tokens reused (0: none) and commits each cache's ``past_len`` of that
        row."""
        if scope is None or not self._kept:
            return 0
        with self._lock:
            best, matched, ran_on = None, 0, False
            for key, kept in self._kept.items():
                if kept.scope == scope:
                    n = _common(kept.tokens, prompt[: len(prompt) - 1])
                    ran_on |= n > 0 and not kept.target.resumes(n)
                    if kept.target.resumes(n) > matched:
                        best, matched = key, n
            if best is None:
                self.refused[RING_PARTIAL] += ran_on
                return 0
            kept = self._kept[best]
            self._kept.move_to_end(best)
        _fill(target_cache, row, kept.target, matched)
        if draft_cache is not None and kept.draft is not None:
            _fill(draft_cache, row, kept.draft, kept.draft.resumes(min(matched, kept.draft.seen)))
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
                    for slots in (kept.target, kept.draft) if slots for a in [*slots.kv, *slots.states]}

    def _drop(self, key: int) -> None:
        self.bytes -= self._kept.pop(key).bytes


def _slots(cache, row: int, n: int) -> Slots:
    """Copies of what ``row`` of ``cache`` holds of its first ``n`` tokens: K/V, one [kv_heads, n, head_dim] array per
    cache tensor (each a few MB, which the allocator serves from memory it has, where one copy of all would be mapped
    afresh page by page: a 1,024-token text took 130 ms so, 15 ms so: docs/results/prefix_cache), and each recurrent
    state's first min(n, slots) slots (a ring's every slot, once full)."""
    stacked = cache.stacked
    states = [group[:, row, : min(n, group.shape[2])].copy() for group in cache.states]
    ring = any(group.shape[2] != cache.capacity for group in cache.states)
    return Slots(n, [stacked[i, row, :, :n].copy() for i in range(stacked.shape[0])], states, ring)


def _fill(cache, row: int, slots: Slots, n: int) -> None:
    """Row ``row`` of ``cache`` takes the first ``n`` of ``slots`` (K/V and states) and has seen them."""
    for i, layer in enumerate(slots.kv):
        cache.stacked[i, row, :, :n] = layer[:, :n]
    for group, kept in zip(cache.states, slots.states):
        at = min(n, kept.shape[1])  # a positional state's first n slots; a ring's all (n is where its text ended)
        group[:, row, :at] = kept[:, :at]
        settle(group)
    settle(cache.stacked)
    cache.commit_row(row, n)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _starts(longer: np.ndarray, shorter: np.ndarray) -> bool:
    return len(shorter) <= len(longer) and _common(longer, shorter) == len(shorter)
