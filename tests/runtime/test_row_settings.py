"""Each row of a batch decodes with its own settings: its output does not depend on what shares its batch."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.acceptance import speculative_accept
from specdeploy.runtime.sampling import sample

from .test_hardening import FailingEngine

ALPHA = 1e-3
FIXED = dict(policy="fixed", drafter="model")  # the batch drafts a known K, so that rows' draws are comparable
BATCH = GenerationConfig(k=4, **FIXED, max_new_tokens=24, ignore_eos=True)  # the batch's speculation
GREEDY = GenerationConfig(k=4, **FIXED, max_new_tokens=24, ignore_eos=True)
SAMPLED = GenerationConfig(k=4, **FIXED, max_new_tokens=20, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
OTHER = GenerationConfig(k=4, **FIXED, max_new_tokens=12, temperature=1.3, top_k=20, seed=9, ignore_eos=True)
CAPPED = GenerationConfig(k=1, **FIXED, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


def _alone(pipeline, prompt, config):
    return pipeline.generate([prompt], config)[0]


def test_rows_with_their_own_settings_decode_as_alone(pipeline):
    prompts = ["w5 w6 w7", "w10 w11 w12 w13", "w30 w31 w30 w31", "w20", "w5 w6"]
    words = _alone(pipeline, prompts[4], GREEDY).text.split()
    stopped = GenerationConfig(**{**GREEDY.__dict__, "stop": (words[len(words) // 2],)})  # a word it reaches mid-way
    configs = [GREEDY, SAMPLED, OTHER, CAPPED, stopped]
    run = pipeline.start(prompts, BATCH, configs)
    while not run.done:
        run.step()
    results = [pipeline.result(row, config) for row, config in zip(run.results, configs)]
    for prompt, config, result in zip(prompts, configs, results):
        alone = _alone(pipeline, prompt, config)
        assert (result.token_ids, result.text, result.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert [len(r.token_ids) for r in results[:4]] == [24, 20, 12, 24]
    assert results[4].finish_reason == "stop" and len(results[4].token_ids) < 24
    assert max(rec.drafted for rec in run.results[3].records) == 1 == max(rec.accepted for rec in run.results[3].records)
    assert max(rec.accepted for rec in run.results[0].records) > 1 and max(rec.drafted for rec in run.results[0].records) == 4


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_seeded_row_is_the_same_whatever_its_batch_mates_and_their_faults(pipeline, role):
    """#16: under sampling with a draft model, rows A and C of [A, B, C] and of [A, faulty, C] and alone agree."""
    configs = [SAMPLED, OTHER, GenerationConfig(**{**SAMPLED.__dict__, "seed": 6})]
    prompts = ["w5 w6 w7", "w10 w11 w12", "w30 w31 w30"]
    drafted = []
    clean = [r.token_ids for r in _run(pipeline, prompts, configs, drafted)]
    # the poison must be nowhere in A's and C's tokens: not in what they emit, nor in what is drafted for them
    used = {t for ids in clean for t in ids} | {int(t) for p in prompts for t in pipeline.encode(p)} | set(drafted)
    poison = next(t for t in range(4, 120) if t not in used)
    original = getattr(pipeline, role)
    setattr(pipeline, role, FailingEngine(original, poison=poison))
    try:
        faulty = _run(pipeline, [prompts[0], f"w10 w{poison}", prompts[2]], configs)
    finally:
        setattr(pipeline, role, original)
    assert faulty[1].finish_reason == "error" and "injected engine fault" in faulty[1].error
    assert [faulty[0].token_ids, faulty[2].token_ids] == [clean[0], clean[2]]
    assert clean[0] == _alone(pipeline, prompts[0], configs[0]).token_ids
    others = _run(pipeline, ["w40 w41", "w9 w9 w9 w9", prompts[2]], [GREEDY, CAPPED, configs[2]])
    assert others[2].token_ids == clean[2] == _alone(pipeline, prompts[2], configs[2]).token_ids


def _run(pipeline, prompts, configs, drafted=None):
    """The rows of one batch of ``prompts`` under ``configs``; ``drafted`` collects every token drafted."""
    run = pipeline.start(prompts, BATCH, configs)
    propose = run.drafter.propose

    def recorded(*args):
        proposal = propose(*args)
        if drafted is not None:
            drafted.extend(proposal.drafts.ravel().tolist())
        return proposal

    run.drafter.propose = recorded
    while not run.done:
        run.step()
    return run.results


