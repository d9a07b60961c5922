"""GenerationConfig: every decoding option, named like the CLI's, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError
from .registry import DRAFTERS, POLICIES

INT64_MAX = 2**63 - 1
PENALTY_RANGE = (0.01, 100.0)  # beyond it a penalised logit over- or underflows to inf / 0 and the distribution to NaN


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding options. ``temperature`` 0 means greedy; ``k`` is the (maximum) draft length.

    The speculation defaults (``k``, ``policy``, ``drafter``) are the CLI's and the server's too: the cost policy
    prices each source of drafts (prompt lookup, the draft model) and plain decoding by what they cost on this
    machine, and drafts at most ``k`` a cycle; on an artifact without a draft model it drafts by lookup alone.

    Every field is checked on construction and never coerced silently: NumPy integers and floats are
    taken as the Python numbers they hold; strings, bools where numbers belong, NaN and infinities
    are refused with the field's name, the value and what was expected.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    k: int = 8
    policy: str = "cost"
    drafter: str = "hybrid"
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # stop like EOS, in addition to it
    confidence_threshold: float = 0.4
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, expected):
            return ConfigError(f"{name}: got {getattr(self, name)!r}; expected {expected}")

        def whole(name, low, expected):
            value = getattr(self, name)
            if not is_integer(value) or not low <= value <= INT64_MAX:
                raise bad(name, expected)
            object.__setattr__(self, name, int(value))

        def number(name, ok, expected):
            value = getattr(self, name)
            if not _is_number(value) or not ok(float(value)):
                raise bad(name, expected)
            object.__setattr__(self, name, float(value))

        whole("max_new_tokens", 1, "an integer >= 1")
        number("temperature", lambda t: t >= 0, "a finite number >= 0 (0 means greedy)")
        whole("top_k", 0, "an integer >= 0 (0 disables it)")
        number("top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        number("min_p", lambda p: 0 <= p < 1, "a number in [0, 1)")
        low, high = PENALTY_RANGE
        number("repetition_penalty", lambda r: low <= r <= high, f"a number in [{low}, {high:g}] (1 disables it)")
        if self.seed is not None:
            whole("seed", 0, "an integer >= 0, or None")
        whole("k", 0, "an integer >= 0")
        if self.policy not in POLICIES:
            raise bad("policy", f"one of {', '.join(POLICIES)}")
        if self.drafter not in DRAFTERS:
            raise bad("drafter", f"one of {', '.join(DRAFTERS)}")
        number("confidence_threshold", lambda c: 0 < c < 1, "a number in (0, 1)")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise bad("ignore_eos", "True or False")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(not is_integer(t) or not 0 <= t <= INT64_MAX for t in ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def speculative(self) -> bool:
        return self.drafter != "none" and self.k > 0


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))
