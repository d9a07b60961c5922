"""Pure ASGI middleware in front of the routes: request ids and the access log, the API key, the body limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that each counts and refuses before anything reads the
body, and so that a route still sees the client's disconnect on ``receive``. ASGI's first argument (its "scope": one
connection's dict) is called ``connection`` here; a scope in this package is whose texts a request shares.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable

from ..values import short
from .errors import ApiError

access_log = logging.getLogger("specdeploy.serve.access")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # a client's X-Request-Id is echoed only when it looks like one
OPEN_PATHS = ("/health", "/health/live", "/health/ready", "/metrics")  # probes and scrapers need no key


def route_path(connection) -> str:
    """The path the routes see: without the --root-path prefix a proxy may have left on it."""
    path, root = connection["path"], connection.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def log_field(value, limit: int = 200) -> str:
    """``value`` as one field of a log line: cut to ``limit`` characters, and every character a reader or a log
    parser could take for structure (control characters, newlines, spaces, quotes, backslashes, non-ASCII) escaped,
    so that no client-chosen text (a path, a forwarded address) can forge a field or a line."""
    text = str(value)
    cut = text[:limit].encode("unicode_escape").decode("ascii").replace('"', "\\x22").replace(" ", "\\x20")
    return cut if len(text) <= limit else f"{cut}...({len(text):,}chars)"


def header(connection, name: bytes) -> str | None:
    for key, value in connection["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class RequestLog:
    """Gives each request an id (the client's ``X-Request-Id`` when it sends a sane one), echoes it on the
    response, and writes one access-log line per request once its response has ended:
    ``client "METHOD path HTTP/v" status seconds request_id=...``. ``observe(path, status)`` counts responses."""

    def __init__(self, app, observe: Callable[[str, int], None]):
        self.app, self.observe = app, observe

    async def __call__(self, connection, receive, send):
        if connection["type"] != "http":
            return await self.app(connection, receive, send)
        asked = header(connection, b"x-request-id")
        request_id = asked if asked and REQUEST_ID.fullmatch(asked) else uuid.uuid4().hex
        connection.setdefault("state", {})["request_id"] = request_id  # the route's request.state
        began, status = time.perf_counter(), 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(connection, receive, sending)
        finally:
            path = route_path(connection)
            self.observe(path, status)
            client = connection.get("client") or ("-", 0)
            access_log.info('%s:%s "%s %s HTTP/%s" %d %.3fs request_id=%s', log_field(client[0], 64), log_field(client[1]),
                            log_field(connection["method"], 16), log_field(path), log_field(connection.get("http_version", "1.1")),
                            status, time.perf_counter() - began, request_id)


class ApiKey:
    """Every path but the health probes and /metrics needs ``Authorization: Bearer <key>``; compared in
    constant time (``hmac.compare_digest``), so the answer's timing says nothing of how much of a key was right."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, connection, receive, send):
        if connection["type"] != "http" or route_path(connection) in OPEN_PATHS:
            return await self.app(connection, receive, send)
        given = header(connection, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
            said = "no Authorization header" if not given else "a wrong key" if scheme.lower() == "bearer" else \
                "an Authorization header that is not 'Bearer <key>'"
            error = ApiError(401, f"Authorization: got {said}; expected 'Bearer <this server's --api-key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error.send(send)
        await self.app(connection, receive, send)


class BodyLimit:
    """Refuses a body over ``limit`` bytes with 413 before any of it is parsed: from its Content-Length before
    reading a byte of it, and, whatever the transfer encoding (chunked included), as soon as the bytes actually
    read pass the limit. The body is read here, at most ``limit`` bytes of it, and handed on whole.

    A refused body that is on its way is read and dropped, chunk by chunk (never held), up to ``DRAIN_LIMIT``:
    clients that close their connection after a request (urllib sends ``Connection: close``) would otherwise
    get a reset instead of the 413, the server closing with their bytes unread. A client that asked
    ``Expect: 100-continue`` has sent nothing: it is answered at once, and never sends the body."""

    DRAIN_LIMIT = 64 * 2**20

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, connection, receive, send):
        if connection["type"] != "http" or connection["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(connection, receive, send)
        declared = header(connection, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            if (header(connection, b"expect") or "").lower() != "100-continue":
                await self._drain(receive, 0)
            return await self._refuse(send, f"Content-Length: got {short(declared, 40, quoted=False)} bytes")
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                if more:
                    await self._drain(receive, len(body))
                return await self._refuse(send, f"the body: got more than {self.limit:,} bytes (sent in chunks)")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # the body has been handed on: what comes next is the client's disconnect
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(connection, replay, send)

    async def _drain(self, receive, read: int) -> None:
        while read <= self.DRAIN_LIMIT:
            message = await receive()
            read += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return

    async def _refuse(self, send, got: str) -> None:
        await ApiError(413, f"{got}; this server takes bodies of at most {self.limit:,} bytes (--max-body-bytes)",
                       code="body_too_large").send(send)
