"""Continuous batching: one thread owns the running batch; requests join between its cycles.

Each scheduler turn: cancelled requests leave (their cache rows are freed at once); queued requests
are admitted as a *staging* batch while the running batch has room; the staging batch's prompts are
prefilled one chunk per turn (so running rows never wait for a whole long prompt) and, once
prefilled, merged into the running batch; then the running batch runs one cycle. Every row keeps its
own sampling settings, stop strings, seed and max_tokens (``Pipeline.start(row_configs=...)``).

A request that the runtime refuses (an id outside the vocabulary, no room in a row) is refused when it is
submitted, before it is queued (the intake calls ``Pipeline.check_request``), so what is admitted starts. Before
the first turn the engines warm up (``ready``); ``close`` stops admitting and ``abort`` ends every request still
open (a server's drain).
"""

from __future__ import annotations

import logging
import threading
import time

from ..runtime.cache import slots_needed
from ..runtime.config import ConfigError, GenerationConfig
from ..runtime.decoder import Generation
from ..runtime.rows import RowResult
from ..runtime.telemetry import FinishReason
from ..values import is_integer, short
from .intake import Intake
from .logprobs import Logprobs
from .tickets import Event, Overloaded, ShuttingDown, Ticket

__all__ = ["Event", "Overloaded", "Scheduler", "ShuttingDown", "Ticket", "context_slots"]

DEFAULT_CONTEXT = 2048
SERVER_CONTEXT = "this server's context is {limit} tokens per request"  # where a request's room comes from
log = logging.getLogger(__name__)


def context_slots(pipeline, asked: int | None, k: int = 0) -> int:
    """Cache slots per request: ``asked``, else the artifact's capacity up to DEFAULT_CONTEXT. At least a
    one-token prompt, one new token and the ``k`` + 1 speculative slots must fit."""
    limit = min(spec.capacity for spec in pipeline.manifest.models.values())
    if asked is not None and asked > limit:
        raise ConfigError(f"--max-model-len/--context: got {asked}; the artifact was exported with capacity {limit}")
    least = slots_needed(1, 1, k)
    if asked is not None and asked < least:
        raise ConfigError(f"--max-model-len/--context: got {asked}; expected at least {least} (a 1-token prompt, 1 new token and "
                          f"k + 1 = {k + 1} speculative slots), or every request would be refused")
    return asked or min(limit, DEFAULT_CONTEXT)


