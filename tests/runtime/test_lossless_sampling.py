"""Speculative sampling emits exactly the target's distribution (after the same logit processing).

Both rules are tested: rejection sampling (requests without a seed) and keyed verification (seeded requests,
each position drawn from noise keyed by its seed and position). Chi-square tests on repeatable runs, each with
a negative control: the same test applied to a wrong rule must reject it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

import specdeploy.runtime.acceptance as acceptance
import specdeploy.runtime.rows as rows  # where a request gets its generator (Roster.join)
from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.acceptance import keyed_accept_row, speculative_accept
from specdeploy.runtime.sampling import keyed_noise, keyed_token, sample

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


def _keyed_first_tokens(rule, seed=0):
    """The first emitted token over TRIALS seeds, in one fixed situation: the draft proposes from q by the same keyed
    noise, the target verifies by ``rule``."""
    rng = np.random.default_rng(seed)
    p, q = _random_dists(rng, (K + 1,)), _random_dists(rng, (K,))
    first, kept = [], []
    for trial in range(TRIALS // 4):
        noise = [keyed_noise(trial, 0, position, VOCAB) for position in range(K + 1)]
        drafts = [keyed_token(q[i], noise[i]) for i in range(K)]
        accepted, tokens = rule(p, drafts, K, noise)
        first.append(tokens[0] if accepted == 0 else drafts[0])
        kept.append(accepted)
    return p, np.array(first), np.array(kept)


def _keyed_wrong_rule(p, drafts, drafted, noise):
    """Keep every draft: the emitted tokens follow q, not p."""
    return drafted, list(drafts) + [keyed_token(p[drafted], noise[drafted])]


def test_keyed_verification_emits_the_targets_distribution_and_catches_a_wrong_rule():
    p, first, kept = _keyed_first_tokens(keyed_accept_row)
    assert chisquare(np.bincount(first, minlength=VOCAB), p[0] * len(first)).pvalue >= ALPHA
    assert 0 < kept.mean() < K  # both kept and rejected drafts
    p, first, _ = _keyed_first_tokens(_keyed_wrong_rule)
    assert chisquare(np.bincount(first, minlength=VOCAB), p[0] * len(first)).pvalue < ALPHA


def test_keyed_verification_keeps_fewer_drafts_than_rejection_sampling_and_at_least_its_bound():
    """The price of reproducible seeds: at total variation d between p and q a draft is kept with probability at
    least (1 - d) / (1 + d), where rejection sampling keeps it with probability 1 - d."""
    rng = np.random.default_rng(5)
    for _ in range(3):
        p, q = _random_dists(rng, (1,))[0], _random_dists(rng, (1,))[0]
        d = 0.5 * np.abs(p - q).sum()
        kept = np.mean([keyed_token(p, noise) == keyed_token(q, noise)
                        for noise in (keyed_noise(t, 0, 0, VOCAB) for t in range(4000))])
        assert (1 - d) / (1 + d) - 0.03 <= kept <= 1 - d + 0.03


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
        assert any(rec.drafted >= 2 for r in results for rec in r.records)
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


def _repeatable(base: int):
    """A stand-in for ``rows.unseeded_generator``: each row without a seed gets the next generator of ``base``'s
    stream, so that a run repeats."""
    seeds = itertools.count()
    return lambda: np.random.default_rng([base, next(seeds)])


@pytest.fixture(params=["keyed", "rejection"])
def rule(request, monkeypatch):
    """Seeded rows (keyed verification), or rows without a seed (rejection sampling) whose generators are made
    repeatable here: the seed a test passes is then only the generators' base."""
    if request.param == "rejection":
        monkeypatch.setattr(rows, "unseeded_generator", _repeatable(99))
    return request.param


def _sampled(rule, seed, **settings):
    return GenerationConfig(seed=seed if rule == "keyed" else None, **settings, **SAMPLED)


PROMPT = "w30 w31 w30 w31 w30"


@pytest.fixture(scope="module")
def plain_counts():
    """(pipeline, rule) -> plain decoding's joint counts of the first two tokens, sampled once for every test that
    compares a speculative run with them (the same run each time: seed 11, or its own generators, apart from the ones
    ``rule`` gives the speculative rows)."""
    made = {}  # (pipeline, rule) -> counts

    def get(pipeline, rule):
        if (pipeline, rule) not in made:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(rows, "unseeded_generator", _repeatable(98))
                made[pipeline, rule] = _end_to_end_counts(pipeline, _sampled(rule, 11, drafter="none"), PROMPT)
        return made[pipeline, rule]

    return get


