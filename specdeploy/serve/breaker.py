"""A circuit breaker for the artifact's chat template: what a template that never ends can cost the server.

A render is limited in CPU time (``--template-seconds``), but a template that loops on every conversation still
takes a prompt worker for that long each time: 16 such chats held every worker of a 2-core machine for minutes, and a
chat sent after them waited past 60 s. After ``failures`` renders in ``window`` seconds ran past the limit, the
breaker opens: chat renders are refused at once (503, with Retry-After) for ``cool_off`` seconds, while completions,
which need no template, are served as ever. Then one render is let through as a trial: if it finishes the breaker
closes, if it runs past the limit again the breaker opens for another ``cool_off``. Only timeouts count: a template
that fails fast, or a client's own mistake, costs nothing to speak of.

A client that can make the template run long (a conversation it loops on) can open the breaker for everyone's chats;
it could hold every worker instead without one, and the breaker bounds that to ``cool_off`` seconds of chats refused
quickly rather than minutes of chats and completions waiting.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

FAILURES, WINDOW, COOL_OFF = 3, 60.0, 30.0


class TemplateBroken(RuntimeError):
    """The breaker is open: a render refused at once; ``retry_after`` seconds until a trial render is let through."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Breaker:
    """Counts a template's renders that ran past their limit; open, it refuses renders (``check``) for ``cool_off``
    seconds. Used from the event loop alone (no lock)."""

    def __init__(self, failures: int = FAILURES, window: float = WINDOW, cool_off: float = COOL_OFF,
                 clock: Callable[[], float] = time.monotonic):
        self.failures, self.window, self.cool_off, self._clock = failures, window, cool_off, clock
        self._timeouts: deque[float] = deque()  # when renders ran past the limit, within the window
        self._open_until: float | None = None
        self._trial = False  # a render let through after the cool-off, not yet settled

    @property
    def open(self) -> bool:
        return self._open_until is not None

    def check(self) -> bool:
        """Before a render: TemplateBroken while open (and while a trial render is in flight); after the cool-off the
        first caller is let through as the trial (True: the caller's render is it)."""
        if self._open_until is None:
            return False
        wait = self._open_until - self._clock()
        if wait > 0 or self._trial:
            raise TemplateBroken(f"the artifact's chat template ran past its time limit {self.failures} times within "
                                 f"{self.window:g} s: chat renders are refused for {self.cool_off:g} s (completions are "
                                 f"served); retry in {max(wait, 1.0):.0f} s", retry_after=max(wait, 1.0))
        self._trial = True
        return True

    def settle(self, timed_out: bool | None, trial: bool = False) -> None:
        """A render that ``check`` let through ended: past its limit (True), within it (False), or unknown (None: its
        request went away; a trial is let through again). ``trial``: what ``check`` returned for it."""
        now = self._clock()
        if trial:
            self._trial = False
        if timed_out is None:
            return
        if not timed_out:
            if trial:  # the template finishes again: closed, its history forgotten
                self._open_until = None
                self._timeouts.clear()
            return
        if trial or self._open_until is not None:
            self._open_until = now + self.cool_off
            return
        self._timeouts.append(now)
        while self._timeouts and self._timeouts[0] < now - self.window:
            self._timeouts.popleft()
        if len(self._timeouts) >= self.failures:
            self._open_until = now + self.cool_off
            self._timeouts.clear()
