"""One record per cycle and row; every aggregate is derived from records, never counted apart.

Times of a batched call are shared out equally among the rows it served, so summing any time
field over records gives the wall time spent in that phase.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple

import numpy as np


class _Named(str, Enum):
    """An enum that serialises (JSON, f-strings, comparisons) as its plain string value."""

    def __str__(self) -> str:
        return self.value


class FinalToken(_Named):
    """The token a cycle emits after the accepted drafts (vLLM's glossary, acceptance.py)."""

    BONUS = "bonus"  # all k drafts accepted (k > 0): drawn from the target's last distribution
    RECOVERED = "recovered"  # at the first rejection
    PLAIN = "plain"  # k = 0: a plain decoding step


class FinishReason(_Named):
    """Why a request ended."""

    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    ERROR = "error"  # an engine fault tied to this request; the row's ``error`` says which
    CANCELLED = "cancelled"  # left the batch on request (a client that went away)


# a record's fields before 0.5 (``k``: the drafts a row had, not the most it may have; ``emitted``: the tokens it
# committed, not the n + 1 acceptance gave it; ``lookup``: free drafts, an index's too): old name -> new name
RENAMED = {"k": "drafted", "emitted": "committed", "lookup": "free"}


def _renamed(old: str) -> property:
    """The deprecated attribute ``old`` of a record: its new field, with a DeprecationWarning."""
    new = RENAMED[old]

    def get(self):
        warnings.warn(f"CycleRecord.{old} is deprecated: use CycleRecord.{new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: ``{new}``.")


class CycleRecord(NamedTuple):
    """One row's cycle; immutable once recorded. Made by the cycle alone (``decoder._record``), by keyword."""

    request_id: str
    cycle: int
    drafted: int  # drafts proposed (and verified) for this row
    accepted: int  # drafts accepted, 0 <= accepted <= drafted
    rejected_at: int | None  # 1-based position of the first rejected draft; None if none was
    final: FinalToken  # the emitted extra token: bonus, recovered, or plain (no drafts)
    committed: int  # tokens committed for this row this cycle (after EOS / length / stop truncation)
    draft_s: float
    verify_s: float
    accept_s: float
    cache_s: float
    batch_size: int
    free: bool = False  # its drafts cost no model call (prompt lookup's or a suffix index's), not the draft model's
    drafted_from: str | None = None  # a suffix index's drafts: the request whose text they followed

    k = _renamed("k")
    emitted = _renamed("emitted")
    lookup = _renamed("lookup")

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, data: dict) -> CycleRecord:
        """The record ``to_dict`` gave (other keys, such as a bench line's tags, ignored); a record written before 0.5
        is read under the new names (``upgraded``)."""
        return cls(**{name: value for name, value in upgraded(data).items() if name in cls._fields})


def upgraded(data: dict) -> dict:
    """A record's dict with the fields renamed in 0.5 (``RENAMED``) under their new names, with a DeprecationWarning
    where any was found (a records.jsonl written before); the dict itself where none was."""
    old = [name for name in RENAMED if name in data and RENAMED[name] not in data]
    if not old:
        return data
    warnings.warn(f"cycle record fields {', '.join(old)} are deprecated: read as "
                  f"{', '.join(RENAMED[name] for name in old)} (a record written before 0.5)", DeprecationWarning,
                  stacklevel=2)
    return {RENAMED.get(name, name) if name in old else name: value for name, value in data.items()}


def mean_accepted_length(records: Iterable[CycleRecord]) -> float:
    """Mean tokens a cycle commits per row: accepted drafts + 1 (the field's 'mean accepted length', tau)."""
    records = list(records)
    return float(np.mean([r.accepted + 1 for r in records])) if records else 0.0


def acceptance_by_position(records: Iterable[CycleRecord], k_max: int | None = None) -> list[float]:
    """P(draft i accepted | draft i was verified), i = 1..k_max (from cycles that verified it)."""
    records = [r for r in records if r.drafted > 0]
    k_max = k_max or max((r.drafted for r in records), default=0)
    rates = []
    for i in range(1, k_max + 1):
        reached = [r for r in records if r.drafted >= i and r.accepted >= i - 1]
        rates.append(float(np.mean([r.accepted >= i for r in reached])) if reached else float("nan"))
    return rates


def acceptance_rate(records: Iterable[CycleRecord]) -> float:
    """Accepted drafts / proposed drafts."""
    records = list(records)
    proposed = sum(r.drafted for r in records)
    return sum(r.accepted for r in records) / proposed if proposed else float("nan")


def time_split(records: Iterable[CycleRecord]) -> dict[str, float]:
    """Seconds spent in draft, verify, accept and cache."""
    records = list(records)
    return {name: float(sum(getattr(r, f"{name}_s") for r in records)) for name in ("draft", "verify", "accept", "cache")}


def summarize(records: Iterable[CycleRecord], seconds: float | None = None) -> dict:
    """Aggregates of a set of records; ``seconds`` is the wall time for tokens/s (else summed phases)."""
    records = list(records)
    split = time_split(records)
    tokens = sum(r.committed for r in records)
    wall = seconds if seconds is not None else sum(split.values())
    return {
        "tokens": tokens,
        "cycles": len(records),
        "mean_accepted_length": mean_accepted_length(records),
        "acceptance_rate": acceptance_rate(records),
        "acceptance_by_position": acceptance_by_position(records),
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "time_split": split,
    }
