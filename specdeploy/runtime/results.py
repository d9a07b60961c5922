"""What the embeddable API hands back: a finished request (``GenerationResult``), a streamed piece of one
(``StreamChunk``), and the error a failed one raises (``GenerationError``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .telemetry import CycleRecord, FinishReason


class GenerationError(RuntimeError):
    """A request that failed while decoding (an engine fault); other requests are unaffected."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens, prompt excluded
    stats: dict
    finish_reason: FinishReason | str = ""  # eos, length, stop, or error (then ``error`` says why)
    records: list[CycleRecord] = field(default_factory=list)
    error: str = ""


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens committed by this cycle
    result: GenerationResult | None = None  # set on the last chunk only
