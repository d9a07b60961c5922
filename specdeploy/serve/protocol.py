"""The OpenAI request bodies this server takes, and how they map onto ``GenerationConfig``.

Fields are strict (no "5" for 5) and unknown fields are refused, so a typo is a 400 naming the field
rather than a silently ignored option. Speculative extensions ride along in the body (the openai
client's ``extra_body``): ``num_speculative_tokens`` caps the request's drafts below the server's k.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..runtime.config import GenerationConfig

OPENAI_NAMES = {"max_new_tokens": "max_tokens", "k": "num_speculative_tokens"}  # GenerationConfig -> request


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # extensions, as vLLM and llama.cpp's server name them
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False

    def generation_config(self, server: GenerationConfig, default_max_tokens: int) -> GenerationConfig:
        """This request's row settings; ``server`` holds the batch's speculation (k, drafter, policy)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationConfig(
            max_new_tokens=self.requested_max_tokens() or default_max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=tuple(stop), ignore_eos=self.ignore_eos,
            k=server.k if self.num_speculative_tokens is None else self.num_speculative_tokens,
            policy=server.policy, drafter=server.drafter, confidence_threshold=server.confidence_threshold)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def unsupported(self, server: GenerationConfig) -> tuple[str, str] | None:
        """(field, why) for a valid-looking request this server does not do; None when it does."""
        if self.n != 1:
            return "n", f"got {self.n}; this server returns one choice per request (n = 1)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                return name, f"got {getattr(self, name)}; not supported (use repetition_penalty)"
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > server.k:
            return "num_speculative_tokens", (f"got {self.num_speculative_tokens}; this server drafts at most "
                                              f"{server.k} (its --k)")
        if isinstance(self.stop, list) and len(self.stop) > 4:  # empty strings: GenerationConfig refuses them
            return "stop", f"got {len(self.stop)} strings; expected up to 4"
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class CompletionRequest(Sampling):
    prompt: str | list[int]
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


Sampling.model_rebuild()
