"""What the embeddable API hands back: a finished request (``GenerationResult``), a streamed piece of one
(``StreamChunk``), and the error a failed one raises (``GenerationError``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .config import GenerationConfig
from .rows import RowResult
from .stops import StopStrings
from .telemetry import CycleRecord, FinishReason, summarize


class GenerationError(RuntimeError):
    """A request that failed while decoding (an engine fault); other requests are unaffected."""


@dataclass(kw_only=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens, prompt excluded
    stats: dict
    finish_reason: FinishReason | str = ""  # eos, length, stop, or error (then ``error`` says why)
    records: list[CycleRecord] = field(default_factory=list)
    error: str = ""

    @classmethod
    def of(cls, row: RowResult, config: GenerationConfig, decode: Callable[[Sequence[int]], str]) -> GenerationResult:
        """A finished row as a result: its text (``decode``d, cut at a stop string under ``config``), tokens and stats
        (its records' summary, its prefill, its prompt's tokens and how many of them were reused, the mode)."""
        stats = summarize(row.records, seconds=row.decode_seconds)
        stats["prefill_s"] = row.prefill_seconds
        stats["prompt_tokens"] = int(len(row.prompt_ids))
        stats["cached_prompt_tokens"] = row.cached_tokens
        stats["exact"] = config.exact
        text = StopStrings(config.stop, None).cut(decode(row.token_ids))
        return cls(text=text, token_ids=row.token_ids, stats=stats, finish_reason=row.finish_reason, records=row.records,
                   error=row.error)


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens committed by this cycle
    result: GenerationResult | None = None  # set on the last chunk only
