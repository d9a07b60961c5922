"""Stop strings: where a request's text must end, found on tokens as they are committed.

Both searches cost time in proportion to the new text, never to all the text so far: ``StopStrings.check``
decodes only the last tokens that can hold the start of a stop string, and ``StopScanner`` (what a stream
may show) follows each stop string with a Knuth-Morris-Pratt automaton fed the new characters alone. A
request's stop strings are bounded (``config.MAX_STOP_STRINGS`` of ``MAX_STOP_CHARS``), so a cycle's matching
costs at most a few hundred characters' work.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

CONTEXT_SLACK = 4  # tokens decoded beyond what the stop strings need: a window may start inside a character


class StopStrings:
    """The stop strings of a request, over a tokenizer's ``decode`` (token ids -> text)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str] | None):
        self.stops, self.decode = tuple(stops), decode
        self.longest = max(map(len, self.stops), default=0)

    def check(self, previous: list[int], new: list[int]) -> int | None:
        """Fewest of the ``new`` tokens whose text (after ``previous``) completes a stop string; None if none does.

        Only the tail of ``previous`` whose text holds ``longest`` characters is decoded with the new tokens: a stop
        string completed by them starts there at the earliest (``previous`` itself holds none, or its request
        would have ended)."""
        if not self.stops or not new:
            return None
        context, base = self._context(previous)
        if self._completed(self.decode(context + new), base) is None:  # the common case: one decode of a window
            return None
        for keep in range(1, len(new) + 1):
            if self._completed(self.decode(context + new[:keep]), base) is not None:
                return keep
        return None

    def _context(self, previous: list[int]) -> tuple[list[int], str]:
        """The last tokens of ``previous`` whose text has more than ``longest`` characters (or all of them), and
        that text. Most tokens are a character or more, so the first window is nearly always enough."""
        window = self.longest + CONTEXT_SLACK
        while True:
            context = previous[max(0, len(previous) - window):]
            base = self.decode(context)
            if len(context) == len(previous) or len(base) > self.longest:
                return context, base
            window *= 2

    def _completed(self, text: str, base: str) -> int | None:
        """Where in ``text`` the earliest stop string that ends beyond ``base`` (the text before the new tokens) starts;
        None if none does. A new token may complete a character ``base`` ended with half of: text is compared from
        where the two first differ."""
        after = len(base) if text.startswith(base) else len(os.path.commonprefix([base, text]))
        found = [at for stop in self.stops if (at := text.find(stop, max(0, after - len(stop) + 1))) >= 0]
        return min(found, default=None)

    def cut(self, text: str) -> str:
        """Text up to (not including) the earliest stop string."""
        cuts = [text.find(s) for s in self.stops if s in text]
        return text[: min(cuts)] if cuts else text

    def scanner(self) -> StopScanner:
        return StopScanner(self.stops)


class StopScanner:
    """Follows a growing text, fed piece by piece, and says how much of it no stop string can still change: up to
    the earliest stop string found, and short of any tail that could be the start of one.

    One Knuth-Morris-Pratt automaton per stop string: feeding a piece costs time in proportion to the piece, and a
    stop string whose first character is not in the piece (and has no match under way) costs a single search.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.borders = [_borders(stop) for stop in self.stops]
        self.matched = [0] * len(self.stops)  # per stop: how many of its first characters the text now ends with
        self.length = 0  # characters fed
        self.first = None  # where the earliest complete stop string starts

    def feed(self, piece: str) -> None:
        for i, (stop, borders) in enumerate(zip(self.stops, self.borders)):
            state = self.matched[i]
            if state == 0 and stop[0] not in piece:
                continue
            for offset, char in enumerate(piece):
                while state and stop[state] != char:
                    state = borders[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    start = self.length + offset + 1 - len(stop)
                    self.first = start if self.first is None else min(self.first, start)
                    state = borders[state - 1]
            self.matched[i] = state
        self.length += len(piece)

    @property
    def settled(self) -> int:
        """Characters of the text fed so far that are final: a stop string found later cannot start before them."""
        held = self.length - max(self.matched, default=0)
        return held if self.first is None else min(self.first, held)


def _borders(stop: str) -> list[int]:
    """Knuth-Morris-Pratt's failure function: for each prefix of ``stop``, the length of its longest proper prefix
    that is also its suffix."""
    borders = [0] * len(stop)
    state = 0
    for i in range(1, len(stop)):
        while state and stop[i] != stop[state]:
            state = borders[state - 1]
        if stop[i] == stop[state]:
            state += 1
        borders[i] = state
    return borders
