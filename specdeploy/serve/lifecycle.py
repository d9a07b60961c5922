"""Readiness and a graceful stop.

Ready (``/health``, ``/health/ready`` answer 200) once the engines have warmed up the shapes the server
runs (``Scheduler.ready``) and the chat template has been compiled; alive (``/health/live``) as long as
the process answers. On SIGTERM (or Ctrl-C) the server drains: it stops admitting (new requests and
the readiness probe get 503), lets the requests it holds finish for up to ``--drain-seconds``, ends any
still open with a final event that says so (``Reply``), then exits 0. A second signal stops it at once: the
requests still open are cut, and the process exits 1 (not by the signal, and without uvicorn's 5 s of grace).

``server_config`` is how every server of this package is configured: X-Forwarded-* headers believed only from
the proxies the operator names (uvicorn believes loopback's by default, so any local client could choose the
address logged), and a client that half-closes its socket after sending its request (``shutdown(SHUT_WR)``)
still gets its answer (asyncio closes a connection at EOF unless the protocol keeps it open), while one that
went away is still found out and cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import Future

import uvicorn

from .scheduler import Scheduler

log = logging.getLogger("specdeploy.serve")
LAST_EVENTS_SECONDS = 5.0  # after a drain's deadline, for the responders to send their final events


class Lifecycle:
    """The server's state for its probes: warming up, ready, draining; and the drain itself."""

    def __init__(self, scheduler: Scheduler, template_warmed: Future | None = None):
        self.scheduler, self.template_warmed = scheduler, template_warmed
        self.draining = False
        self.open = 0  # responses being sent

    def status(self) -> str:
        """ok (ready), draining, failed (warming up raised: the reason follows), or warming_up."""
        if self.draining:
            return "draining"
        if self.scheduler.warm_up_error:
            return f"failed: warming up the engines raised {self.scheduler.warm_up_error}"
        if self.scheduler.ready.is_set() and (self.template_warmed is None or self.template_warmed.done()):
            return "ok"
        return "warming_up"

    async def drain(self, seconds: float) -> None:
        """Stop admitting, wait up to ``seconds`` for the open requests, end those left, wait for their last events."""
        self.draining = True
        self.scheduler.intake.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        log.info("draining: %d requests open, up to %g s", len(self.scheduler.tickets) + len(self.scheduler.queue), seconds)
        while (self.scheduler.intake.busy or self.open) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.scheduler.intake.busy:
            left = len(self.scheduler.tickets) + len(self.scheduler.queue)
            log.warning("draining: ending %d requests still open after %g s", left, seconds)
            self.scheduler.intake.abort(f"the server is shutting down: this request was still running after its "
                                 f"--drain-seconds ({seconds:g} s) and was ended")
        deadline = loop.time() + LAST_EVENTS_SECONDS
        while self.open and loop.time() < deadline:
            await asyncio.sleep(0.02)


def server_config(app, forwarded_allow_ips: str | None = None, **options) -> uvicorn.Config:
    """uvicorn's settings for ``app``: ``options`` (host, port, ssl_*, root_path ...) as uvicorn takes them; proxy
    headers believed only from ``forwarded_allow_ips`` (None: from nobody); half-closed connections answered."""
    return uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                          proxy_headers=forwarded_allow_ips is not None, forwarded_allow_ips=forwarded_allow_ips,
                          http=_answering_half_closed(), **options)


PROBES = (0.0, 0.0, 0.01, 0.05, 0.25, 1.0, 5.0, 30.0)  # seconds between "100 Continue"s to a client that stopped sending
# (on loopback a gone client's reset is back before the next turn of the loop; across a network after a round trip)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _answering_half_closed() -> type:
    """uvicorn's HTTP protocol, keeping a connection whose client has stopped sending open until the request in
    flight has been answered, then closing it (there can be no next request).

    A client that half-closed and one that went away look alike (end of input) until something is written to them:
    a gone client's host answers a write with a reset, and the next write fails, which ends its request (freed
    within one cycle, as any disconnect). So while the answer is not begun, an HTTP/1.1 client is sent
    ``100 Continue`` now and then (``PROBES``): every HTTP/1.1 client skips 1xx answers it did not ask for
    (RFC 9110 15.2), so a client still reading sees only its answer."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class AnsweringHalfClosed(AutoHTTPProtocol):
        peer_done = False

        def eof_received(self):
            self.peer_done = True
            if not self._awaiting_answer():
                return None
            self._probe(0)
            return True  # keep writing: the answer is still to come

        def _awaiting_answer(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_started and not cycle.disconnected \
                and not self.transport.is_closing()

        def _probe(self, index: int) -> None:
            if not self._awaiting_answer() or self.cycle.scope.get("http_version") != "1.1":
                return
            self.transport.write(CONTINUE)
            self.loop.call_later(PROBES[min(index + 1, len(PROBES) - 1)], self._probe, index + 1)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.peer_done:
                self.transport.close()

    return AnsweringHalfClosed


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains (``Lifecycle.drain``) before it stops, and exits
    with status 0 when the drain ends; a second signal stops it at once, as uvicorn would."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_seconds: float):
        super().__init__(config)
        self.lifecycle, self.drain_seconds = lifecycle, drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_begun = False
        self._drain: asyncio.Task | None = None
        self.cut_short = False  # a second signal stopped the server before its drain ended

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_begun:  # the second signal: stop now (exit 1 if the drain had not ended), not by the signal
            self.cut_short = self.cut_short or not self.should_exit
            self.should_exit = self.force_exit = True
            return None
        if self._drain_begun or self._loop is None or self.should_exit:
            return super().handle_exit(sig, frame)
        self._drain_begun = True  # nothing more here: a signal handler may interrupt the loop's thread anywhere
        self._loop.call_soon_threadsafe(self._begin_drain, signal.Signals(sig).name)

    def _begin_drain(self, name: str) -> None:
        log.info("%s: draining for up to %g s (a second signal stops at once)", name, self.drain_seconds)
        self._drain = asyncio.ensure_future(self.lifecycle.drain(self.drain_seconds))
        self._drain.add_done_callback(lambda _: setattr(self, "should_exit", True))
