"""The analytic model of speculative decoding (Leviathan et al. 2023), per-position.

With a_i the probability that draft i is accepted given drafts 1..i-1 were, a cycle that drafts K
tokens commits E[tokens | K] = 1 + sum_{j=1..K} prod_{i<=j} a_i tokens; for i.i.d. acceptance a
that is (1 - a^(K+1)) / (1 - a). With one draft step costing c_d and a target call over T tokens
v(T), the expected speedup over plain decoding (one v(1) per token) is
    E[tokens | K] * v(1) / (K * c_d + v(K + 1)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def expected_tokens(rates: Sequence[float], k: int | None = None) -> float:
    """E[tokens per cycle] when drafting k tokens with conditional acceptance rates a_1..a_k."""
    k = len(rates) if k is None else k
    if k > len(rates):
        raise ValueError(f"k {k} exceeds the {len(rates)} acceptance rates given")
    total, survive = 1.0, 1.0
    for rate in rates[:k]:
        survive *= 0.0 if math.isnan(rate) else rate
        total += survive
    return total


def predicted_speedup(rates: Sequence[float], k: int, draft_step_s: float, verify_s: float, plain_step_s: float) -> float:
    """E[tokens | k] * v(1) / (k * c_d + v(k + 1)); 1 for k = 0 when verify_s equals plain_step_s."""
    return expected_tokens(rates, k) * plain_step_s / (k * draft_step_s + verify_s)
