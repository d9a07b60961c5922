"""Continuous batching: one thread owns the running batch; requests join between its cycles.

Each scheduler turn: cancelled requests leave (their cache rows are freed at once); queued requests
are admitted as a *staging* batch while the running batch has room; the staging batch's prompts are
prefilled one chunk per turn (so running rows never wait for a whole long prompt) and, once
prefilled, merged into the running batch; then the running batch runs one cycle. Every row keeps its
own sampling settings, stop strings, seed and max_tokens (``Pipeline.start(row_configs=...)``).

A request that the runtime refuses at admission (an id outside the vocabulary, say) fails alone: the
others admitted with it are started without it. Before the first turn the engines warm up (``ready``);
``close`` stops admitting and ``abort`` ends every request still open (a server's drain).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..runtime.cache import CapacityError
from ..runtime.config import ConfigError, GenerationConfig
from ..runtime.decoder import Generation, RowResult
from ..runtime.suffix import SuffixIndex
from ..runtime.telemetry import FinishReason
from .logprobs import TokenLogprob, token_logprobs

DEFAULT_CONTEXT = 2048
log = logging.getLogger(__name__)


def context_slots(pipeline, asked: int | None, k: int = 0) -> int:
    """Cache slots per request: ``asked``, else the artifact's capacity up to DEFAULT_CONTEXT. At least a
    one-token prompt, one new token and the ``k`` + 1 speculative slots must fit."""
    limit = min(spec.capacity for spec in pipeline.manifest.models.values())
    if asked is not None and asked > limit:
        raise ConfigError(f"--max-model-len/--context: got {asked}; the artifact was exported with capacity {limit}")
    if asked is not None and asked < k + 3:
        raise ConfigError(f"--max-model-len/--context: got {asked}; expected at least {k + 3} (a 1-token prompt, 1 new token and "
                          f"k + 1 = {k + 1} speculative slots), or every request would be refused")
    return asked or min(limit, DEFAULT_CONTEXT)


class Overloaded(RuntimeError):
    """The queue is full: the client should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(RuntimeError):
    """The server is draining or stopping: no new requests (HTTP 503), or an open one ended early."""


class Event(NamedTuple):
    """What the scheduler's thread tells a request's responder, on the ticket's ``events`` queue."""

    kind: str  # "tokens": new token ids; "done": the finished RowResult; "error": the exception that refused it
    choice: int  # which of the request's choices (n, or a list of prompts) it is about
    payload: Any
    logprobs: list[TokenLogprob] | None = None  # with "tokens", when the request asked for them


