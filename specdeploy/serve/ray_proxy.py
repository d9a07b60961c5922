"""Ray Serve's HTTP proxy, told to answer a request whose replica was lost: never a silent cut.

When a replica dies with requests in flight (its node went away, or Ray killed it at the end of a scale-down's
drain), Ray's proxy logs the error and ends the request with nothing more: a client that was still waiting for the
response's start gets a bare "Internal Server Error", and one that was reading a stream sees the connection close
mid-stream. ``LostReplica`` wraps the proxy's ASGI app and finishes such responses as the server itself ends a request
it cannot serve: before the response has started, a 503 in OpenAI's error shape (``code: replica_lost``) with
``Retry-After``, which OpenAI's clients retry; a stream cut short gets an error event with the same code, then
``data: [DONE]``. A replica's own answers, errors included, pass through untouched.

Ray reads the proxy's middlewares from the environment of the node the proxy runs on:
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specdeploy.serve.ray_proxy:middlewares`` (set it where ``ray start``
runs; ``specdeploy serve --ray-replicas`` sets it for the Ray instance it starts).
"""

from __future__ import annotations

from starlette.middleware import Middleware

from .errors import ApiError
from .sse import event

CALLBACK = "specdeploy.serve.ray_proxy:middlewares"
CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
RETRY_AFTER_SECONDS = 1
LOST = ("the replica serving this request was lost (its node went away, or it was stopped) before it answered; "
        "nothing was generated for you that you did not receive: retry the request")
CUT = ("the replica serving this stream was lost (its node went away, or it was stopped) after the text above; the "
       "stream is incomplete: retry the request")


def middlewares() -> list[Middleware]:
    """What Ray's proxy calls (``CALLBACK``): the middlewares it wraps its ASGI app in."""
    return [Middleware(LostReplica)]


def lost(message: str) -> ApiError:
    return ApiError(503, message, code="replica_lost", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class LostReplica:
    """ASGI middleware: a response the app left unstarted becomes a 503 ``replica_lost``; one it left unfinished ends
    with an error event (Server-Sent Events) or, for any other body, is closed where it stopped (its length is wrong
    either way, and the client's HTTP library reports it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, finished, events = False, False, False

        async def watched(message) -> None:
            nonlocal started, finished, events
            if message["type"] == "http.response.start":
                started = True
                headers = {key.lower(): value for key, value in message.get("headers", ())}
                events = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        await self.app(scope, receive, watched)
        if not started:
            await lost(LOST).send(send)
        elif not finished:
            tail = event(lost(CUT).body()) + event("[DONE]") if events else b""
            await send({"type": "http.response.body", "body": tail})
