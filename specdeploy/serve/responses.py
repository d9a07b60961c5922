"""One request's answer, from the events its choices' tickets receive: whole, or as Server-Sent Events, in the
completions or the chat shape, with usage, logprobs and what speculation did (``speculative``).

A stream always ends with a final event: each choice's last chunk (with its ``finish_reason``), then
``[DONE]``; a request that fails or that the server ends early (a drain) gets an error event before
``[DONE]``, never a silent cut. ``finish_reason`` is OpenAI's (``stop``, ``length``), or ``abort`` (vLLM's)
for a choice the server's drain ended.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
from fastapi.responses import JSONResponse

from ..runtime.cache import CapacityError
from ..runtime.config import ConfigError
from ..runtime.decoder import RowResult
from ..runtime.streaming import TextStream
from ..runtime.telemetry import FinishReason, mean_accepted_length
from .errors import ApiError
from .logprobs import Formatter, TokenLogprob
from .protocol import OPENAI_NAMES, Sampling
from .sse import PING, PING_SECONDS, event
from .tickets import Event, Overloaded, ShuttingDown, Ticket

FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def refusal(exc: Exception, prompt: str = "prompt") -> ApiError:
    """The answer to a request the server or the runtime refused with ``exc``; ``prompt``: the field the request's
    prompt came in (``messages`` for a chat)."""
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), code="shutting_down")
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), code="overloaded", headers={"Retry-After": str(int(np.ceil(exc.retry_after)))})
    if isinstance(exc, CapacityError):  # the prompt alone leaves no room, or the answer asked for does not fit
        return ApiError(400, str(exc), prompt if exc.field == "prompt" else "max_tokens", code="context_length_exceeded")
    if isinstance(exc, ConfigError):
        field = str(exc).split(":", 1)[0]
        name = OPENAI_NAMES.get(field, field.split(" ")[0])
        return ApiError(400, str(exc).replace(field, OPENAI_NAMES.get(field, field), 1), name)
    return ApiError(500, f"the request failed: {type(exc).__name__}: {exc}", kind="server_error")


class Reply:
    """The answer to one request whose choices run as ``tickets`` (choice i is ``tickets[i]``; for a list of
    prompts, prompt p's n choices are p * n .. p * n + n - 1). ``closed(unfinished tickets)`` runs once it ends."""

    def __init__(self, pipeline, body: Sampling, tickets: list[Ticket], chat: bool, model: str, request_id: str,
                 closed: Callable[[list[Ticket]], None]):
        self.pipeline, self.body, self.tickets, self.chat, self.model = pipeline, body, tickets, chat, model
        self.events: asyncio.Queue = tickets[0].events
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.finished: dict[int, RowResult] = {}  # each finished choice's result, by choice
        self.formatter = Formatter(pipeline.tokenizer)
        self._closed = closed

    def _close(self) -> None:
        self._closed([t for t in self.tickets if t.choice not in self.finished])

    async def whole(self) -> JSONResponse:
        entries: dict[int, list[TokenLogprob]] = {t.choice: [] for t in self.tickets}
        try:
            while len(self.finished) < len(self.tickets):
                got: Event = await self.events.get()
                if got.kind == "tokens":
                    entries[got.choice] += got.logprobs or []
                elif got.kind == "error":
                    raise refusal(got.payload)
                else:
                    self.finished[got.choice] = got.payload
        finally:
            self._close()
        for ticket in self.tickets:
            row = self.finished[ticket.choice]
            if ticket.ended_by:
                raise ApiError(503, ticket.ended_by, code="shutting_down")
            if row.finish_reason == FinishReason.CANCELLED:  # nobody is listening: for the access log
                raise ApiError(499, "the client closed the request", code="client_closed")
            if row.finish_reason == FinishReason.ERROR:
                raise ApiError(500, f"the request failed while decoding: {row.error}", kind="server_error")
        results = {t.choice: self.pipeline.result(self.finished[t.choice], t.config) for t in self.tickets}
        choices = []
        for choice, result in results.items():
            logprobs = self._logprobs(entries[choice])
            reason = FINISH.get(result.finish_reason, "stop")
            if self.chat:
                message = {"role": "assistant", "content": result.text, "refusal": None}
                choices.append({"index": choice, "message": message, "finish_reason": reason, "logprobs": logprobs})
            else:
                choices.append({"index": choice, "text": result.text, "finish_reason": reason, "logprobs": logprobs})
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": choices,
                             "usage": self._usage(), "speculative": speculative(self.tickets, self.finished)})

    async def chunks(self) -> AsyncIterator[bytes]:
        texts = {t.choice: TextStream(self.pipeline.tokenizer, t.config.stop) for t in self.tickets}
        shown = dict.fromkeys(texts, 0)  # characters of each choice's token texts so far (completions' text_offset)
        ended_by = ""
        try:
            if self.chat:
                for choice in texts:
                    yield event(self._chunk(choice, {"role": "assistant", "content": ""}, None))
            while len(self.finished) < len(self.tickets):
                try:
                    got: Event = await asyncio.wait_for(self.events.get(), PING_SECONDS)
                except asyncio.TimeoutError:
                    yield PING
                    continue
                if got.kind == "tokens":
                    piece = self._tokens(got, texts[got.choice], shown)
                    if piece is not None:
                        yield piece
                    continue
                if got.kind == "error":
                    yield event(refusal(got.payload).body())
                    break
                ticket, row = self.tickets[got.choice], got.payload
                self.finished[got.choice] = row
                if row.finish_reason == FinishReason.CANCELLED and not ticket.ended_by:
                    return  # the client went away: nobody to tell
                if row.finish_reason == FinishReason.ERROR:
                    yield event(ApiError(500, f"the request failed while decoding: {row.error}", kind="server_error").body())
                    break
                result = self.pipeline.result(row, ticket.config)
                reason = "abort" if ticket.ended_by else FINISH.get(result.finish_reason, "stop")
                ended_by = ended_by or ticket.ended_by
                final = self._chunk(got.choice, texts[got.choice].finish(result.text), reason)
                yield event({**final, "speculative": speculative([ticket], {ticket.choice: row})})
            else:  # async generators cannot ``yield from``
                for piece in self._ending(ended_by):
                    yield piece
            yield event("[DONE]")
        finally:
            self._close()

    def _ending(self, ended_by: str) -> Iterator[bytes]:
        """What follows every choice's last chunk: why the server ended them early, or the usage if asked."""
        if ended_by:
            yield event(ApiError(503, ended_by, code="shutting_down").body())
        elif self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield event({**self._chunk(0, "", None), "choices": [], "usage": self._usage()})

    def _tokens(self, got: Event, text: TextStream, shown: dict[int, int]) -> bytes | None:
        """The chunk of a "tokens" event: its new text and logprobs, if any (``shown`` counts each choice's characters
        so far, for the completions' ``text_offset``)."""
        delta = text.push(got.payload)
        logprobs = self._logprobs(got.logprobs, shown[got.choice])
        if logprobs and not self.chat:
            shown[got.choice] += sum(len(t) for t in logprobs["tokens"])
        return event(self._chunk(got.choice, delta, None, logprobs)) if delta or logprobs else None

    def _chunk(self, choice: int, text: str | dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            item = {"index": choice, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            kind = "chat.completion.chunk"
        else:
            item = {"index": choice, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [item]}

    def _logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        if self.body.top_logprobs_count() is None or not entries:
            return None
        return self.formatter.chat(entries) if self.chat else self.formatter.completion(entries, offset)

    def _usage(self) -> dict:
        """A prompt counts once whatever its n; each choice's tokens count. ``cached_tokens``: prompt tokens whose K/V
        an earlier request of the same scope gave (OpenAI's field; not prefilled)."""
        prompt = sum(len(t.prompt) for t in self.tickets if t.choice % self.body.n == 0)
        cached = sum(row.cached_tokens for choice, row in self.finished.items() if choice % self.body.n == 0)
        completion = sum(len(row.token_ids) for row in self.finished.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def speculative(tickets: list[Ticket], finished: dict[int, RowResult]) -> dict:
    """What speculation did for these choices, as vLLM's counters count it (llama.cpp's server reports draft_n
    / draft_n_accepted): ``drafts`` are the cycles that drafted (plain steps apart), ``mean_accepted_length``
    is 1 + accepted / drafts over them (None without drafts), ``accepted_by_position[i]`` the drafts whose
    token i + 1 was accepted."""
    ran = [finished[t.choice] for t in tickets if t.choice in finished]
    records = [r for row in ran for r in row.records]
    drafted = [r for r in records if r.drafted > 0]
    k = max((r.drafted for r in drafted), default=0)
    decode_seconds = max((row.decode_seconds for row in ran), default=0.0)
    firsts = [t.token_times[0] - t.submitted for t in tickets if t.token_times]
    return {"drafts": len(drafted), "drafted_tokens": sum(r.drafted for r in drafted),
            "accepted_tokens": sum(r.accepted for r in drafted),
            "accepted_by_position": [sum(r.accepted >= i for r in drafted) for i in range(1, k + 1)],
            "cycles": len(records), "mean_accepted_length": _finite(mean_accepted_length(drafted)) if drafted else None,
            "decode_tokens_per_s": _finite(sum(r.committed for r in records) / decode_seconds) if decode_seconds > 0 else None,
            "prefill_s": _finite(max((row.prefill_seconds for row in ran), default=0.0)),
            "first_token_s": _finite(min(firsts)) if firsts else None}


def _finite(value) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), 6)
