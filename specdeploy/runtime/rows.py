"""One request in a batch: what it decodes with (``RowSettings``), what it produced (``RowResult``), and the record that
keeps both with its stop tokens, generator and keyed noise (``Request``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from .sampling import keyed_noise
from .suffix import SuffixIndex
from .telemetry import CycleRecord, FinishReason

if TYPE_CHECKING:  # as in ``sampling``: config imports the registry, and so the drafters, which read rows
    from .config import GenerationConfig


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


@dataclass(slots=True)
class Request:
    """One request of a batch, in one record: its result so far, its settings, the token ids that end it (``stops``),
    its generator, and a seeded sampled row's noise by position (``noise``; None for any other row). A cycle's commit
    updates it (``decoder.BatchState.commit``, in the cycle's own module)."""

    result: RowResult
    settings: RowSettings
    stops: set[int]
    generator: np.random.Generator
    noise: dict[int, np.ndarray] | None

    @classmethod
    def open(cls, result: RowResult, settings: RowSettings, eos: set[int],
             unseeded: Callable[[], np.random.Generator]) -> Request:
        """A request starting with ``result`` (its prompt): it stops at its stop ids and the model's ``eos`` (unless it
        ignores EOS), draws from its seed's stream (without a seed, from ``unseeded()``: ``sampling.unseeded_generator``
        unless a test makes it repeatable), and a seeded sampled one keys its draws by position."""
        config, seeded = settings.config, settings.config.seed is not None
        stops = set(config.stop_token_ids) | (set() if config.ignore_eos else eos)
        generator = np.random.default_rng([config.seed, settings.seed_stream]) if seeded else unseeded()
        return cls(result, settings, stops, generator, {} if seeded and not config.greedy else None)

    def noise_at(self, position: int, vocab: int) -> np.ndarray | None:
        """Its keyed noise [vocab] for its token at ``position`` (``sampling.keyed_noise``, made once); None unless
        it is seeded and sampled."""
        noise = self.noise
        if noise is None:
            return None
        if position not in noise:
            noise[position] = keyed_noise(self.settings.config.seed, self.settings.seed_stream, position, vocab)
        return noise[position]

    def fail(self, exc: Exception) -> None:
        """It ends with an engine fault that is its own (finish reason "error")."""
        self.result.finish_reason, self.result.error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"

    def publish(self) -> None:
        """Its prompt and answer join its scope's suffix index (``RowSettings.index``), for the requests that follow:
        only committed tokens, never drafts; a failed request's are left out."""
        row, shared = self.result, self.settings.index
        if shared is not None and row.finish_reason != FinishReason.ERROR:
            shared.add(row.request_id, [*row.prompt_ids.tolist(), *row.token_ids])


class BatchView(Protocol):
    """What drafters and acceptance read of a batch's rows, all in batch order: ``decoder.BatchState`` is one, and any
    object with these members over plain arrays is another (a drafter's test needs no batch state)."""

    tokens: np.ndarray  # [batch, capacity] row b's committed tokens x[0:L_b], then anything (last cycle's drafts)
    lengths: list[int]  # [batch] committed length L_b
    greedy: bool  # every row decodes greedily: no distribution is needed
    penalized: bool  # some row has a repetition penalty
    configs: list[GenerationConfig]  # [batch] each row's settings
    scopes: list[tuple[RowResult, SuffixIndex | None]]  # [batch] each row's result so far and its scope's suffix index

    @property
    def batch(self) -> int: ...

    def rngs(self) -> list[np.random.Generator]:
        """[batch] each row's generator."""

    def noise(self, b: int, position: int, vocab: int) -> np.ndarray | None:
        """Row b's keyed noise [vocab] for its token at ``position``; None unless it is seeded and sampled."""
