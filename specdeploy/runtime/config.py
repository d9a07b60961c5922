"""GenerationConfig: every decoding option, named like the CLI's, validated on construction."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..values import is_integer, short
from .errors import ConfigError

INT64_MAX = 2**63 - 1
# the draft-length policies and the drafters a config may name (``registry`` makes each; a test holds the two equal)
POLICIES = ("cost", "fixed", "confidence", "heuristic")
DRAFTERS = ("hybrid", "model", "suffix", "prompt-lookup", "none")
PENALTY_RANGE = (0.01, 100.0)  # beyond it a penalised logit over- or underflows to inf / 0 and the distribution to NaN
# Below it logits / temperature overflow: 5e-324 (a subnormal) made every distribution NaN, and the sampler returned
# the last id at every step. 1e-6 leaves any float32 logit finite after scaling (in float64) and is sharper than any
# use of sampling; 0 is greedy.
MIN_TEMPERATURE = 1e-6
# Stop strings a request may give, and characters in each (the server's HTTP bound is the same): matching costs
# time in proportion to them at every cycle.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# ONNX Runtime threads per core at most: more only oversubscribe the cores, and too many abort the process inside it
MAX_THREADS_PER_CORE = 4
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding options. ``temperature`` 0 means greedy; ``k`` is the (maximum) draft length.

    ``exact``: the target computes every position by the same kernels whichever call computes it (a plain step, a
    verification, a prefill chunk), so greedy speculative output equals this mode's greedy plain output bit for bit
    for any drafter, k, batch and batch mates; without it, a near-tie of a compressed target can go either way.

    The speculation defaults (``k``, ``policy``, ``drafter``) are the CLI's and the server's too: the hybrid drafter
    under the cost policy, which prices each source of drafts (the suffix index of the request's own text and earlier
    answers, the draft model) and plain decoding by what they cost on this machine, and drafts at most ``k`` a cycle;
    on an artifact without a draft model it drafts from the suffix index alone.

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
    # every target call carries an even number of tokens a row (``engines.even``): greedy speculative output is then
    # the same artifact's greedy plain output (in this mode) bit for bit, at the cost of a padded plain step
    exact: bool = False

    def __post_init__(self):
        def bad(name, expected):
            return ConfigError(f"{name}: got {short(getattr(self, name))}; expected {expected}")

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
        number("temperature", lambda t: t == 0 or t >= MIN_TEMPERATURE,
               f"a finite number, 0 (greedy) or >= {MIN_TEMPERATURE:g} (below it the distribution overflows)")
        whole("top_k", 0, "an integer >= 0 (0 disables it)")
        number("top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        number("min_p", lambda p: 0 <= p < 1, "a number in [0, 1)")
        low, high = PENALTY_RANGE
        number("repetition_penalty", lambda r: low <= r <= high, f"a number in [{low}, {high:g}] (1 disables it)")
        if self.seed is not None:
            whole("seed", 0, "an integer >= 0, or None")
        whole("k", 0, "an integer >= 0")
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise bad("policy", f"one of {', '.join(POLICIES)}")
        if not isinstance(self.drafter, str) or self.drafter not in DRAFTERS:
            raise bad("drafter", f"one of {', '.join(DRAFTERS)}")
        number("confidence_threshold", lambda c: 0 < c < 1, "a number in (0, 1)")
        for name in ("ignore_eos", "exact"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise bad(name, "True or False")
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "stop", _checked_stops(self.stop))
        object.__setattr__(self, "stop_token_ids", _checked_stop_ids(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def speculative(self) -> bool:
        return self.drafter != "none" and self.k > 0

    @property
    def max_drafts(self) -> int:
        """The most drafts a cycle verifies: ``k``, or 0 when the config does not speculate."""
        return self.k if self.speculative else 0


def check_unicode(text: str, name: str) -> None:
    """Refuse a lone surrogate in ``text`` (JSON's ``"\\ud800"`` decodes to one; no tokenizer takes it), naming
    ``name`` and where it is."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise ConfigError(f"{name}: a lone surrogate (U+{ord(found.group()):04X}) at character {found.start():,}; "
                          "expected valid Unicode text")


def checked_threads(threads) -> int | None:
    """``threads`` for ONNX Runtime: None (its default) or an integer in [1, MAX_THREADS_PER_CORE x cores]."""
    if threads is None:
        return None
    limit = max_threads()
    if not is_integer(threads) or not 1 <= threads <= limit:
        raise ConfigError(f"threads: got {short(threads)}; expected an integer in [1, {limit}] ({MAX_THREADS_PER_CORE} per "
                          f"core of this machine's {os.cpu_count() or 1}), or None for ONNX Runtime's default")
    return int(threads)


def max_threads() -> int:
    return MAX_THREADS_PER_CORE * (os.cpu_count() or 1)


def checked_token_ids(ids, vocab: int, name: str) -> np.ndarray:
    """A flat sequence of Python or NumPy integers as int64 ids, each inside [0, vocab); nothing coerced.
    ConfigError naming ``name`` otherwise (bytes, a string, floats, nested lists, ids beyond int64 or the vocabulary)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ConfigError(f"{name}: got {short(ids)}; expected a list of token ids")
    items = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
    wrong = next((t for t in items if not is_integer(t)), None)
    if wrong is not None:
        raise ConfigError(f"{name}: got {short(wrong)} among them; expected integers (a flat list of token ids)")
    low, high = (min(items), max(items)) if items else (0, 0)
    if low < 0 or high >= vocab:
        raise ConfigError(f"{name}: range [{short(low)}, {short(high)}] outside the vocabulary [0, {vocab})")
    return np.array(items, np.int64)


def _checked_stops(given) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings, bounded in number and length (a cycle's matching costs with them)."""
    stop = (given,) if isinstance(given, str) else given
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError(f"stop: got {short(given)}; expected a string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"stop: got {len(stop):,} strings; expected at most {MAX_STOP_STRINGS}")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise ConfigError(f"stop: got a string of {len(longest):,} characters; expected at most {MAX_STOP_CHARS}")
    for i, text in enumerate(stop):
        check_unicode(text, f"stop[{i}]")
    return tuple(stop)


def _checked_stop_ids(ids) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of non-negative int64 integers."""
    if not isinstance(ids, (list, tuple)) or any(not is_integer(t) or not 0 <= t <= INT64_MAX for t in ids):
        raise ConfigError(f"stop_token_ids: got {short(ids)}; expected a list of non-negative integers")
    return tuple(int(t) for t in ids)


def _is_number(value) -> bool:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range (10 ** 400): no number a setting can take
        return False
