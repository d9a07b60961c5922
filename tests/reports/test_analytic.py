"""The analytic model against hand-computed values."""

from __future__ import annotations

import pytest

from specdeploy.reports.analytic import expected_tokens, predicted_speedup


def test_expected_tokens_hand_values():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0  # K = 0: plain decoding
    assert expected_tokens([0.0, 0.9], 2) == 1.0  # acceptance 0
    assert expected_tokens([1.0] * 4, 4) == 5.0  # acceptance 1: K + 1
    assert expected_tokens([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


@pytest.mark.parametrize("a,k", [(0.0, 3), (0.3, 1), (0.7, 4), (0.9, 8), (1.0, 5)])
def test_per_position_equals_the_iid_closed_form(a, k):
    closed = float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)  # Leviathan et al.'s (1 - a^(K+1)) / (1 - a)
    assert expected_tokens([a] * k, k) == pytest.approx(closed)


def test_predicted_speedup():
    # E = 1 + 0.8 + 0.4 = 2.2 tokens for k = 2; cost 2 * 1 + 12 = 14 against 10 per plain token
    assert predicted_speedup([0.8, 0.5], 2, draft_step_s=1.0, verify_s=12.0, plain_step_s=10.0) == pytest.approx(22 / 14)
    assert predicted_speedup([], 0, draft_step_s=1.0, verify_s=10.0, plain_step_s=10.0) == 1.0
    with pytest.raises(ValueError, match="k 3 exceeds the 2 acceptance rates"):
        expected_tokens([0.5, 0.5], 3)
