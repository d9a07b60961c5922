"""The OpenAI-compatible HTTP API over a scheduler: completions, chat, models, health probes, metrics.

Every error has OpenAI's shape ({"error": {"message", "type", "param", "code"}}), from the middleware
(401 without the API key, 413 for a body over the limit) to the routes (400 naming the field, 404 for an
unknown model or path, 405, 415 for a body that is not JSON, 429 with Retry-After when the queue is full,
500 naming the artifact's chat template when it fails, 503 while draining). Prompts are made off the event
loop (``prompts``), so that no request's template or tokenization holds up the others. Streams are
Server-Sent Events ending in ``data: [DONE]``; a client that goes away, streaming or not, is cancelled and
its cache rows are freed on the scheduler's next turn.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import make_asgi_app
from pydantic import BaseModel, ValidationError
from starlette.routing import Route

from ..runtime.cache import CapacityError
from ..runtime.chat import ChatTemplateError, TemplateTimeout
from ..runtime.config import ConfigError
from ..values import short
from . import errors
from .breaker import Breaker, TemplateBroken
from .errors import ApiError
from .lifecycle import Lifecycle
from .metrics import METRIC_LABELS, ServerMetrics
from .middleware import ApiKey, BodyLimit, RequestLog
from .prompts import PromptTimeout, PromptWorkers
from .protocol import ChatRequest, CompletionRequest, Sampling
from .responses import Reply, refusal
from .scheduler import Overloaded, Scheduler, ShuttingDown
from .scopes import ScopeOf, key_scope, suffix_scopes
from .sse import EventStream, watch_disconnect

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/health/live", "/health/ready", "/metrics")


def create_app(pipeline, scheduler: Scheduler, model: str, default_max_tokens: int | None = None,
               max_body_bytes: int = 4 * 2**20, api_key: str | None = None, allowed_origins: Sequence[str] = (),
               template_seconds: float = 10.0, suffix_scope: str = "key",
               identity: dict[str, str] | None = None) -> FastAPI:
    """The server's ASGI app. ``default_max_tokens``: a request without max_tokens gets this many at most (None:
    the room its prompt leaves in the context); ``api_key``: every route but the probes and /metrics needs it;
    ``allowed_origins``: browsers' cross-origin requests allowed from these (CORS); ``template_seconds``: the CPU
    time a chat template may use before the request is answered with a 500 (wall time only as a backstop);
    ``suffix_scope``: whose earlier answers a request drafts from (``scopes.SCOPES``: per API key by default; its K/V
    are kept per key unless ``global``);
    ``identity``: who answers, one of several replicas (``ray_app.replica_identity``: replica, node, ...): the probes
    say it, and every metric is labelled with its ``replica`` and ``node``. Without one, the probes give this host's
    name as ``node`` and the metrics have no such labels (a scraper labels its one target itself)."""
    app = FastAPI(title="specdeploy", docs_url=None, redoc_url=None, openapi_url=None)
    labels = {name: identity[name] for name in METRIC_LABELS if name in identity} if identity is not None else {}
    identity = identity if identity is not None else {"node": socket.gethostname()}
    metrics = ServerMetrics(scheduler, model, ROUTES, labels)
    scheduler.on_finish = metrics.finished
    lifecycle = Lifecycle(scheduler, _warm_template(pipeline))
    app.state.scheduler, app.state.metrics, app.state.lifecycle = scheduler, metrics, lifecycle
    errors.install(app, ", ".join(ROUTES))
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(RequestLog, observe=metrics.responded)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    app.router.routes.append(Route("/metrics", _Asgi(make_asgi_app(metrics.served)), methods=["GET"]))
    api = Api(pipeline, scheduler, lifecycle, model, default_max_tokens, PromptWorkers(template_seconds),
              suffix_scopes(pipeline.suffix_store, suffix_scope), template_seconds, identity)
    for path in ("/health", "/health/ready"):
        app.get(path)(api.ready)
    app.get("/health/live")(api.live)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    return app


class Api:
    """The routes' handlers over one scheduler: probes, the model list, completions and chat completions."""

    def __init__(self, pipeline, scheduler: Scheduler, lifecycle: Lifecycle, model: str, default_max_tokens: int | None,
                 workers: PromptWorkers, scope_of: ScopeOf, template_seconds: float, identity: dict[str, str]):
        self.pipeline, self.scheduler, self.lifecycle, self.model = pipeline, scheduler, lifecycle, model
        self.default_max_tokens, self.workers, self.scope_of = default_max_tokens, workers, scope_of
        self.template_seconds = template_seconds
        self.template_breaker = Breaker()  # renders of a template that keeps running past its limit: refused at once
        self.server_id = uuid.uuid4().hex[:12]  # tells replicas apart behind a load balancer
        self.identity = identity  # read at each probe: a replica adds where its metrics are served once it knows

    async def ready(self):
        status = self.lifecycle.status()
        body = {"status": status, "rows": self.scheduler.row_count, "queued": len(self.scheduler.queue),
                "server": self.server_id, **self.identity}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def live(self):
        return {"status": "alive", "server": self.server_id, **self.identity}

    async def models(self):
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "specdeploy",
                                            "max_model_len": self.scheduler.capacity}]}

    async def completions(self, request: Request):
        body = await _parse(request, CompletionRequest)
        self._check(body)
        prompts = await _prepare(self.workers, lambda: [self.pipeline.encode(p) for p in body.prompts()], "prompt",
                                 "tokenizing the prompt", _client(request))
        return await self._serve(request, body, prompts, chat=False)

    async def chat(self, request: Request):
        body = await _parse(request, ChatRequest)
        self._check(body)
        messages, tools = body.template_messages(), body.template_tools()
        prompt = await _prepare(self.workers, lambda: np.array(self.pipeline.chat_prompt(
            messages, tools=tools, time_limit=self.template_seconds), np.int64), "messages", "the artifact's chat template",
            _client(request), self.template_breaker)
        return await self._serve(request, body, [prompt], chat=True)

    def _check(self, body: Sampling) -> None:
        """What can be refused before any prompt is made: the model's name, what this server does not do (a drain,
        and whether a prompt fits, the intake refuses: ``Intake.submit_choices``)."""
        if body.model != self.model:
            raise ApiError(404, f"model: got {short(body.model)}; this server serves {self.model!r} (GET /v1/models)",
                           "model", code="model_not_found")
        refused = body.unsupported(self.scheduler.config)
        if refused is not None:
            raise ApiError(400, f"{refused[0]}: {refused[1]}", refused[0])

    def _choices(self, body: Sampling, prompts: list[np.ndarray]) -> list:
        """(prompt, settings) of each choice of the request: as many new tokens as asked, else the room each prompt
        leaves (at most ``default_max_tokens``), as vLLM does; at least one, so that a prompt that leaves no room is
        refused where every request's room is checked (the intake's runtime check)."""
        scheduler, asked = self.scheduler, body.requested_max_tokens()
        seed = body.seed if body.seed is not None else scheduler.intake.next_seed()
        choices = []
        for prompt in prompts:
            room = scheduler.intake.room(len(prompt))
            new = asked or max(1, min(room, self.default_max_tokens or room))
            choices += [(prompt, config) for config in body.generation_configs(scheduler.config, new, seed)]
        return choices

    async def _serve(self, request: Request, body: Sampling, prompts: list[np.ndarray], chat: bool):
        scheduler, lifecycle = self.scheduler, self.lifecycle
        try:
            tickets = scheduler.intake.submit_choices(self._choices(body, prompts), asyncio.get_running_loop(),
                                                      body.top_logprobs_count(), *self.scope_of(request.headers))
        except (ConfigError, CapacityError, Overloaded, ShuttingDown) as exc:
            raise refusal(exc, "messages" if chat else "prompt") from None
        lifecycle.open += 1

        def closed(unfinished) -> None:
            lifecycle.open -= 1
            if unfinished:  # a stream that failed, or a client that left: nobody will read them
                scheduler.intake.cancel(unfinished)

        reply = Reply(self.pipeline, body, tickets, chat, self.model, getattr(request.state, "request_id", ""),
                      closed)
        if body.stream:
            return EventStream(reply.chunks(), lambda: scheduler.intake.cancel(tickets))
        async with watch_disconnect(request.receive, lambda: scheduler.intake.cancel(tickets)):
            return await reply.whole()