@dataclass
class Ticket:
    """One choice of a request: the scheduler's thread puts its ``Event``s on ``events`` (shared by the choices
    of one request) and stamps its times (``time.perf_counter()``)."""

    prompt: np.ndarray
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    choice: int = 0
    top_logprobs: int | None = None  # alternatives listed with each token's logprob; None: no logprobs
    request_id: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # left the queue for a batch
    token_times: list[float] = field(default_factory=list)  # when each cycle's new tokens were committed
    cancelled: bool = False
    ended_by: str = ""  # why the server ended it early (a drain's deadline); empty when it ran its course
    index: SuffixIndex | None = None  # its scope's suffix index (per API key by default); None: its own text alone

    def put(self, event: Event) -> None:
        if not self.loop.is_closed():  # a server that has stopped listens no more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Owns a pipeline's engines: at most ``max_batch`` rows decode together and ``max_queue`` wait.

    ``seed``: requests that give no seed draw theirs from it in turn (``next_seed``), so that a sequence of
    requests is reproducible as vLLM's --seed makes it; without it they draw from the OS's entropy.
    """

    def __init__(self, pipeline, config: GenerationConfig, capacity: int, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 256, on_finish=None, seed: int | None = None):
        k = config.k if config.speculative else 0
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1), ("prefill_chunk", prefill_chunk, 1),
                                 ("capacity", capacity, k + 3)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name}: got {value!r}; expected an integer >= {low}")
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
        self._seeds = None if seed is None else np.random.SeedSequence(seed)
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False  # no new requests (a drain)
        self._abort = ""  # why every open request must end now
        self._logprobs: dict[str, list[TokenLogprob]] = {}  # request id -> this cycle's, until its tokens are sent
        self._asking_logprobs = 0  # requests in flight that asked for them: none, and a cycle costs nothing more
        self._thread = threading.Thread(target=self._serve, name="specdeploy-scheduler", daemon=True)
        self.cycle_seconds = 0.05  # a running estimate, for the retry hint
        self.cached_tokens = 0  # tokens the rows' caches hold, after the last turn
        self.ready = threading.Event()  # set once the engines have warmed up
        self.warm_up_seconds: float | None = None
        self.warm_up_error = ""  # why warming up failed, if it did

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def rows(self) -> int:
        """Rows decoding or prefilling now."""
        return sum(g.state.batch for g in (self.running, self.staging) if g is not None)

    @property
    def busy(self) -> bool:
        """Requests are queued or running."""
        return bool(self.queue or self.tickets)

    @property
    def speculative_slots(self) -> int:
        return self.config.k + 1 if self.config.speculative else 1

    def room(self, prompt_tokens: int) -> int:
        """New tokens a prompt of ``prompt_tokens`` leaves room for in this server's context (< 1: it does not fit)."""
        return self.capacity - prompt_tokens - self.speculative_slots

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
                       top_logprobs: int | None = None, index: SuffixIndex | None = None) -> list[Ticket]:
        """Queue the choices of one request, (prompt ids, settings) each, all or none; they share one events queue
        and draft from ``index`` (its scope's suffix index) besides their own text.
        Raises ``CapacityError`` when one cannot fit a row, ``Overloaded`` when ``max_queue`` requests would be
        waiting, ``ShuttingDown`` once the server stops admitting."""
        for prompt, config in requests:
            needed = len(prompt) + config.max_new_tokens + self.speculative_slots
            if needed > self.capacity:
                raise CapacityError(f"prompt ({len(prompt)} tokens) + max_tokens ({config.max_new_tokens}) + "
                                    f"{self.speculative_slots} speculative slots = {needed} tokens, over this server's "
                                    f"context of {self.capacity} tokens per request; shorten the prompt or lower max_tokens")
        events: asyncio.Queue = asyncio.Queue()
        tickets = [Ticket(prompt, config, loop, events, choice, top_logprobs, f"cmpl-{next(self._ids)}", index=index)
                   for choice, (prompt, config) in enumerate(requests)]
        with self._wake:
            if self._closed or self._stopping:
                raise ShuttingDown("the server is shutting down: it takes no new requests; retry on another replica")
            if len(self.queue) + len(tickets) > self.max_queue:
                longest = max(config.max_new_tokens for _, config in requests)
                wait = (len(self.queue) / self.max_batch + 1) * self.cycle_seconds * longest
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
            self._closed, self._abort = True, reason
            self._wake.notify()

    def _serve(self) -> None:
        self._warm_up()
        while True:
            with self._wake:
                while not (self._stopping or self.queue or self.staging or (self.running and not self.running.done)):
                    self._wake.wait()
                if self._stopping:
                    break
                if self._abort:
                    for ticket in [*self.queue, *self.tickets.values()]:
                        ticket.cancelled, ticket.ended_by = True, self._abort
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
            self.cached_tokens = sum(sum(g.state.lengths) for g in (self.running, self.staging) if g is not None)
        for ticket in [*self.queue, *self.tickets.values()]:
            ticket.put(Event("error", ticket.choice, ShuttingDown("the server is shutting down")))

    def _warm_up(self) -> None:
        """Before the first request (those that come meanwhile wait in the queue): ONNX Runtime's first calls
        at a shape are dear, and the cost policy learns from its first measurements (``Pipeline.warm_up``).
        ``ready`` is set once it is done; a failure is kept in ``warm_up_error`` and the server stays unready."""
        k = self.config.k if self.config.speculative else 0
        try:
            self.warm_up_seconds = self.pipeline.warm_up(k, self.prefill_chunk)
        except Exception as exc:  # an engine that fails here fails requests too, each with its error
            self.warm_up_error = f"{type(exc).__name__}: {exc}"
            log.warning("warming up the engines failed: %s", self.warm_up_error)
            return
        log.info("ready: the engines warmed up in %.2f s", self.warm_up_seconds)
        self.ready.set()

    def _drop_cancelled(self) -> None:
        for ticket in [t for t in self.queue if t.cancelled]:  # never admitted: each ends with an empty row
            self._end(ticket, RowResult(ticket.request_id, ticket.prompt, finish_reason=FinishReason.CANCELLED))
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
        now = time.perf_counter()
        for ticket in admitted:
            ticket.admitted = now
            self.tickets[ticket.request_id] = ticket
            self._asking_logprobs += ticket.top_logprobs is not None
        return admitted

    def _turn(self, admitted: list[Ticket]) -> None:
        if admitted:
            self.staging = self._start(admitted)
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
            now = time.perf_counter()
            self.cycle_seconds = 0.9 * self.cycle_seconds + 0.1 * (now - began)
            rows = self.running.state.rows
            for index, new in committed:
                row = rows[index]
                if new:
                    ticket = self.tickets[row.request_id]
                    ticket.token_times.append(now)
                    ticket.put(Event("tokens", ticket.choice, new, self._logprobs.pop(row.request_id, None)))
                if row.finish_reason:
                    self._finish(row)
                    self.running.state.release(index)
            # An emptied batch stays, to lend its cache memory to the next rows: allocated afresh for each wave of
            # requests, 8 rows of the real pair's caches (470 MB of target K/V, 200 MB of the draft's) took 1.4 s
            # a merge, page faults and copies (tools/load_test.py, 8 clients).

    def _start(self, admitted: list[Ticket]) -> Generation | None:
        """The admitted requests as a staging batch. One the runtime refuses (say, a prompt with an id outside the
        vocabulary: ``submit`` cannot know every check ``Pipeline.start`` makes) fails alone, with its error; the
        others start without it. None when none could."""
        try:
            return self._generation(admitted)
        except Exception:  # find whose it is: each alone, on the failure's path only
            refused = {}
            for ticket in admitted:
                try:
                    self.pipeline.start([ticket.prompt], self.config, [ticket.config], capacity=self.capacity)
                except Exception as exc:
                    refused[ticket.request_id] = exc
            admitted = [t for t in admitted if t.request_id not in refused] if refused else []
            try:
                staged = self._generation(admitted) if admitted else None
            except Exception as exc:  # not one request's fault after all: each fails with it
                refused.update((t.request_id, exc) for t in admitted)
                staged = None
            for request_id, exc in refused.items():
                ticket = self.tickets.pop(request_id)
                self._asking_logprobs -= ticket.top_logprobs is not None
                ticket.put(Event("error", ticket.choice, exc))
            return staged

    def _generation(self, tickets: list[Ticket]) -> Generation:
        staged = self.pipeline.start([t.prompt for t in tickets], self.config, [t.config for t in tickets],
                                     capacity=self.capacity, suffix_index=[t.index for t in tickets])
        for ticket, row in zip(tickets, staged.state.rows):
            row.request_id = ticket.request_id
        staged.policy = self.policy  # it hears what the draft's prefill costs
        staged.on_verified = lambda logits, committed: self._keep_logprobs(staged, logits, committed)
        return staged

    def _keep_logprobs(self, generation: Generation, logits: np.ndarray, committed: list[tuple[int, list[int]]]) -> None:
        """The logprobs of each committed token of the rows that asked for them, from the verification's logits
        (``Generation.on_verified``); sent with the tokens once the cycle ends."""
        if not self._asking_logprobs:
            return
        rows = generation.state.rows
        for b, (index, new) in enumerate(committed):
            ticket = self.tickets.get(rows[index].request_id) if new else None
            if ticket is not None and ticket.top_logprobs is not None:
                self._logprobs[ticket.request_id] = token_logprobs(logits[b, : len(new)], new, ticket.top_logprobs)

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
            to_come += sum(self.running.state.budgets()[0])
        return self.policy.catchup_pays(rows, lacking, to_come)

    def _joining(self, staged: Generation | None) -> tuple[int, int, int]:
        """The rows about to join the running batch: the staging ones and the queued requests that fit. Their
        count, the prompt tokens the draft lacks of them, and their tokens to come (``Generation.joining``)."""
        rows = lacking = to_come = 0
        if staged is not None and not staged.done:
            rows, to_come = staged.state.batch, sum(staged.state.budgets()[0])
            lacking = staged.drafter.behind(staged.state, staged.draft_cache)
        with self._wake:
            queued = list(itertools.islice(self.queue, max(0, self.max_batch - self.rows)))
        rows += len(queued)
        lacking += sum(max(0, len(t.prompt) - 2) for t in queued)  # as ``Drafter.behind`` counts a fresh row
        to_come += sum(t.config.max_new_tokens for t in queued)
        return rows, lacking, to_come

    def _finish(self, row: RowResult) -> None:
        ticket = self.tickets.pop(row.request_id, None)
        if ticket is not None:
            self._asking_logprobs -= ticket.top_logprobs is not None
            self._logprobs.pop(row.request_id, None)
            self._end(ticket, row)

    def _end(self, ticket: Ticket, row: RowResult) -> None:
        if self.on_finish is not None:
            self.on_finish(ticket, row)
        ticket.put(Event("done", ticket.choice, row))
