"""The OpenAI-compatible HTTP API over a scheduler: completions, chat, models, health, metrics.

Errors have OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 for a bad request
(naming the field), 404 for an unknown model, 413 for a body over the limit, 429 with Retry-After when
the queue is full. Streams are Server-Sent Events ending in ``data: [DONE]``; a client that goes away
mid-stream is cancelled and its cache rows are freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from ..runtime.cache import CapacityError
from ..runtime.config import ConfigError
from ..runtime.streaming import TextStream
from ..runtime.telemetry import FinishReason
from .metrics import ServerMetrics
from .protocol import OPENAI_NAMES, ChatRequest, CompletionRequest, Sampling
from .scheduler import Overloaded, Scheduler, Ticket

DRAIN_LIMIT = 64 * 2**20
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code, self.headers = status, message, param, kind, code, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def create_app(pipeline, scheduler: Scheduler, model: str, default_max_tokens: int = 256,
               max_body_bytes: int = 4 * 2**20) -> FastAPI:
    app = FastAPI(title="specdeploy", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(scheduler)
    scheduler.on_finish = metrics.finished
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.refused(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        metrics.refused(400)
        first = exc.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", None).response()
        got = first.get("input")
        got = f"; got {_short(got)}" if "input" in first and first.get("type") != "missing" else ""
        return ApiError(400, f"{'.'.join(where) or 'body'}: {first.get('msg')}{got}", ".".join(where) or None).response()

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            metrics.refused(413)
            drained = 0  # read what was sent (up to a bound) so that the client sees the answer, not a reset
            async for part in request.stream():
                drained += len(part)
                if drained > DRAIN_LIMIT:
                    break
            return ApiError(413, f"the body is {length} bytes, over this server's limit of {max_body_bytes} bytes",
                            None).response()
        return await call_next(request)

    server_id = uuid.uuid4().hex[:12]  # tells replicas apart behind a load balancer

    @app.get("/health")
    async def health():
        return {"status": "ok", "rows": scheduler.rows, "queued": len(scheduler.queue), "server": server_id}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specdeploy"}]}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = _encode(lambda: pipeline.encode(body.prompt))
        return await _serve(body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        prompt = _encode(lambda: np.array(pipeline.chat_prompt(messages), np.int64))
        return await _serve(body, prompt, chat=True)

    async def _serve(body: Sampling, prompt: np.ndarray, chat: bool):
        if body.model != model:
            raise ApiError(404, f"model: got {body.model!r}; this server serves {model!r} (GET /v1/models)", "model",
                           code="model_not_found")
        refused = body.unsupported(scheduler.config)
        if refused is not None:
            raise ApiError(400, f"{refused[0]}: {refused[1]}", refused[0])
        try:
            config = body.generation_config(scheduler.config, default_max_tokens)
            ticket = scheduler.submit(prompt, config, asyncio.get_running_loop())
        except ConfigError as exc:
            field = str(exc).split(":", 1)[0]
            name = OPENAI_NAMES.get(field, field)
            raise ApiError(400, str(exc).replace(field, name, 1), name) from None
        except CapacityError as exc:
            raise ApiError(400, str(exc), "max_tokens", code="context_length_exceeded") from None
        except Overloaded as exc:
            raise ApiError(429, str(exc), None, kind="rate_limit_error", code="overloaded",
                           headers={"Retry-After": str(int(np.ceil(exc.retry_after)))}) from None
        response = _Response(pipeline, body, ticket, chat, model)
        if body.stream:
            return EventSourceResponse(response.chunks(scheduler), ping=15)
        return await response.whole(scheduler)

    return app


def _encode(encode) -> np.ndarray:
    try:
        return encode()
    except ConfigError as exc:
        raise ApiError(400, str(exc), "prompt") from None
    except Exception as exc:  # the chat template raised (e.g. a role order it refuses)
        raise ApiError(400, f"messages: {exc}", "messages") from None


class _Response:
    """One request's answer, whole or as chunks, in the completions or chat shape."""

    def __init__(self, pipeline, body: Sampling, ticket: Ticket, chat: bool, model: str):
        self.pipeline, self.body, self.ticket, self.chat, self.model = pipeline, body, ticket, chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.first_token: float | None = None

    async def whole(self, scheduler: Scheduler) -> JSONResponse:
        try:
            while True:
                kind, payload = await self.ticket.events.get()
                if kind == "done":
                    break
                if kind == "error":
                    raise ApiError(500, payload, None, kind="server_error")
                self.first_token = self.first_token or time.perf_counter()
        except asyncio.CancelledError:
            scheduler.cancel(self.ticket)
            raise
        result = self._result(payload)
        choice = {"index": 0, "finish_reason": FINISH.get(result.finish_reason, "stop"), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": [choice],
                             "usage": self._usage(result), "speculative": self._speculative(result)})

    async def chunks(self, scheduler: Scheduler):
        text, finished = TextStream(self.pipeline.tokenizer, self.ticket.config.stop), False
        try:
            if self.chat:
                yield _event(self._chunk({"role": "assistant", "content": ""}, None))
            while True:
                kind, payload = await self.ticket.events.get()
                if kind == "tokens":
                    self.first_token = self.first_token or time.perf_counter()
                    delta = text.push(payload)
                    if delta:
                        yield _event(self._chunk(delta, None))
                    continue
                finished = True
                if kind == "done" and payload.finish_reason == FinishReason.ERROR:
                    kind, payload = "error", f"the request failed while decoding: {payload.error}"
                if kind == "error":
                    yield _event({"error": {"message": payload, "type": "server_error"}})
                    return
                result = self._result(payload)
                final = self._chunk(text.finish(result.text), FINISH.get(result.finish_reason, "stop"))
                yield _event({**final, "speculative": self._speculative(result)})
                if self.body.stream_options is not None and self.body.stream_options.include_usage:
                    yield _event({**self._chunk("", None), "choices": [], "usage": self._usage(result)})
                yield {"data": "[DONE]"}
                return
        finally:
            if not finished:  # the client went away: free its row now
                scheduler.cancel(self.ticket)

    def _chunk(self, text, finish_reason) -> dict:
        if self.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def _result(self, row):
        if row.finish_reason == FinishReason.ERROR:
            raise ApiError(500, f"the request failed while decoding: {row.error}", None, kind="server_error")
        return self.pipeline.result(row, self.ticket.config)

    @staticmethod
    def _usage(result) -> dict:
        prompt = int(result.stats["prompt_tokens"])
        return {"prompt_tokens": prompt, "completion_tokens": len(result.token_ids),
                "total_tokens": prompt + len(result.token_ids)}

    def _speculative(self, result) -> dict:
        """What speculation did for this request (llama.cpp's server reports draft_n / draft_n_accepted)."""
        records = result.records
        k = max((r.k for r in records), default=0)
        by_position = [sum(r.accepted >= i for r in records) for i in range(1, k + 1)]
        stats = result.stats
        queued = (self.first_token - self.ticket.submitted) if self.first_token else None
        return {"drafted_tokens": int(sum(r.k for r in records)), "accepted_tokens": int(sum(r.accepted for r in records)),
                "accepted_by_position": by_position, "cycles": len(records),
                "mean_accepted_length": _finite(stats["mean_accepted_length"]),
                "decode_tokens_per_s": _finite(stats["tokens_per_s"]), "prefill_s": _finite(stats["prefill_s"]),
                "first_token_s": _finite(queued)}


def _event(payload: dict) -> dict:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    return {"data": json.dumps(payload)}


def _finite(value):
    return None if value is None or not np.isfinite(value) else round(float(value), 6)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
