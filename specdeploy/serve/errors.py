"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, from routes and middleware alike."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..values import short

# OpenAI's error types by status (the openai client picks its exception class by status, these are for people)
KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
         503: "service_unavailable_error"}


class ApiError(Exception):
    """A request answered with an error: ``status``, a message naming the field (``param``) and what was wrong."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or KINDS.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send) -> None:
        """Answer with this error from ASGI middleware (before any route runs)."""
        body = json.dumps(self.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(name.lower().encode(), value.encode()) for name, value in (self.headers or {}).items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def install(app, routes: str) -> None:
    """OpenAI-shaped answers for what FastAPI and Starlette would answer in their own shape: an unknown path
    (404), a method a path does not take (405), and any unexpected exception (500). ``routes`` lists the
    paths served, for the 404's message."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        path = short(request.url.path)
        if exc.status_code == 404:
            return ApiError(404, f"no route {request.method} {path}; this server serves {routes}", code="not_found").response()
        if exc.status_code == 405:
            allowed = exc.headers.get("Allow", "") if exc.headers else ""
            return ApiError(405, f"method {request.method} is not allowed on {path}; expected {allowed or 'another'}",
                            code="method_not_allowed", headers=exc.headers).response()
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        return ApiError(500, f"the server failed: {type(exc).__name__}: {short(str(exc), 200)}", kind="server_error").response()