def _same_distribution(plain, spec) -> None:
    for position in (0, 1):
        a = [x[position] for x in plain]
        b = [x[position] for x in spec]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
        table = table[:, table.sum(0) >= 5]  # chi-square needs non-tiny cells
        assert table.shape[1] >= 2, "the processed distribution should not be degenerate"
        assert chi2_contingency(table).pvalue >= ALPHA, f"position {position}: {table}"


@pytest.mark.parametrize("draft,drafter,policy", [
    ("close", "model", "fixed"), ("noise", "model", "fixed"), ("close", "prompt-lookup", "fixed"),
    ("close", "model", "confidence"), ("close", "hybrid", "fixed"), ("noise", "hybrid", "fixed"),
    ("close", "suffix", "fixed"),  # drafts from its own text and from the earlier samples' texts
])
def test_pipeline_sampling_matches_plain_sampling(pair_pipeline, noise_pipeline, plain_counts, rule, draft, drafter,
                                                  policy):
    pipeline = pair_pipeline if draft == "close" else noise_pipeline
    spec = _end_to_end_counts(pipeline, _sampled(rule, 12, drafter=drafter, policy=policy, k=3), PROMPT)
    _same_distribution(plain_counts(pipeline, rule), spec)


def test_same_seed_same_output(pair_pipeline):
    config = GenerationConfig(temperature=1.0, top_p=0.95, seed=7, k=3, max_new_tokens=20, ignore_eos=True)
    a = pair_pipeline.generate(["w5 w6 w7", "w8"], config)
    b = pair_pipeline.generate(["w5 w6 w7", "w8"], config)
    c = pair_pipeline.generate(["w5 w6 w7", "w8"], GenerationConfig(**{**config.__dict__, "seed": 8}))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


@pytest.mark.parametrize("drafter,policy,k", [("none", "fixed", 0), ("model", "fixed", 1), ("model", "fixed", 6),
                                              ("hybrid", "cost", 8), ("prompt-lookup", "heuristic", 4),
                                              ("suffix", "fixed", 8)])
def test_a_seeded_request_gives_the_same_text_whatever_the_speculation(pair_pipeline, drafter, policy, k):
    """A seeded row's draws are keyed by its seed and positions: plain decoding, any drafter, policy and K, alone or
    beside other rows, give one text."""
    sampled = dict(temperature=0.9, top_k=20, seed=21, max_new_tokens=24, ignore_eos=True)
    plain = pair_pipeline.generate(["w30 w31 w30 w31"], GenerationConfig(drafter="none", **sampled))[0].token_ids
    config = GenerationConfig(drafter=drafter, policy=policy, k=k, **sampled)
    assert pair_pipeline.generate(["w30 w31 w30 w31"], config)[0].token_ids == plain
    mates = GenerationConfig(drafter=drafter, policy=policy, k=k, max_new_tokens=24, ignore_eos=True)
    run = pair_pipeline.start(["w5 w6", "w30 w31 w30 w31", "w9"], mates, [mates, config, GenerationConfig(
        temperature=1.2, max_new_tokens=10, ignore_eos=True)])
    while not run.done:
        run.step()
    assert run.results[1].token_ids == plain


def test_pipeline_negative_control_wrong_rule_is_caught(pair_pipeline, plain_counts, rule, monkeypatch):
    """The end-to-end test has the power to catch a wrong rule, of either kind, through the whole pipeline."""
    plain = plain_counts(pair_pipeline, rule)
    if rule == "keyed":
        monkeypatch.setattr(acceptance, "keyed_accept_row", _keyed_wrong_rule)
    else:
        monkeypatch.setattr(acceptance, "speculative_accept", _wrong_rule)
    spec = _end_to_end_counts(pair_pipeline, _sampled(rule, 12, k=3, policy="fixed", drafter="model"), PROMPT)
    a, b = [x[0] for x in plain], [x[0] for x in spec]
    tokens = sorted(set(a) | set(b))
    table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
    assert chi2_contingency(table[:, table.sum(0) >= 5]).pvalue < ALPHA
