"""A server's intake: what front ends submit, checked and queued for the scheduler's thread (``Intake``).

The queue side of a server, which its ``scheduler.Scheduler`` composes: front ends submit, cancel and drain here,
and the scheduler's thread waits here and takes what it admits. Requests are refused here, before they are queued
and before anything is allocated for them: those the runtime refuses (``Pipeline.check_request``: ids outside the
vocabulary, no room in a row, ...), and any while the queue is full or the server is shutting down; a drain closes
the intake.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..runtime.cache import slots_needed
from ..runtime.config import GenerationConfig
from ..runtime.suffix import SuffixIndex
from .tickets import Overloaded, ShuttingDown, Ticket

# (a choice's prompt ids, its settings) -> the ids admitted; raises what refuses it (``Pipeline.check_request``)
Check = Callable[[np.ndarray, GenerationConfig], np.ndarray]


class Intake:
    """Requests waiting (``queue``) and admitted (``tickets``) for rows of ``capacity`` cache slots, at most
    ``max_queue`` waiting; ``seed``: requests that give none draw theirs from it in turn (``next_seed``), as vLLM's
    --seed makes a sequence of requests reproducible (without it, from the OS's entropy). ``_wake`` guards the queue
    and wakes the thread that serves it."""

    def __init__(self, config: GenerationConfig, capacity: int, max_batch: int, max_queue: int, seed: int | None,
                 cycle_seconds: Callable[[], float] = lambda: 0.05, *, check: Check):
        # cycle_seconds: what a cycle takes now (the scheduler's running estimate), for the retry hint; check: the
        # runtime's admission check of one choice, made before it is queued
        self.config, self.capacity, self.max_batch, self.max_queue = config, capacity, max_batch, max_queue
        self.cycle_seconds, self.check = cycle_seconds, check
        self.k = config.max_drafts
        self.queue: deque[Ticket] = deque()
        self.tickets: dict[str, Ticket] = {}  # request id -> ticket, for every request admitted and not finished
        self._ids = itertools.count()
        self._seeds = None if seed is None else np.random.SeedSequence(seed)
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False  # no new requests (a drain)

    @property
    def busy(self) -> bool:
        """Requests are queued or running."""
        return bool(self.queue or self.tickets)

    def room(self, prompt_tokens: int) -> int:
        """New tokens a prompt of ``prompt_tokens`` leaves room for in this server's context (< 1: it does not fit)."""
        return self.capacity - slots_needed(prompt_tokens, 0, self.k)

    def next_seed(self) -> int | None:
        """A seed for a request that gives none: the next of the server's --seed, or None (the OS's entropy)."""
        if self._seeds is None:
            return None
        with self._wake:
            child = self._seeds.spawn(1)[0]
        return int(child.generate_state(1, np.uint64)[0]) >> 1

    def submit(self, prompt: np.ndarray, config: GenerationConfig, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue one request of one choice (``submit_choices``)."""
        return self.submit_choices([(prompt, config)], loop)[0]

    def submit_choices(self, requests: Sequence[tuple[np.ndarray, GenerationConfig]], loop: asyncio.AbstractEventLoop,
                       top_logprobs: int | None = None, scope: str | None = None,
                       index: SuffixIndex | None = None) -> list[Ticket]:
        """Queue the choices of one request, (prompt ids, settings) each, all or none; they share one events queue,
        reuse and keep K/V in ``scope`` and draft from ``index`` (a suffix index) besides their own text.
        Raises what the runtime refuses one with (``check``: ``ConfigError``, ``CapacityError`` when it cannot fit a
        row), ``Overloaded`` when ``max_queue`` requests would be waiting, ``ShuttingDown`` once the server stops
        admitting."""
        requests = [(self.check(prompt, config), config) for prompt, config in requests]
        events: asyncio.Queue = asyncio.Queue()
        tickets = [Ticket(prompt, config, loop, events, choice, top_logprobs, f"cmpl-{next(self._ids)}", scope=scope,
                          index=index) for choice, (prompt, config) in enumerate(requests)]
        with self._wake:
            if self._closed or self._stopping:
                raise ShuttingDown("the server is shutting down: it takes no new requests; retry on another replica")
            if len(self.queue) + len(tickets) > self.max_queue:
                longest = max(config.max_new_tokens for _, config in requests)
                wait = (len(self.queue) / self.max_batch + 1) * self.cycle_seconds() * longest
                raise Overloaded(f"{len(self.queue)} requests are queued (--max-queue {self.max_queue}); retry later",
                                 retry_after=max(1.0, round(wait, 1)))
            self.queue.extend(tickets)
            self._wake.notify()
        return tickets

    def cancel(self, tickets: Sequence[Ticket]) -> None:
        """The client went away: its requests leave their batch (or the queue) on the next turn."""
        with self._wake:
            for ticket in tickets:
                ticket.cancelled = True
            self._wake.notify()

    def close(self) -> None:
        """Admit no new requests (``submit`` raises ``ShuttingDown``); those queued and running go on."""
        with self._wake:
            self._closed = True

    def abort(self, reason: str) -> None:
        """End every queued and running request on the next turn, each with ``reason`` (``Ticket.ended_by``)."""
        with self._wake:
            self._closed = True
            for ticket in self.outstanding():
                ticket.cancelled, ticket.ended_by = True, reason
            self._wake.notify()

    def stop(self) -> None:
        """Wake the serving thread to stop (``wait``: False)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def wait(self, running: Callable[[], bool]) -> bool:
        """Block the serving thread until a request waits, ``running()`` says rows are in flight, or the server
        stops; False once it stops."""
        with self._wake:
            while not (self._stopping or self.queue or running()):
                self._wake.wait()
            return not self._stopping

    def take(self, room: int) -> tuple[list[Ticket], list[Ticket]]:
        """(queued requests cancelled before admission, at most ``room`` queued requests now admitted: ``tickets``
        holds them until they end)."""
        with self._wake:
            cancelled = [t for t in self.queue if t.cancelled]
            if cancelled:  # in place: front ends and metrics hold this queue
                kept = [t for t in self.queue if not t.cancelled]
                self.queue.clear()
                self.queue.extend(kept)
            admitted = [self.queue.popleft() for _ in range(min(max(0, room), len(self.queue)))]
            for ticket in admitted:  # under the lock: ``busy`` never sees a request in neither place
                self.tickets[ticket.request_id] = ticket
        return cancelled, admitted

    def queued(self, most: int) -> list[Ticket]:
        """The first ``most`` requests waiting, in order."""
        with self._wake:
            return list(itertools.islice(self.queue, max(0, most)))

    def outstanding(self) -> list[Ticket]:
        """Every request queued or admitted and not yet ended."""
        return [*self.queue, *self.tickets.values()]
