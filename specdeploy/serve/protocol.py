"""The OpenAI request bodies this server takes, and how they map onto ``GenerationConfig``.

Fields are strict (no "5" for 5) and unknown fields are refused, so a typo is a 400 naming the field
rather than a silently ignored option; ``null`` means "the default", as OpenAI's API takes it. OpenAI
fields this server cannot honour (JSON mode, audio, ...) are refused by name with the reason
(``unsupported``); bookkeeping fields (``user``, ``metadata``, ``store``, ...) are taken and change nothing.
Speculative extensions ride along in the body (the openai client's ``extra_body``):
``num_speculative_tokens`` caps the request's drafts below the server's k.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..runtime.config import MAX_STOP_CHARS, MAX_STOP_STRINGS, GenerationConfig
from ..values import short
from .errors import ApiError

OPENAI_NAMES = {"max_new_tokens": "max_tokens", "k": "num_speculative_tokens"}  # GenerationConfig -> request
# vLLM takes any number of stop strings of any length; OpenAI 4. Matching costs time in their length and number
# on every token, so both are bounded: MAX_STOP_STRINGS of MAX_STOP_CHARS (GenerationConfig's bounds), a 400 here.
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; vLLM's default --max-logprobs
MAX_CHOICES = 16  # n x prompts of one request: each is a row of the batch


class Body(BaseModel):
    """A strict body in which ``null`` stands for "not given" (clients send it for optional fields)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's padding against side channels: nothing to pad here


class Sampling(Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # bookkeeping: taken, and nothing changes
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    # extensions, as vLLM and llama.cpp's server name them
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """Alternatives to list with each token's logprob; None when no logprobs are asked for."""
        return None

    def choices(self) -> int:
        return self.n

    def generation_configs(self, server: GenerationConfig, max_new_tokens: int, seed: int | None) -> list[GenerationConfig]:
        """Each choice's row settings (``n`` of them); ``server`` holds the batch's speculation (k, drafter,
        policy, exact mode). Choice 0 draws from ``seed`` itself, choice i from a seed derived from (seed, i), so that
        the n choices of a sampled request differ and a seeded request's first choice is as with n = 1."""
        return [GenerationConfig(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, seed=_choice_seed(seed, i), stop=self.stops(),
            ignore_eos=self.ignore_eos, k=server.k if self.num_speculative_tokens is None else self.num_speculative_tokens,
            policy=server.policy, drafter=server.drafter, confidence_threshold=server.confidence_threshold,
            exact=server.exact)
            for i in range(self.n)]

    def unsupported(self, server: GenerationConfig) -> tuple[str, str] | None:
        """(field, why) for a valid-looking request this server does not do; None when it does."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                return name, f"got {getattr(self, name)}; not supported (use repetition_penalty)"
        if self.logit_bias:
            return "logit_bias", f"got {len(self.logit_bias)} entries; not supported (expected none)"
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > server.k:
            return "num_speculative_tokens", (f"got {self.num_speculative_tokens}; this server drafts at most "
                                              f"{server.k} (its --k)")
        stops = self.stops()
        if len(stops) > MAX_STOP_STRINGS:
            return "stop", f"got {len(stops)} strings; expected at most {MAX_STOP_STRINGS}"
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            return "stop", f"got a string of {len(longest):,} characters ({short(longest, 40)}); expected at most {MAX_STOP_CHARS}"
        return None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or token list, or a list of either (one choice each, times n)."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def choices(self) -> int:
        return self.n * len(self.prompts())

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def unsupported(self, server: GenerationConfig) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "got true; this server returns the completion only (expected false)"
        if self.suffix:
            return "suffix", "got a suffix; this server does not insert text (expected none)"
        if self.best_of not in (None, self.n):
            return "best_of", f"got {self.best_of}; this server returns every choice it makes (expected n, {self.n})"
        if self.choices() > MAX_CHOICES:
            return "prompt", f"got {len(self.prompts())} prompts x n = {self.n}; expected at most {MAX_CHOICES} choices"
        return super().unsupported(server)


class ToolFunction(Body):
    name: str
    arguments: str | dict = "{}"


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction

    def for_template(self) -> dict:
        """As transformers' chat templates take a call: arguments as an object when they are JSON for one."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else arguments
            except ValueError:
                pass
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def for_template(self, index: int) -> dict:
        """This message as a chat template takes it: text content (text parts joined by newlines, as vLLM
        joins them), ``developer`` as ``system`` (what it means to models trained before it existed)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self._text(index)}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message

    def _text(self, index: int) -> str:
        where = f"messages[{index}].content"
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise ApiError(400, f"{where}: got null; expected a string or a list of text parts", "messages")
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                got = f"type {short(kind, 40)}" if kind != "text" else "no string 'text'"
                raise ApiError(400, f"{where}[{j}]: got {got}; this server takes text parts only "
                               "({'type': 'text', 'text': ...})", "messages")
            texts.append(part["text"])
        return "\n".join(texts)


class FunctionSpec(Body):
    """A tool's function as OpenAI defines it: checked here, so that a malformed schema is a 400 naming the field
    before a chat template fails on it."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Body):
    type: Literal["function"]
    function: FunctionSpec


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's, refused by name in ``unsupported``
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [message.for_template(i) for i, message in enumerate(self.messages)]

    def template_tools(self) -> list[dict] | None:
        """The tools' JSON schemas for the chat template; none when the request says the model must not call one."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [{"type": tool.type, "function": tool.function.model_dump(exclude_none=True)} for tool in self.tools]

    def unsupported(self, server: GenerationConfig) -> tuple[str, str] | None:
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", (f"got {self.response_format.type!r}; this server does not constrain its output "
                                       "to JSON (expected 'text'; ask for JSON in the messages instead)")
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", (f"got {short(self.tool_choice, 60)}; this server cannot force a tool call "
                                   "(expected 'auto' or 'none'; tool calls come back as text in the message)")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", f"got {self.top_logprobs} with logprobs false; expected logprobs true"
        if self.modalities not in (None, ["text"]):
            return "modalities", f"got {short(self.modalities, 40)}; this server answers in text only (expected ['text'])"
        refused = {"audio": "audio output", "prediction": "predicted outputs", "web_search_options": "web search",
                   "functions": "the deprecated functions API (use tools)", "function_call": "the deprecated functions API "
                   "(use tool_choice)", "reasoning_effort": "reasoning settings", "verbosity": "verbosity settings",
                   "moderation": "moderation"}
        for name, what in refused.items():
            if getattr(self, name) is not None:
                return name, f"got {short(getattr(self, name), 40)}; this server does not do {what} (expected none)"
        return super().unsupported(server)


def _choice_seed(seed: int | None, choice: int) -> int | None:
    if seed is None or choice == 0:
        return seed
    return int(np.random.SeedSequence([seed, choice]).generate_state(1, np.uint64)[0]) >> 1  # below 2**63
