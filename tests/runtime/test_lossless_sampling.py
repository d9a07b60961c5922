"""Speculative sampling emits exactly the target's distribution (after the same logit processing).

Chi-square tests on seeded runs, each with a negative control: the same test applied to a wrong
rule (resampling from p instead of the residual max(0, p - q)) must reject it.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.acceptance import speculative_accept
from specdeploy.runtime.sampling import sample

ALPHA = 1e-3
VOCAB, K, TRIALS = 6, 3, 20000


def _random_dists(rng, shape):
    x = rng.gamma(0.7, size=shape + (VOCAB,))
    return x / x.sum(-1, keepdims=True)


def _wrong_rule(p, q, drafts, rngs, limits=None):
    """Accept like the right rule, but at a rejection resample from p: biased towards the drafts."""
    batch, k = drafts.shape
    if k == 0 or q is None:
        return speculative_accept(p, q, drafts, rngs)
    ratio = p[np.arange(batch)[:, None], np.arange(k)[None], drafts] / q[np.arange(batch)[:, None], np.arange(k)[None], drafts]
    accepted = np.cumprod(np.stack([r.random(k) for r in rngs]) < ratio, axis=1).sum(1)
    emitted = np.full((batch, k + 1), -1)
    for b in range(batch):
        n = accepted[b]
        emitted[b, :n] = drafts[b, :n]
        emitted[b, n] = sample(p[b, n], rngs[b])
    return accepted, emitted


def _first_tokens(rule, seed=0):
    rng = np.random.default_rng(seed)
    p1 = _random_dists(rng, (1, K + 1))
    q1 = _random_dists(rng, (1, K))
    p = np.repeat(p1, TRIALS, axis=0)  # [trials, K + 1, vocab]: one fixed situation, many trials
    q = np.repeat(q1, TRIALS, axis=0)
    rngs = [np.random.default_rng([seed, t]) for t in range(TRIALS)]
    drafts = np.stack([[sample(q[t, i], rngs[t]) for i in range(K)] for t in range(TRIALS)])
    accepted, emitted = rule(p, q, drafts, rngs)
    return p1[0], emitted, drafts, accepted


def test_first_emitted_token_follows_target_distribution():
    p, emitted, _, accepted = _first_tokens(speculative_accept)
    counts = np.bincount(emitted[:, 0], minlength=VOCAB)
    assert chisquare(counts, p[0] * TRIALS).pvalue >= ALPHA
    assert 0 < accepted.mean() < K  # both rejection and acceptance paths were exercised


def test_second_token_after_an_accepted_first_follows_target_conditional():
    p, emitted, drafts, accepted = _first_tokens(speculative_accept, seed=1)
    # p[1] is the target's distribution given that the first token was d_1 (one fixed d_1 here)
    rows = (accepted >= 1) & (drafts[:, 0] == np.bincount(drafts[:, 0]).argmax())
    counts = np.bincount(emitted[rows, 1], minlength=VOCAB)
    expected = p[1] * rows.sum()
    keep = expected > 0
    assert chisquare(counts[keep], expected[keep]).pvalue >= ALPHA


def test_negative_control_wrong_residual_is_caught():
    p, emitted, _, _ = _first_tokens(_wrong_rule)
    counts = np.bincount(emitted[:, 0], minlength=VOCAB)
    assert chisquare(counts, p[0] * TRIALS).pvalue < ALPHA


def test_never_emits_a_token_the_target_gives_zero_probability():
    rng = np.random.default_rng(3)
    p = _random_dists(rng, (500, K + 1))
    p[..., 0] = 0.0  # token 0 is impossible under the target
    p /= p.sum(-1, keepdims=True)
    q = _random_dists(rng, (500, K))
    rngs = [np.random.default_rng(i) for i in range(500)]
    drafts = np.array([[sample(q[b, i], rngs[b]) for i in range(K)] for b in range(500)])
    _, emitted = speculative_accept(p, q, drafts, rngs)
    assert not np.any(emitted == 0)


# --- end to end, through the pipeline and the tiny exported models -----------------------------

# 4 new tokens: the first cycle drafts k = 3 (k is capped at the tokens still wanted minus one)
SAMPLED = dict(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=4, ignore_eos=True)
ROWS = 1500


def _end_to_end_counts(pipeline, config, prompt):
    """Joint counts of the first two tokens over ROWS independently seeded rows of one batch."""
    results = pipeline.generate([prompt] * ROWS, config)
    if config.drafter != "none":  # the test is vacuous unless drafts were really verified
        assert any(rec.k >= 2 for r in results for rec in r.records)
    return [tuple(r.token_ids[:2]) for r in results]


@pytest.fixture(scope="module", params=["explicit", "fused"])
def form(request):
    """Each graph form: the fused one writes its cache in place, so rejected drafts' slots hold stale K/V."""
    return request.param


