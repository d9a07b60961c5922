"""Acceptance rules: exact cases, and property tests over random inputs (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy.runtime.acceptance import PAD, greedy_accept_row, speculative_accept


def test_greedy_exact_cases():
    target = [[4, 5, 6, 7], [4, 9, 6, 7], [1, 5, 6, 7]]  # [batch, K + 1]
    drafts = [[4, 5, 6], [4, 5, 6], [4, 5, 6]]
    assert [greedy_accept_row(t, d) for t, d in zip(target, drafts)] == [3, 1, 0]


def _reference_greedy(target, drafts):
    """The straightforward loop the rule must agree with: the drafts kept up to the first the target disagrees with."""
    accepted = []
    for t, d in zip(target, drafts):
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        accepted.append(n)
    return np.array(accepted)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 8), st.integers(2, 5), st.integers(0, 2**31))
def test_greedy_agrees_with_reference(batch, k, vocab, seed):
    rng = np.random.default_rng(seed)
    target = rng.integers(0, vocab, (batch, k + 1))
    drafts = np.where(rng.random((batch, k)) < 0.7, target[:, :k], rng.integers(0, vocab, (batch, k)))
    assert [greedy_accept_row(t, d) for t, d in zip(target.tolist(), drafts.tolist())] == \
        _reference_greedy(target, drafts).tolist()


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
