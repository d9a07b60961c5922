"""The KV caches of a batch's rows, one per model, and the prefill calls that fill them (``RowCaches``).

Rows are in batch order, as the generation's batch state has them; they join, leave and merge with its requests.
What a row's cache holds is its ``past_len``: the target's, all of a row's committed tokens but the last once
prefilled (each cycle starts from x[L - 1]); the draft's, what it has seen of them (``Drafter.behind`` counts the rest).
"""

from __future__ import annotations

import time

import numpy as np

from ..engines.base import Engine, KVCache, prefill
from .prefix_cache import PrefixCache
from .rows import Request
from .telemetry import FinishReason


class RowCaches:
    """The target's cache (``cache``) and the draft model's (``draft_cache``; None without a draft model) of the same
    rows, ``capacity`` slots each."""

    def __init__(self, target: Engine, draft: Engine | None, rows: int, capacity: int,
                 prefixes: PrefixCache | None = None):
        # prefixes: earlier requests' K/V, which rows reuse before their prefill and keep when they leave
        self.target, self.draft, self.capacity, self.prefixes = target, draft, capacity, prefixes
        self.cache = target.allocate_cache(rows, capacity)
        self.draft_cache = draft.allocate_cache(rows, capacity) if draft is not None else None

    def prefill(self, tokens: np.ndarray, live: list[Request], past_len: list[int],
                first: int = 0) -> tuple[list[int], float]:
        """Bring the target's rows ``first ..`` up to ``past_len`` (one per row from ``first``) of ``tokens`` [batch,
        capacity]; ``live``: the batch's requests, whose results hear how long it took. If the batched prefill fails,
        each row is prefilled alone, and a row that fails alone fails its request. Returns those rows and the seconds."""
        began, batch = time.perf_counter(), len(tokens)
        if self.prefixes is not None:
            self._reuse(live, first)
        cache = self.cache
        rows, failed = cache.rows(first, batch), []
        try:
            prefill(self.target, rows, tokens[first:], past_len)
            done = rows.past_len.tolist()
        except Exception:  # an engine fault: find the rows it belongs to
            done = []
            for b in range(first, batch):
                single = cache.rows(b, b + 1)  # from the batch's lengths: nothing of the failed call counts
                try:
                    prefill(self.target, single, tokens[b : b + 1], past_len[b - first : b - first + 1])
                except Exception as exc:
                    live[b].fail(exc)
                    failed.append(b)
                done += single.past_len.tolist()
        cache.commit(cache.past_len.tolist()[:first] + done)
        ended = time.perf_counter()
        for request in live[first:]:
            request.result.prefill_seconds, request.result.decode_started = ended - began, ended
        return failed, ended - began

    def _reuse(self, live: list[Request], first: int) -> None:
        """Rows ``first ..`` that have seen nothing start from the longest kept start of their prompt in their scope
        (``PrefixCache.reuse``); their results say how many prompt tokens that was."""
        for b, request in enumerate(live[first:], first):
            if self.cache.past_len[b] == 0:
                request.result.cached_tokens = self.prefixes.reuse(request.settings.scope, request.result.prompt_ids,
                                                                   self.cache, b, self.draft_cache)

    def keep(self, b: int, tokens: np.ndarray, request: Request) -> None:
        """Row ``b``, about to leave, keeps what its caches hold of ``tokens`` for the prompts that follow (none of a
        failed request's: a fault may have left its slots half written)."""
        if self.prefixes is not None and request.result.finish_reason != FinishReason.ERROR:
            self.prefixes.keep(request.settings.scope, tokens, self.cache, b, self.draft_cache)

    def prefill_draft(self, tokens: np.ndarray) -> tuple[float, int]:
        """Bring the draft's rows up to what the target has seen of ``tokens``; returns the seconds it took and the
        tokens its widest row took in (0: it lacked nothing)."""
        began, before = time.perf_counter(), self.draft_cache.past_len.tolist()
        prefill(self.draft, self.draft_cache, tokens, self.cache.past_len.tolist())
        spent = time.perf_counter() - began
        return spent, max(now - seen for now, seen in zip(self.draft_cache.past_len.tolist(), before))

    def add(self, rows: int) -> None:
        """``rows`` new rows at the end, with nothing seen."""
        self.cache = self.cache.extend(self.target.allocate_cache(rows, self.capacity))
        if self.draft_cache is not None:
            self.draft_cache = self.draft_cache.extend(self.draft.allocate_cache(rows, self.capacity))

    def merge(self, other: RowCaches) -> None:
        """``other``'s rows (the same capacity) at the end; ``other`` is spent."""
        if other.capacity != self.capacity:
            raise ValueError(f"merge: capacity {other.capacity} != {self.capacity}")
        self.cache = self.cache.extend(other.cache)
        if self.draft_cache is not None:
            self.draft_cache = self.draft_cache.extend(other.draft_cache)

    def select(self, keep: list[int]) -> None:
        """Only rows ``keep`` stay, in that order (the others leave)."""
        self.cache = self.cache.select(keep)
        if self.draft_cache is not None:
            self.draft_cache = self.draft_cache.select(keep)

    def alone(self, b: int) -> tuple[KVCache, KVCache | None]:
        """Row ``b``'s slots of each cache, as views (a failed cycle re-run row by row); ``commit_alone`` takes back
        their lengths."""
        draft = None if self.draft_cache is None else self.draft_cache.rows(b, b + 1)
        return self.cache.rows(b, b + 1), draft

    def commit_alone(self, b: int, cache: KVCache, draft: KVCache | None) -> None:
        """Row ``b`` keeps what its views (``alone``) now hold."""
        self.cache.commit_row(b, cache.past_len.item(0))
        if draft is not None:
            self.draft_cache.commit_row(b, draft.past_len.item(0))
