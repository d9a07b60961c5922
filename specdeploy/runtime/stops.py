"""Stop strings: where a request's text must end, found on tokens as they are committed."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStrings:
    """The stop strings of a request, over a tokenizer's ``decode`` (token ids -> text)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops, self.decode = tuple(stops), decode

    def check(self, previous: list[int], new: list[int]) -> int | None:
        """Fewest of the ``new`` tokens whose text (after ``previous``) completes a stop string; None if none does."""
        # one decode per cycle in the common case; the per-token search only once a stop appears
        if not any(s in self.decode(previous + new) for s in self.stops):
            return None
        for keep in range(1, len(new) + 1):
            text = self.decode(previous + new[:keep])
            if any(s in text for s in self.stops):
                return keep
        return None

    def cut(self, text: str) -> str:
        """Text up to (not including) the earliest stop string."""
        cuts = [text.find(s) for s in self.stops if s in text]
        return text[: min(cuts)] if cuts else text

    def settled(self, text: str) -> str:
        """The part of a growing ``text`` that no stop string can still change: cut at a stop string, and
        without a tail that could be the start of one."""
        text = self.cut(text)
        held = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        return text[: len(text) - held]
