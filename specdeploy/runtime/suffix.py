"""A suffix index: drafts that cost no model call, from text seen before (SuffixDecoding, arXiv 2411.04975).

An index keeps token sequences (a request's prompt and committed tokens; the prompts and answers of requests that
finished) and, for every position p of each, the hash of the n tokens before p at a few lengths n (``LEVELS``).
A proposal matches the context's last tokens at the longest of those lengths that occurred before, then follows
the continuation most of the matched occurrences share, token by token, keeping the occurrences that agree. Each
drafted token carries an estimate of its probability from those counts, shrunk where few occurrences and a short
match back it (``estimate``); the proposal stops where the running product falls below a floor or at the cap. The
cost policy turns the estimates into a draft length (``CostPolicy.free_drafts``), learning how often the target
keeps a draft of each estimate.

Memory and time are linear in the tokens kept: one int per token, and one anchor a level. A shared index is
bounded in tokens and sequences, the least recently used (added, or drafted from) evicted first; it is safe to
share between threads. A hash collision can only make a draft wrong, never the text: the target verifies it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

LEVELS = (32, 16, 8, 4, 2)  # context lengths matched, longest first: a longer match is a surer continuation
MAX_OCCURRENCES = 32  # per anchor, the latest kept: a common pair ("):\n") need not be followed a thousand times
MIN_ESTIMATE = 0.05  # a proposal stops where its running estimate falls below this (the policy trims further)
_SHIFT = 32  # an occurrence is one int: sequence number << _SHIFT | position
_POSITION = (1 << _SHIFT) - 1


def estimate(agree: int, occurrences: int, matched: int) -> float:
    """P(next draft right | the earlier ones were): the share of ``occurrences`` of the matched context that
    continue alike, shrunk by a pseudo-count of 2 / ``matched``: one occurrence after a 2-token match says 0.5,
    after a 32-token match 0.94 (a copied stretch)."""
    return agree / (occurrences + 2.0 / matched)


class SuffixIndex:
    """Token sequences by key, with their anchors. ``max_tokens`` / ``max_sequences`` bound it (None: unbounded,
    for one request's own text); ``min_match``: the shortest context matched (``LEVELS`` below it are neither matched
    nor indexed: a scope's index of earlier requests matches at ``suffix_store.MIN_MATCH``); ``extend`` appends to a
    sequence, ``add`` replaces one."""

    def __init__(self, max_tokens: int | None = None, max_sequences: int | None = None, min_match: int = 2):
        if type(min_match) is not int or min_match < 1:
            raise ValueError(f"min_match: got {min_match!r}; expected a positive integer")
        self.max_tokens, self.max_sequences, self.min_match = max_tokens, max_sequences, min_match
        self._levels = tuple(n for n in LEVELS if n >= min_match)  # the context lengths this index anchors
        self._sequences: OrderedDict[Hashable, tuple[int, list[int]]] = OrderedDict()  # key -> (number, tokens), LRU first
        self._by_number: dict[int, Hashable] = {}
        self._anchors: tuple[dict[int, list[int]], ...] = tuple({} for _ in self._levels)
        self._numbers = 0
        self.tokens = 0  # kept, all sequences together
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sequences

    def nbytes(self) -> int:
        """What the index holds, estimated from CPython's sizes: per token its id and an occurrence a level, per
        distinct anchor a dict entry and a list (within 20 % of tracemalloc's count, on text and on random ids)."""
        anchors = sum(len(level) for level in self._anchors)
        return self.tokens * (36 + 40 * len(self._levels)) + anchors * 170

    def sequences(self) -> list[list[int]]:
        """The sequences kept, least recently used first (what ``persist`` writes)."""
        with self._lock:
            return [list(tokens) for _, tokens in self._sequences.values()]

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Keep ``tokens`` as sequence ``key`` (replacing one of that key), most recently used; evict past the bounds."""
        with self._lock:
            if key in self._sequences:
                self._drop(key)
            self._extend(key, list(tokens))
            self._evict()

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (a new one if absent)."""
        with self._lock:
            self._extend(key, tokens)
            self._evict()

    def length(self, key: Hashable) -> int:
        entry = self._sequences.get(key)
        return len(entry[1]) if entry else 0

    def _extend(self, key: Hashable, new: Sequence[int]) -> None:
        if key not in self._sequences:
            self._sequences[key] = (self._numbers, [])
            self._by_number[self._numbers] = key
            self._numbers += 1
        number, tokens = self._sequences[key]
        base = number << _SHIFT
        for token in new:
            tokens.append(int(token))
            end = len(tokens)  # the anchor ending here points at the continuation's start
            for level, n in zip(self._anchors, self._levels):
                if end >= n:
                    occurrences = level.setdefault(hash(tuple(tokens[end - n :])), [])
                    occurrences.append(base | end)
                    if len(occurrences) > MAX_OCCURRENCES:
                        del occurrences[0]
        self.tokens += len(new)

    def _drop(self, key: Hashable) -> None:
        number, tokens = self._sequences.pop(key)
        del self._by_number[number]
        base = number << _SHIFT
        for end in range(1, len(tokens) + 1):
            for level, n in zip(self._anchors, self._levels):
                if end >= n:
                    anchor = hash(tuple(tokens[end - n : end]))
                    occurrences = level.get(anchor)
                    if occurrences and (base | end) in occurrences:
                        occurrences.remove(base | end)
                        if not occurrences:
                            del level[anchor]
        self.tokens -= len(tokens)

    def _evict(self) -> None:
        while self._sequences and ((self.max_tokens is not None and self.tokens > self.max_tokens) or
                                   (self.max_sequences is not None and len(self._sequences) > self.max_sequences)):
            self._drop(next(iter(self._sequences)))

    def _matches(self, context: list[int]) -> tuple[int, list[tuple[list[int], int, Hashable]]]:
        """The longest level whose last-n-token anchor occurred, and its occurrences (tokens, continuation start,
        key), latest first; (0, []) if none."""
        for level, n in zip(self._anchors, self._levels):
            if len(context) >= n:
                occurrences = level.get(hash(tuple(context[-n:])))
                found = []
                for packed in reversed(occurrences or ()):
                    key = self._by_number[packed >> _SHIFT]
                    tokens, at = self._sequences[key][1], packed & _POSITION
                    if at < len(tokens):  # the context's own end has nothing after it yet
                        found.append((tokens, at, key))
                if found:
                    return n, found
        return 0, []

    def touch(self, key: Hashable) -> None:
        """Sequence ``key`` was drafted from: the last to be evicted."""
        with self._lock:
            if key in self._sequences:
                self._sequences.move_to_end(key)


def propose(indexes: Sequence[SuffixIndex], context: list[int], most: int,
            floor: float = MIN_ESTIMATE) -> tuple[list[int], list[float], Hashable | None]:
    """Up to ``most`` drafts after ``context`` (its last ``LEVELS[0]`` tokens suffice) from ``indexes`` together:
    (drafts, each one's estimate, the key of the sequence the first draft followed, or None). The longest match in
    any index wins; at equal lengths their occurrences count together."""
    if most <= 0:
        return [], [], None
    matched, candidates = 0, []
    for index in indexes:
        with index._lock:
            n, found = index._matches(context)
        if n > matched:
            matched, candidates = n, found
        elif n == matched and n:
            candidates += found
    drafts: list[int] = []
    estimates: list[float] = []
    origin, running = None, 1.0
    active = candidates
    while active and len(drafts) < most:
        counts: dict[int, int] = {}
        for tokens, at, _ in active:
            counts[tokens[at]] = counts.get(tokens[at], 0) + 1
        token = max(counts, key=counts.__getitem__)  # the first seen (the latest occurrence) on a tie
        share = estimate(counts[token], len(active), matched + len(drafts))
        running *= share
        if running < floor:
            break
        if origin is None:
            origin = next(key for tokens, at, key in active if tokens[at] == token)
        drafts.append(token)
        estimates.append(share)
        active = [(tokens, at + 1, key) for tokens, at, key in active if tokens[at] == token and at + 1 < len(tokens)]
    return drafts, estimates, origin
