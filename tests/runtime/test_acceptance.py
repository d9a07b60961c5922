"""Acceptance rules: exact cases, and property tests over random inputs (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy.runtime.acceptance import PAD, greedy_accept, greedy_accept_row, speculative_accept


def test_greedy_exact_cases():
    target = np.array([[4, 5, 6, 7], [4, 9, 6, 7], [1, 5, 6, 7]])  # [batch, K + 1]
    drafts = np.array([[4, 5, 6], [4, 5, 6], [4, 5, 6]])
    accepted, emitted = greedy_accept(target, drafts)
    np.testing.assert_array_equal(accepted, [3, 1, 0])
    np.testing.assert_array_equal(emitted, [[4, 5, 6, 7], [4, 9, PAD, PAD], [1, PAD, PAD, PAD]])


def _reference_greedy(target, drafts):
    """The straightforward loop the vectorised rule must agree with."""
    accepted, emitted = [], []
    for t, d in zip(target, drafts):
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        accepted.append(n)
        emitted.append(list(d[:n]) + [t[n]] + [PAD] * (len(d) - n))
    return np.array(accepted), np.array(emitted).reshape(len(target), drafts.shape[1] + 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 8), st.integers(2, 5), st.integers(0, 2**31))
def test_greedy_agrees_with_reference(batch, k, vocab, seed):
    rng = np.random.default_rng(seed)
    target = rng.integers(0, vocab, (batch, k + 1))
    drafts = np.where(rng.random((batch, k)) < 0.7, target[:, :k], rng.integers(0, vocab, (batch, k)))
    accepted, emitted = greedy_accept(target, drafts)
    ref_accepted, ref_emitted = _reference_greedy(target, drafts)
    np.testing.assert_array_equal(accepted, ref_accepted)
    np.testing.assert_array_equal(emitted, ref_emitted)
    # the one-row rule on Python ints (batch 1) agrees row by row
    assert [greedy_accept_row(t, d) for t, d in zip(target.tolist(), drafts.tolist())] == ref_accepted.tolist()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(0, 6), st.integers(2, 12), st.integers(0, 2**31), st.booleans(),
       st.booleans())
def test_sampling_properties(batch, k, vocab, seed, deterministic, sparse):
    rng = np.random.default_rng(seed)
    p = rng.gamma(0.5, size=(batch, k + 1, vocab))
    if sparse:
        p[..., : vocab // 2] = 0.0  # half the vocabulary impossible under the target
        p[..., -1] += 1e-3
    p /= p.sum(-1, keepdims=True)
    q = rng.gamma(0.5, size=(batch, k, vocab)) + 1e-9
    q /= q.sum(-1, keepdims=True)
    rngs = [np.random.default_rng([seed, b]) for b in range(batch)]
    drafts = np.array([[rng.choice(vocab, p=q[b, i]) for i in range(k)] for b in range(batch)]).reshape(batch, k)
    accepted, emitted = speculative_accept(p, None if deterministic else q, drafts, rngs)
    assert accepted.shape == (batch,) and np.all((0 <= accepted) & (accepted <= k))
    for b in range(batch):
        n = accepted[b]
        assert np.all(emitted[b, :n] == drafts[b, :n])
        assert 0 <= emitted[b, n] < vocab
        assert np.all(emitted[b, n + 1 :] == PAD)
        # no emitted token, accepted or recovered, has zero target probability at its position
        for i in range(n + 1):
            assert p[b, i, emitted[b, i]] > 0
