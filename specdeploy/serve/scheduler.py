"""Continuous batching: one thread owns the running batch; requests join between its cycles.

Each scheduler turn: cancelled requests leave (their cache rows are freed at once); queued requests
are admitted as a *staging* batch while the running batch has room; the staging batch's prompts are
prefilled one chunk per turn (so running rows never wait for a whole long prompt) and, once
prefilled, merged into the running batch; then the running batch runs one cycle. Every row keeps its
own sampling settings, stop strings, seed and max_tokens (``Pipeline.start(row_configs=...)``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..runtime.cache import CapacityError
from ..runtime.config import ConfigError, GenerationConfig
from ..runtime.decoder import Generation, RowResult
from ..runtime.telemetry import FinishReason

DEFAULT_CONTEXT = 2048
log = logging.getLogger(__name__)


def context_slots(pipeline, asked: int | None) -> int:
    """Cache slots per request: ``asked``, else the artifact's capacity up to DEFAULT_CONTEXT."""
    limit = min(spec.capacity for spec in pipeline.manifest.models.values())
    if asked is not None and asked > limit:
        raise ConfigError(f"--context: got {asked}; the artifact was exported with capacity {limit}")
    return asked or min(limit, DEFAULT_CONTEXT)


class Overloaded(RuntimeError):
    """The queue is full: the client should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Ticket:
    """One request: the scheduler's thread puts ("tokens", ids) and finally ("done", row) on ``events``."""

    prompt: np.ndarray
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    request_id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def put(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Owns a pipeline's engines: at most ``max_batch`` rows decode together and ``max_queue`` wait."""

    def __init__(self, pipeline, config: GenerationConfig, capacity: int, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 256, on_finish=None):
        self.pipeline, self.config, self.capacity = pipeline, config, capacity
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.on_finish = on_finish  # called on the scheduler's thread with (ticket, row) when a request ends
        # one policy for the server's life: what it learned (acceptance, costs per batch size) outlives a batch
        self.policy = pipeline.policy_for(config)
        self.queue: deque[Ticket] = deque()
        self.tickets: dict[str, Ticket] = {}  # request id -> ticket, for every request admitted and not finished
        self.running: Generation | None = None
        self.staging: Generation | None = None
        self.staging_drafts: bool | None = None  # whether the draft prefills the staging rows (None: not asked yet)
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="specdeploy-scheduler", daemon=True)
        self.cycle_seconds = 0.05  # a running estimate, for the retry hint
        self.warm_up_seconds: float | None = None  # set once the engines are warm

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def rows(self) -> int:
        """Rows decoding or prefilling now."""
        return sum(g.state.batch for g in (self.running, self.staging) if g is not None)

    def submit(self, prompt: np.ndarray, config: GenerationConfig, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue a request; raises ``CapacityError`` when it cannot fit a row, ``Overloaded`` when
        ``max_queue`` requests already wait."""
        k = self.config.k if self.config.speculative else 0
        needed = len(prompt) + config.max_new_tokens + k + 1
        if needed > self.capacity:
            raise CapacityError(f"prompt ({len(prompt)} tokens) + max_tokens ({config.max_new_tokens}) + "
                                f"{k + 1} speculative slots = {needed} tokens, over this server's context of "
                                f"{self.capacity} tokens per request; shorten the prompt or lower max_tokens")
        ticket = Ticket(prompt, config, loop, f"cmpl-{next(self._ids)}")
        with self._wake:
            if len(self.queue) >= self.max_queue:
                wait = (len(self.queue) / max(self.max_batch, 1) + 1) * self.cycle_seconds * config.max_new_tokens
                raise Overloaded(f"{len(self.queue)} requests are queued (--max-queue {self.max_queue}); retry later",
                                 retry_after=max(1.0, round(wait, 1)))
            self.queue.append(ticket)
            self._wake.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: the request leaves its batch (or the queue) on the next turn."""
        with self._wake:
            ticket.cancelled = True
            self._wake.notify()

    def _serve(self) -> None:
        self._warm_up()
        while True:
            with self._wake:
                while not (self._stopping or self.queue or self.staging or (self.running and not self.running.done)):
                    self._wake.wait()
                if self._stopping:
                    break
                self._drop_cancelled()
                admitted = self._admit()
            try:
                self._turn(admitted)
            except Exception as exc:  # a fault outside the decoder's own isolation: fail what was in flight
                for generation in (self.running, self.staging):
                    if generation is not None:
                        for index in list(generation.state.active):
                            row = generation.state.rows[index]
                            row.finish_reason, row.error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
                            self._finish(row)
                self.running = self.staging = None
        for ticket in [*self.queue, *self.tickets.values()]:
            ticket.put(("error", "the server is shutting down"))

    def _warm_up(self) -> None:
        """Before the first request (those that come meanwhile wait in the queue): ONNX Runtime's first calls
        at a shape are dear, and the cost policy learns from its first measurements (``Pipeline.warm_up``)."""
        k = self.config.k if self.config.speculative else 0
        try:
            self.warm_up_seconds = self.pipeline.warm_up(k, self.prefill_chunk)
        except Exception as exc:  # an engine that fails here fails requests too, each with its error
            log.warning("warming up the engines failed: %s: %s", type(exc).__name__, exc)

    def _drop_cancelled(self) -> None:
        self.queue = deque(t for t in self.queue if not t.cancelled)
        for generation in (self.running, self.staging):
            if generation is None:
                continue
            for index in list(generation.state.active):
                row = generation.state.rows[index]
                ticket = self.tickets.get(row.request_id)
                if ticket is not None and ticket.cancelled:
                    generation.cancel(index)
                    self._finish(row)
                    generation.state.release(index)

    def _admit(self) -> list[Ticket]:
        """Queued requests that fit the batch, taken as one staging batch (none while one is prefilling)."""
        if self.staging is not None:
            return []
        room = self.max_batch - self.rows
        admitted = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        for ticket in admitted:
            self.tickets[ticket.request_id] = ticket
        return admitted

    def _turn(self, admitted: list[Ticket]) -> None:
        if admitted:
            try:
                self.staging = self.pipeline.start([t.prompt for t in admitted], self.config,
                                                   [t.config for t in admitted], capacity=self.capacity)
            except Exception as exc:  # submit checked each request: nothing here is the client's fault
                for ticket in admitted:
                    self.tickets.pop(ticket.request_id, None)
                    ticket.put(("error", f"{type(exc).__name__}: {exc}"))
                return
            for ticket, row in zip(admitted, self.staging.state.rows):
                row.request_id = ticket.request_id
            self.staging.policy = self.policy  # it hears what the draft's prefill costs
            self.staging_drafts = None
        if self.staging is not None and self.staging.prefill_chunk(self.prefill_chunk, draft=self._staging_drafts):
            staged, self.staging = self.staging, None
            for row in staged.state.rows:  # rows whose prefill failed have left already
                if row.finish_reason:
                    self._finish(row)
            if self.running is None:
                self.running = staged
                self.running.policy = self.policy
                self.running.joining = lambda: self._joining(self.staging)
            else:  # an empty running batch too: the rows take the memory of those that left
                self.running.merge(staged)
        if self.running is not None and not self.running.done:
            began = time.perf_counter()
            committed = self.running.step()
            self.cycle_seconds = 0.9 * self.cycle_seconds + 0.1 * (time.perf_counter() - began)
            rows = self.running.state.rows
            for index, new in committed:
                row = rows[index]
                if new:
                    self.tickets[row.request_id].put(("tokens", new))
                if row.finish_reason:
                    self._finish(row)
                    self.running.state.release(index)
            # An emptied batch stays, to lend its cache memory to the next rows: allocated afresh for each wave of
            # requests, 8 rows of the real pair's caches (470 MB of target K/V, 200 MB of the draft's) took 1.4 s
            # a merge, page faults and copies (tools/load_test.py, 8 clients).

    def _staging_drafts(self) -> bool:
        """Asked once per staging batch, after the target's first chunk of it (``_drafting_pays``)."""
        if self.staging_drafts is None:
            self.staging_drafts = self._drafting_pays(self.staging)
        return self.staging_drafts

    def _drafting_pays(self, staged: Generation) -> bool:
        """Should the draft prefill the joining rows? Not when the policy finds that, in the batch they
        make with the running rows and the requests queued behind them, speculation would not repay it
        (the batch then decodes plainly).

        Asked after the target's first chunk of these rows: the clients of a burst arrive a few ms apart, so
        the first request was admitted alone, and judged alone the draft prefilled it (~0.25 s on the real
        pair) for a batch of 4 that then decoded plainly (tools/load_test.py)."""
        if not staged.drafter.behind(staged.state, staged.draft_cache):  # nothing of theirs to prefill
            return True
        rows, lacking, to_come = self._joining(staged)  # theirs and the queued requests'
        if self.running is not None and not self.running.done:
            rows += self.running.state.batch
            lacking += self.running.drafter.behind(self.running.state, self.running.draft_cache)
            to_come += sum(self.running.state.left())
        return self.policy.catchup_pays(rows, lacking, to_come)

    def _joining(self, staged: Generation | None) -> tuple[int, int, int]:
        """The rows about to join the running batch: the staging ones and the queued requests that fit. Their
        count, the prompt tokens the draft lacks of them, and their tokens to come (``Generation.joining``)."""
        rows = lacking = to_come = 0
        if staged is not None and not staged.done:
            rows, to_come = staged.state.batch, sum(staged.state.left())
            lacking = staged.drafter.behind(staged.state, staged.draft_cache)
        with self._wake:
            queued = list(itertools.islice(self.queue, max(0, self.max_batch - self.rows)))
        rows += len(queued)
        lacking += sum(max(0, len(t.prompt) - 2) for t in queued)  # as ``Drafter.behind`` counts a fresh row
        to_come += sum(t.config.max_new_tokens for t in queued)
        return rows, lacking, to_come

    def _finish(self, row: RowResult) -> None:
        ticket = self.tickets.pop(row.request_id, None)
        if ticket is None:
            return
        if self.on_finish is not None:
            self.on_finish(ticket, row)
        ticket.put(("done", row))
