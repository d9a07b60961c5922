"""Drafters without a model: prompt lookup against a straightforward reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy import GenerationConfig
from specdeploy.runtime.drafters import PromptLookup


def _reference(seq, k, max_ngram=3):
    """Latest earlier occurrence of the longest final n-gram (n <= max_ngram) that has a continuation."""
    seq = list(seq)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j : j + n] == seq[-n:] and seq[j + n : j + n + k]:
                return seq[j + n : j + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 6))
def test_lookup_matches_reference(seq, k):
    assert list(PromptLookup()._lookup(np.array(seq), k)) == _reference(seq, k)


def test_propose_pads_rows_without_a_match_and_writes_drafts():
    tokens = np.zeros((2, 16), np.int64)
    tokens[0, :6] = [1, 2, 3, 9, 1, 2]  # "1 2" seen before, followed by "3 9"
    tokens[1, :3] = [4, 5, 6]  # no repeat: no match
    proposal = PromptLookup().propose(tokens, np.array([6, 3]), 3, GenerationConfig(), rngs=None)
    np.testing.assert_array_equal(proposal.drafts, [[3, 9, 1], [6, 6, 6]])
    np.testing.assert_array_equal(tokens[0, 6:9], [3, 9, 1])
    assert proposal.q is None and proposal.steps == 0
