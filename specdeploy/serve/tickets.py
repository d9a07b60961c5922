"""A request's side of the scheduler: its ``Ticket`` (one choice), the ``Event``s its responder hears, and the errors
that refuse or end it (``Overloaded``, ``ShuttingDown``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..runtime.config import GenerationConfig
from ..runtime.suffix import SuffixIndex
from .logprobs import TokenLogprob


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
    scope: str | None = None  # the scope whose kept K/V it reuses and keeps its own in (per API key by default)
    index: SuffixIndex | None = None  # the suffix index it drafts from (its scope's by default); None: its own text alone

    def put(self, event: Event) -> None:
        if not self.loop.is_closed():  # a server that has stopped listens no more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
