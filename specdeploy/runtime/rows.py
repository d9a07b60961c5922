"""What one request in a batch decodes with (``RowSettings``) and what it produced (``RowResult``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .config import GenerationConfig
from .suffix import SuffixIndex
from .telemetry import CycleRecord, FinishReason


@dataclass(slots=True)
class RowResult:
    request_id: str
    prompt_ids: np.ndarray
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | str = ""  # empty while the request runs
    records: list[CycleRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0  # the prefill call(s) this request took part in
    decode_seconds: float = 0.0  # wall time from the end of its prefill to its last cycle
    decode_started: float = 0.0  # perf_counter() at the end of its prefill
    error: str = ""  # why the row failed, when finish_reason is "error"


# (tokens generated so far, new tokens) -> how many new tokens to keep (a stop string ends there), or None
StopCheck = Callable[[list[int], list[int]], "int | None"]


class RowSettings(NamedTuple):
    """What one request decodes with, whatever shares its batch."""

    config: GenerationConfig  # sampling, length, stop tokens, seed; ``k`` caps its drafts below the batch's
    stop_check: StopCheck | None = None
    seed_stream: int = 0  # its draws come from [seed, seed_stream]: prompt i of one call draws from stream i
    index: SuffixIndex | None = None  # its scope's suffix index: drafts from earlier requests' text, and its own joins