class Scheduler:
    """Owns a pipeline's engines: at most ``max_batch`` rows decode together and ``max_queue`` wait. Front ends submit,
    cancel and drain through its ``intake``; its thread admits, prefills, merges and steps the batches."""

    def __init__(self, pipeline, config: GenerationConfig, capacity: int, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 256, on_finish=None, seed: int | None = None):
        k = config.max_drafts
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1), ("prefill_chunk", prefill_chunk, 1),
                                 ("capacity", capacity, slots_needed(1, 1, k))):
            if not is_integer(value) or value < low:
                raise ConfigError(f"{name}: got {short(value)}; expected an integer >= {low}")
        self.cycle_seconds = 0.05  # a running estimate of a cycle
        self.intake = Intake(config, capacity, max_batch, max_queue, seed, lambda: self.cycle_seconds,
                             check=lambda prompt, row: pipeline.check_request(prompt, row, capacity=capacity, k=k,
                                                                              why=SERVER_CONTEXT))
        self.config, self.capacity, self.max_batch, self.k = config, capacity, max_batch, k
        # the intake's containers, read by metrics and tests (the intake changes them in place only)
        self.queue, self.tickets = self.intake.queue, self.intake.tickets
        self.pipeline, self.prefill_chunk = pipeline, prefill_chunk
        self.on_finish = on_finish  # called on the scheduler's thread with (ticket, row) when a request ends
        # one policy for the server's life: what it learned (acceptance, costs per batch size) outlives a batch
        self.policy = pipeline.policy_for(config)
        self.running: Generation | None = None
        self.staging: Generation | None = None
        self.logprobs = Logprobs()  # of the requests in flight that asked for them
        self._thread = threading.Thread(target=self._serve, name="specdeploy-scheduler", daemon=True)
        self.held_tokens = 0  # tokens the rows' caches hold, after the last turn
        self.ready = threading.Event()  # set once the engines have warmed up
        self.warm_up_seconds: float | None = None
        self.warm_up_error = ""  # why warming up failed, if it did

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.intake.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def row_count(self) -> int:
        """Rows decoding or prefilling now."""
        return sum(g.batch for g in (self.running, self.staging) if g is not None)

    def _serve(self) -> None:
        self._warm_up()
        while self.intake.wait(lambda: bool(self.staging or (self.running and not self.running.done))):
            admitted = self._admit()
            try:
                self._turn(admitted)
            except Exception as exc:  # a fault outside the decoder's own isolation: fail what was in flight
                for generation in (self.running, self.staging):
                    for row in generation.fail_all(exc) if generation is not None else []:
                        self._finish(row)
                self.running = self.staging = None
            self.held_tokens = sum(int(g.lengths.sum()) for g in (self.running, self.staging) if g is not None)
        for ticket in self.intake.outstanding():
            ticket.put(Event("error", ticket.choice, ShuttingDown("the server is shutting down")))

    def _warm_up(self) -> None:
        """Before the first request (those that come meanwhile wait in the queue): ONNX Runtime's first calls
        at a shape are dear, and the cost policy learns from its first measurements (``Pipeline.warm_up``).
        ``ready`` is set once it is done; a failure is kept in ``warm_up_error`` and the server stays unready."""
        try:
            self.warm_up_seconds = self.pipeline.warm_up(self.k, self.prefill_chunk, self.config.exact)
        except Exception as exc:  # an engine that fails here fails requests too, each with its error
            self.warm_up_error = f"{type(exc).__name__}: {exc}"
            log.warning("warming up the engines failed: %s", self.warm_up_error)
            return
        log.info("ready: the engines warmed up in %.2f s", self.warm_up_seconds)
        self.ready.set()

    def _drop_cancelled(self) -> None:
        """Rows whose requests were cancelled leave their batch."""
        for generation in (self.running, self.staging):
            for number, row in generation.in_flight if generation is not None else []:
                ticket = self.tickets.get(row.request_id)
                if ticket is not None and ticket.cancelled:
                    generation.cancel(number)
                    self._finish(row)
                    generation.release(number)

    def _admit(self) -> list[Ticket]:
        """Cancelled requests end (running ones first: their rows are room); queued ones that fit the batch are taken
        as one staging batch (none while one is prefilling: they wait for the next)."""
        self._drop_cancelled()
        cancelled, admitted = self.intake.take(0 if self.staging is not None else self.max_batch - self.row_count)
        for ticket in cancelled:  # never admitted: each ends with an empty row
            self._end(ticket, RowResult(ticket.request_id, ticket.prompt, finish_reason=FinishReason.CANCELLED))
        now = time.perf_counter()
        for ticket in admitted:
            ticket.admitted = now
            self.logprobs.watch(ticket.request_id, ticket.top_logprobs)
        return admitted

    def _turn(self, admitted: list[Ticket]) -> None:
        if admitted:
            self.staging = self._start(admitted)
        # the draft prefills the staged rows only if its catch-up pays in the batch they make (the runtime judges)
        if self.staging is not None and self.staging.prefill_chunk(self.prefill_chunk, draft=None):
            staged, self.staging = self.staging, None
            for row in staged.results:  # rows whose prefill failed have left already
                if row.finish_reason:
                    self._finish(row)
            if self.running is None:
                self.running = staged
            else:  # an empty running batch too: the rows take the memory of those that left
                self.running.merge(staged)
        if self.running is not None and not self.running.done:
            began = time.perf_counter()
            committed = self.running.step()
            now = time.perf_counter()
            self.cycle_seconds = 0.9 * self.cycle_seconds + 0.1 * (now - began)  # the intake's retry hint
            requests = self.running.requests
            for number, new in committed:
                row = requests[number].result
                if new:
                    ticket = self.tickets[row.request_id]
                    ticket.token_times.append(now)
                    ticket.put(Event("tokens", ticket.choice, new, self.logprobs.take(row.request_id)))
                if row.finish_reason:
                    self._finish(row)
                    self.running.release(number)
            # an emptied batch stays: its cache memory is reused, not re-allocated per wave (docs/results/load_test)

    def _start(self, admitted: list[Ticket]) -> Generation | None:
        """The admitted requests as a staging batch (each was checked when it was submitted). None where the batch
        could not start: no one request's fault (an engine that cannot allocate, say), so each fails with it."""
        try:
            return self._generation(admitted)
        except Exception as exc:
            for ticket in admitted:
                self.tickets.pop(ticket.request_id, None)
                self.logprobs.forget(ticket.request_id)
                ticket.put(Event("error", ticket.choice, exc))
            return None

    def _generation(self, tickets: list[Ticket]) -> Generation:
        """A staging batch of ``tickets``: the server's policy (what it learned outlives a batch), and listeners for the
        rows about to join it and for the logprobs of its committed tokens."""
        staged = self.pipeline.start(
            [t.prompt for t in tickets], self.config, [t.config for t in tickets], capacity=self.capacity,
            suffix_index=[t.index for t in tickets], scope=[t.scope for t in tickets],
            policy=self.policy, request_ids=[t.request_id for t in tickets],
            joining=lambda: self._joining(staged),
            on_verified=lambda logits, committed: self.logprobs.keep(staged, logits, committed))
        return staged

    def _joining(self, generation: Generation) -> tuple[int, int, float]:
        """What joins ``generation``'s rows in the batch they make (``Generation.joining``): the other batch (the running
        one of a staging batch, the staging one of the running batch) and the queued requests that fit. Their rows, the
        tokens the draft lacks of them, and their tokens to come."""
        other = self.staging if generation is self.running else self.running
        rows, lacking, to_come = other.outlook() if other is not None and not other.done else (0, 0, 0)
        queued = self.intake.queued(self.max_batch - self.row_count)
        rows += len(queued)
        lacking += sum(max(0, len(t.prompt) - 2) for t in queued)  # as ``Drafter.behind`` counts a fresh row
        to_come += sum(self.pipeline.answers.to_come(0, t.config.max_new_tokens) for t in queued)  # as long as answers run
        return rows, lacking, to_come

    def _finish(self, row: RowResult) -> None:
        ticket = self.tickets.pop(row.request_id, None)
        if ticket is not None:
            self.logprobs.forget(row.request_id)
            self._end(ticket, row)

    def _end(self, ticket: Ticket, row: RowResult) -> None:
        if self.on_finish is not None:
            self.on_finish(ticket, row)
        ticket.put(Event("done", ticket.choice, row))