def test_a_row_capped_below_the_batchs_k_still_samples_the_target_distribution():
    vocab, k, trials = 6, 3, 20000
    rng = np.random.default_rng(4)
    p1 = rng.gamma(0.7, size=(1, k + 1, vocab))
    p1 /= p1.sum(-1, keepdims=True)
    q1 = rng.gamma(0.7, size=(1, k, vocab))
    q1 /= q1.sum(-1, keepdims=True)
    p, q = np.repeat(p1, trials, axis=0), np.repeat(q1, trials, axis=0)
    rngs = [np.random.default_rng([4, t]) for t in range(trials)]
    drafts = np.stack([[sample(q[t, i], rngs[t]) for i in range(k)] for t in range(trials)])
    accepted, emitted = speculative_accept(p, q, drafts, rngs, limits=[1] * trials)
    assert accepted.max() == 1 and 0 < accepted.mean() < 1
    assert chisquare(np.bincount(emitted[:, 0], minlength=vocab), p1[0, 0] * trials).pvalue >= ALPHA
    # after the one draft it may keep, the next token comes from p there (the bonus), not the residual
    kept = accepted == 1
    counts = np.bincount(emitted[kept, 1], minlength=vocab)
    expected = p1[0, 1] * kept.sum()
    assert chisquare(counts[expected > 0], expected[expected > 0]).pvalue >= ALPHA
    assert (emitted[~kept, 1] == -1).all()


def test_mixed_rows_sample_the_target_distribution_end_to_end(pipeline):
    """Sampled rows capped at one draft in a batch with greedy rows, against plain sampling."""
    sampled = dict(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=4, ignore_eos=True)
    rows, prompt = 1200, "w30 w31 w30 w31 w30"
    plain = pipeline.generate([prompt] * rows, GenerationConfig(drafter="none", seed=11, **sampled))
    configs = [GenerationConfig(k=1 + b % 3, **FIXED, seed=12 + b, **sampled) if b % 4 else GREEDY for b in range(rows)]
    run = pipeline.start([prompt] * rows, GenerationConfig(k=3, **FIXED, max_new_tokens=24, ignore_eos=True), configs)
    while not run.done:
        run.step()
    spec = [row for b, row in enumerate(run.results) if b % 4]
    assert any(rec.accepted >= 1 for row in spec for rec in row.records)
    greedy = _alone(pipeline, prompt, GREEDY).token_ids
    assert all(row.token_ids == greedy for b, row in enumerate(run.results) if b % 4 == 0)
    for position in (0, 1):
        a = [r.token_ids[position] for r in plain]
        b = [r.token_ids[position] for r in spec]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
        table = table[:, table.sum(0) >= 5]
        assert table.shape[1] >= 2
        assert chi2_contingency(table).pvalue >= ALPHA, f"position {position}: {table}"


@pytest.mark.parametrize("call,match", [
    (lambda p: p.start(["w5", "w6"], BATCH, [GREEDY]), r"row_configs: got .*; expected one GenerationConfig per prompt \(2\)"),
    (lambda p: p.start(["w5"], BATCH, [{"temperature": 1}]), r"row_configs: got .*; expected one GenerationConfig"),
    (lambda p: p.start(["w5"], BATCH, capacity=10_000), r"capacity: got 10000; expected an integer in \[1, 96\]"),
    (lambda p: p.start(["w5 " * 60], BATCH, capacity=70),
     r"cache slots, but capacity is 70 slots a row \(as asked\); shorten the prompt, lower max_new_tokens or k$"),
])
def test_bad_row_settings_are_refused_naming_the_argument(pipeline, call, match):
    from specdeploy.runtime.cache import CapacityError
    from specdeploy.runtime.config import ConfigError

    with pytest.raises((ConfigError, CapacityError), match=match):
        call(pipeline)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_one_seeded_config_for_a_batch_gives_a_and_c_the_same_tokens_beside_a_faulty_b(pipeline, role):
    """The issue's case as reported: generate([A, B, C], one config with a seed) against [A, faulty, C]."""
    config = GenerationConfig(k=4, **FIXED, max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    prompts = ["w5 w6 w7", "w10 w11 w12", "w30 w31 w30"]
    clean = [r.token_ids for r in pipeline.generate(prompts, config)]
    used = {t for ids in clean for t in ids} | {int(t) for p in prompts for t in pipeline.encode(p)}
    poison = next(t for t in range(4, 120) if t not in used)
    original = getattr(pipeline, role)
    setattr(pipeline, role, FailingEngine(original, poison=poison))
    try:
        faulty = pipeline.generate([prompts[0], f"w10 w{poison}", prompts[2]], config)
    finally:
        setattr(pipeline, role, original)
    assert faulty[1].finish_reason == "error"
    assert [faulty[0].token_ids, faulty[2].token_ids] == [clean[0], clean[2]]