@pytest.fixture(scope="module")
def pair_pipeline(request, form):
    return Pipeline.load(request.getfixturevalue("fused_dirs")["close"] if form == "fused"
                         else request.getfixturevalue("pair_dir"))


@pytest.fixture(scope="module")
def noise_pipeline(request, form):
    return Pipeline.load(request.getfixturevalue("fused_dirs")["noise"] if form == "fused"
                         else request.getfixturevalue("noise_dir"))


@pytest.mark.parametrize("draft,drafter,policy", [
    ("close", "model", "fixed"), ("noise", "model", "fixed"), ("close", "prompt-lookup", "fixed"),
    ("close", "model", "confidence"), ("close", "hybrid", "fixed"), ("noise", "hybrid", "fixed"),
])
def test_pipeline_sampling_matches_plain_sampling(pair_pipeline, noise_pipeline, draft, drafter, policy):
    pipeline = pair_pipeline if draft == "close" else noise_pipeline
    prompt = "w30 w31 w30 w31 w30"
    plain = _end_to_end_counts(pipeline, GenerationConfig(drafter="none", seed=11, **SAMPLED), prompt)
    spec = _end_to_end_counts(pipeline, GenerationConfig(drafter=drafter, policy=policy, k=3, seed=12, **SAMPLED),
                              prompt)
    for position in (0, 1):
        a = [x[position] for x in plain]
        b = [x[position] for x in spec]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
        table = table[:, table.sum(0) >= 5]  # chi-square needs non-tiny cells
        assert table.shape[1] >= 2, "the processed distribution should not be degenerate"
        assert chi2_contingency(table).pvalue >= ALPHA, f"position {position}: {table}"


def test_same_seed_same_output(pair_pipeline):
    config = GenerationConfig(temperature=1.0, top_p=0.95, seed=7, k=3, max_new_tokens=20, ignore_eos=True)
    a = pair_pipeline.generate(["w5 w6 w7", "w8"], config)
    b = pair_pipeline.generate(["w5 w6 w7", "w8"], config)
    c = pair_pipeline.generate(["w5 w6 w7", "w8"], GenerationConfig(**{**config.__dict__, "seed": 8}))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_pipeline_negative_control_wrong_rule_is_caught(pair_pipeline, monkeypatch):
    """The end-to-end test has the power to catch a wrong rule through the whole pipeline."""
    import specdeploy.runtime.decoder as decoder

    prompt = "w30 w31 w30 w31 w30"
    plain = _end_to_end_counts(pair_pipeline, GenerationConfig(drafter="none", seed=11, **SAMPLED), prompt)
    monkeypatch.setattr(decoder, "speculative_accept", _wrong_rule)
    spec = _end_to_end_counts(pair_pipeline, GenerationConfig(k=3, seed=12, **SAMPLED), prompt)
    a, b = [x[0] for x in plain], [x[0] for x in spec]
    tokens = sorted(set(a) | set(b))
    table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
    assert chi2_contingency(table[:, table.sum(0) >= 5]).pvalue < ALPHA
