"""One request in a batch: what it decodes with (``RowSettings``), what it produced (``RowResult``), and the record that
keeps both with its stop tokens, generator and keyed noise (``Request``); who is in a batch (``Roster``: the records,
their rows of the token buffer and their committed lengths, as requests join, merge and leave between cycles)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .config import GenerationConfig
from .sampling import keyed_noise, unseeded_generator
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
    cached_tokens: int = 0  # prompt tokens whose K/V an earlier request's text gave (``PrefixCache``), not prefilled


# (tokens generated so far, new tokens) -> how many new tokens to keep (a stop string ends there), or None
StopCheck = Callable[[list[int], list[int]], "int | None"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RowSettings:
    """What one request decodes with, whatever shares its batch (by keyword: fields of one type side by side)."""

    config: GenerationConfig  # sampling, length, stop tokens, seed; ``k`` caps its drafts below the batch's
    stop_check: StopCheck | None = None
    seed_stream: int = 0  # its draws come from [seed, seed_stream]: prompt i of one call draws from stream i
    index: SuffixIndex | None = None  # its scope's suffix index: drafts from earlier requests' text, and its own joins
    scope: str | None = None  # its scope's name: whose kept K/V it reuses and keeps its own among (None: none)


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
        row, index = self.result, self.settings.index
        if index is not None and row.finish_reason != FinishReason.ERROR:
            index.add(row.request_id, [*row.prompt_ids.tolist(), *row.token_ids])


class Roster:
    """Token buffer [batch, capacity], committed lengths, and the requests, one record each. Requests ``join`` and
    ``leave`` between cycles; ``row`` gives one row alone, on the same buffers and records. What a cycle reads of the
    active records is derived when rows come or go (``_derive``)."""

    def __init__(self, config: GenerationConfig, capacity: int, eos: set[int]):
        # config: the batch's speculation and the settings of rows joined without their own; eos: the model's EOS ids
        self.config, self.capacity, self.eos = config, capacity, eos
        self.tokens = np.zeros((0, capacity), np.int64)  # [batch, capacity]
        self.lengths: list[int] = []  # [batch] committed length
        self.active: list[int] = []  # [batch] request number of each row
        self.requests: list[Request | None] = []  # by request number, finished ones included (None once released)
        self._derive()

    def _derive(self) -> None:
        """What every cycle reads of the active records, made when rows come or go rather than at each read."""
        live = self.live = [self.requests[i] for i in self.active]  # [batch] the rows' records
        configs = self.configs = [request.settings.config for request in live]  # [batch]
        self.texts = [(request.result, request.settings.index) for request in live]  # [batch] its own text, its index
        self._rngs = [request.generator for request in live]
        self.greedy = all(config.greedy for config in configs)  # acceptance and drafting need no distribution
        self.sampling = not self.greedy  # the generators' states are part of a snapshot
        self.penalized = any(config.repetition_penalty != 1.0 for config in configs)
        self.keyed = any(request.noise is not None for request in live)  # some row's draws are keyed by position

    results = property(lambda self: [None if r is None else r.result for r in self.requests])  # by request number

    def join(self, prompts: Sequence[np.ndarray], request_ids: Sequence[str],
             settings: Sequence[RowSettings] | None = None) -> None:
        """Add requests as new rows at the end of the batch, each with its own settings (``settings``; default:
        the batch's config without stop strings, prompt i drawing from seed stream i of the batch)."""
        if settings is None:
            settings = [RowSettings(config=self.config, seed_stream=len(self.requests) + i) for i in range(len(prompts))]
        added = np.zeros((len(prompts), self.capacity), np.int64)
        for b, prompt in enumerate(prompts):
            added[b, : len(prompt)] = prompt
        for prompt, request_id, row in zip(prompts, request_ids, settings):
            self.active.append(len(self.requests))
            self.requests.append(Request.open(RowResult(request_id, prompt), row, self.eos, unseeded_generator))
            self.lengths.append(len(prompt))
        self.tokens = np.concatenate([self.tokens, added])
        self._derive()

    def merge(self, other: Roster) -> None:
        """Append ``other``'s active rows (same capacity), with their records. An empty batch starts afresh: the
        requests that left are forgotten."""
        if not self.active:
            self.requests = []
        offset = len(self.requests)
        self.requests += other.live
        self.active += range(offset, offset + len(other.active))
        self.lengths += other.lengths
        self.tokens = np.concatenate([self.tokens, other.tokens])
        self._derive()

    def release(self, number: int) -> None:
        """Forget finished request ``number`` (its result has been handed on): a long-running batch that
        requests keep joining does not grow with the ones that left."""
        if number not in self.active:
            self.requests[number] = None

    def leave(self, rows: Sequence[int]) -> list[int]:
        """Drop batch rows ``rows``; returns the rows that stay, in order (caches keep the same ones)."""
        drop = set(rows)
        keep = [b for b in range(len(self.active)) if b not in drop]
        self.tokens = self.tokens[keep]
        self.lengths = [self.lengths[b] for b in keep]
        self.active = [self.active[b] for b in keep]
        self._derive()
        return keep

    def row(self, b: int) -> Roster:
        """Row ``b`` alone, on a view of this token buffer and the same records."""
        single = type(self)(self.config, self.capacity, self.eos)
        single.requests, single.tokens, single.lengths, single.active = (self.requests, self.tokens[b : b + 1],
                                                                         [self.lengths[b]], [self.active[b]])
        single._derive()
        return single

    def rngs(self) -> list[np.random.Generator]:
        """The active rows' generators, in batch order."""
        return self._rngs

    def noise(self, b: int, position: int, vocab: int) -> np.ndarray | None:
        """Row b's keyed noise [vocab] for its token at ``position`` (``Request.noise_at``); None for a row that is
        not seeded and sampled."""
        return self.live[b].noise_at(position, vocab)


class BatchView(Protocol):
    """What drafters and acceptance read of a batch's rows, all in batch order: ``decoder.BatchState`` is one, and any
    object with these members over plain arrays is another (a drafter's test needs no batch state)."""

    tokens: np.ndarray  # [batch, capacity] row b's committed tokens x[0:L_b], then anything (last cycle's drafts)
    lengths: list[int]  # [batch] committed length L_b
    greedy: bool  # every row decodes greedily: no distribution is needed
    penalized: bool  # some row has a repetition penalty
    configs: list[GenerationConfig]  # [batch] each row's settings
    texts: list[tuple[RowResult, SuffixIndex | None]]  # [batch] each row's own text so far (its result) and its suffix index

    @property
    def batch(self) -> int: ...

    def rngs(self) -> list[np.random.Generator]:
        """[batch] each row's generator."""

    def noise(self, b: int, position: int, vocab: int) -> np.ndarray | None:
        """Row b's keyed noise [vocab] for its token at ``position``; None unless it is seeded and sampled."""
