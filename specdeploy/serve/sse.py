"""Server-Sent Events, and noticing a client that goes away.

The HTTP server (uvicorn) drops what is sent to a client that has gone, without an error: a request learns
of it only from ``receive``, which yields ``http.disconnect``. ``watch_disconnect`` listens for it while a
request runs, streamed or not, so that its rows are freed at once (``Scheduler.cancel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

PING_SECONDS = 15.0  # a comment line this often keeps proxies from closing an idle stream


def event(payload: dict | str) -> bytes:
    """One Server-Sent Event: ``data: <JSON>`` (or a bare string, for ``[DONE]``)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


PING = b": ping\n\n"


@contextlib.asynccontextmanager
async def watch_disconnect(receive, gone: Callable[[], None]):
    """Calls ``gone()`` if the client disconnects while the block runs (the request's body was read already)."""

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone()

    watcher = asyncio.ensure_future(listen())
    try:
        yield
    finally:
        watcher.cancel()


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response of the byte chunks ``events`` yields; ``gone()`` runs if the client leaves."""

    def __init__(self, events: AsyncIterator[bytes], gone: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         media_type="text/event-stream")
        self.events, self.gone = events, gone

    async def __call__(self, connection, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with watch_disconnect(receive, self.gone):
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