async def _parse(request: Request, model: type[BaseModel]):
    """The body as ``model``: JSON (any other declared Content-Type is refused with 415), parsed and checked by
    pydantic in one pass (its parser stops at 200 levels of nesting: a 100,000-deep body is a 400, not a crash)."""
    kind = request.headers.get("content-type")
    media = (kind or "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"Content-Type: got {short(kind, 60)}; expected application/json "
                       "(with curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    where = [str(part) for part in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    if not where:
        return ApiError(400, f"the body: {first.get('msg')}; expected a JSON object of the request's fields")
    got = f"; got {short(first['input'], 60)}" if "input" in first and first.get("type") != "missing" else ""
    return ApiError(400, f"{'.'.join(where)}: {first.get('msg')}{got}", where[0])


async def _prepare(workers: PromptWorkers, job: Callable, param: str, what: str, client: tuple[str, str],
                   breaker: Breaker | None = None):
    """``job()`` (a prompt's tokens) off the event loop, in ``client``'s turn. The client's own mistakes
    (``ConfigError``) are a 400 naming ``param`` (or ``tools``, where the template failed on them); anything else,
    or running past the time limit, is ``what``'s (the artifact's) fault: a 500. ``breaker``: counts the jobs that run
    past their limit; while it is open they are refused at once (503, Retry-After)."""
    try:
        trial = breaker.check() if breaker is not None else False
    except TemplateBroken as exc:
        raise ApiError(503, str(exc), kind="server_error", code="chat_template_unavailable",
                       headers={"Retry-After": f"{exc.retry_after:.0f}"}) from None
    timed_out = None  # unknown while the job runs: a request that goes away (cancelled) leaves it so
    try:
        result = await workers.run(job, client)
        timed_out = False
        return result
    except Exception as exc:
        timed_out = isinstance(exc, (TemplateTimeout, PromptTimeout))
        raise _failed(exc, param, what) from None
    finally:
        if breaker is not None:
            breaker.settle(timed_out, trial)


def _failed(exc: Exception, param: str, what: str) -> ApiError:
    """How a prompt job's exception is answered: the client's 400, or the artifact's (or this server's) 500."""
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc), "tools" if str(exc).startswith("tools:") else param)
    if isinstance(exc, TemplateTimeout):  # CPU time the template itself used: a busy machine is not counted
        return ApiError(500, f"{what} did not finish within {exc.seconds:g} s of CPU time (--template-seconds): "
                        f"{short(str(exc), 300, quoted=False)}", kind="server_error", code="prompt_timeout")
    if isinstance(exc, PromptTimeout):
        return ApiError(500, f"{what} {exc} (a limit of this server)", kind="server_error", code="prompt_timeout")
    if isinstance(exc, ChatTemplateError):  # the artifact's template failed on its own or overran its limits
        return ApiError(500, f"{what} failed: {short(str(exc), 300, quoted=False)}", kind="server_error",
                        code="chat_template_error")
    # anything else making the prompt: a fault of this server's, never the client's
    return ApiError(500, f"{what} failed: {type(exc).__name__}: {short(str(exc), 300, quoted=False)}",
                    kind="server_error", code="chat_template_error" if param == "messages" else "prompt_error")


def _client(request: Request) -> tuple[str, str]:
    """Whose turn a prompt job waits for: the client's address (as believed: see ``lifecycle.server_config``), and
    who it is at that address (clients behind one NAT or proxy share it): the hash of the bearer token it presents
    (``scopes.key_scope``), or without one its connection."""
    address = request.client.host if request.client else ""
    who = key_scope(request.headers.get("authorization", ""))
    if who == "anonymous" and request.client:
        who = f"connection:{request.client.port}"
    return address, who


def _warm_template(pipeline) -> Future:
    """Compile the chat template before the server says it is ready (its first render compiles it)."""
    warmed: Future = Future()

    def warm() -> None:
        try:
            pipeline.chat_template.render([{"role": "user", "content": "hello"}])
        except Exception:  # a template may refuse this conversation (or there is none): compiled all the same
            pass
        warmed.set_result(None)

    threading.Thread(target=warm, name="specdeploy-template", daemon=True).start()
    return warmed


class _Asgi:
    """An ASGI app as a route's endpoint (Starlette takes a plain function for a request/response handler)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, connection, receive, send):
        await self.app(connection, receive, send)
