"""Drafters: prompt lookup against a straightforward reference; the draft model's one-row greedy path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy import GenerationConfig
from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from specdeploy.runtime.drafters import ModelDrafter, PromptLookup


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


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_one_row_greedy_path_equals_the_general_path(pair_dir, threshold):
    """The batch-1 greedy fast path makes the same drafts and leaves the same cache as the general one."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    rng = np.random.default_rng(0)
    config = GenerationConfig(k=5)
    drafters, token_buffers = [], []
    for _ in range(2):
        drafter = ModelDrafter(engine)
        drafter.start(1, 64)
        drafters.append(drafter)
        token_buffers.append(np.zeros((1, 64), np.int64))
    length, made_total, stopped_early = 7, 0, False
    for cycle in range(6):
        fresh = rng.integers(0, 128, length - int(drafters[0].cache.past_len[0]))  # tokens it has not seen
        results = []
        for drafter, tokens, propose in zip(drafters, token_buffers, ("_propose_greedy_row", "_propose_rows")):
            tokens[0, length - len(fresh) : length] = fresh
            args = (tokens, np.array([length]), 5) if propose == "_propose_greedy_row" else \
                (tokens, np.array([length]), 5, config, None)
            results.append(getattr(drafter, propose)(*args, threshold=threshold))
        fast, general = results
        np.testing.assert_array_equal(fast.drafts, general.drafts)  # before the buffers change
        assert (fast.steps, fast.catchup) == (general.steps, general.catchup)
        np.testing.assert_array_equal(token_buffers[0], token_buffers[1])
        past = int(drafters[0].cache.past_len[0])
        assert past == int(drafters[1].cache.past_len[0])
        np.testing.assert_array_equal(drafters[0].cache.stacked[..., :past, :], drafters[1].cache.stacked[..., :past, :])
        made_total += fast.drafts.shape[1]
        stopped_early |= fast.drafts.shape[1] < 5
        accepted = cycle % 3  # then the target keeps some drafts and adds one token
        for drafter in drafters:
            drafter.commit([length + accepted])
        length += accepted + 1
    assert made_total > 0 and stopped_early == (threshold is not None)
