"""Greedy speculative output equals the target's own greedy output, token for token."""

from __future__ import annotations

import pytest

from specdeploy import GenerationConfig, Pipeline

PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w20", "w30 w31 w30 w31 w30"]
NEW = 24


@pytest.fixture(scope="module", params=["explicit", "fused"])
def pipelines(request):
    """The close, self and noise pairs in each graph form (the fused one writes its cache in place)."""
    if request.param == "fused":
        dirs = request.getfixturevalue("fused_dirs")
    else:
        dirs = {name: request.getfixturevalue(f"{name}_dir") for name in ("self", "noise")}
        dirs["close"] = request.getfixturevalue("pair_dir")
    pipelines = {name: Pipeline.load(d) for name, d in dirs.items()}
    assert {p.target.spec.graph for p in pipelines.values()} == {request.param}
    return pipelines


@pytest.fixture(scope="module")
def baseline(pipelines):
    """Plain target decoding, one prompt at a time."""
    config = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True)
    return [pipelines["close"].generate([p], config)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("policy", ["fixed", "confidence", "heuristic", "cost"])
@pytest.mark.parametrize("draft", ["close", "self", "noise"])
def test_model_drafter_is_lossless(pipelines, baseline, k, policy, draft):
    config = GenerationConfig(k=k, policy=policy, max_new_tokens=NEW, ignore_eos=True)
    results = pipelines[draft].generate(PROMPTS, config)  # batch 4, ragged acceptance
    assert [r.token_ids for r in results] == baseline
    assert all(len(r.token_ids) == NEW for r in results)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "suffix", "hybrid", "none"])
def test_every_batch_size_and_drafter_is_lossless(pipelines, baseline, batch_size, drafter):
    config = GenerationConfig(k=3, drafter=drafter, max_new_tokens=NEW, ignore_eos=True)
    results = pipelines["close"].generate(PROMPTS, config, batch_size=batch_size)
    assert [r.token_ids for r in results] == baseline


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("policy", ["fixed", "heuristic", "cost"])
def test_prompt_lookup_is_lossless(pipelines, baseline, k, policy):
    config = GenerationConfig(k=k, policy=policy, drafter="prompt-lookup", max_new_tokens=NEW, ignore_eos=True)
    assert [r.token_ids for r in pipelines["close"].generate(PROMPTS, config)] == baseline


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("policy", ["fixed", "heuristic", "cost"])
def test_suffix_drafter_is_lossless_drafting_from_earlier_answers_too(pipelines, baseline, k, policy):
    """The suffix index drafts from each request's own text and from the pipeline's earlier answers (the baseline's
    among them: every cycle can draft its whole answer), and the output is the target's either way."""
    config = GenerationConfig(k=k, policy=policy, drafter="suffix", max_new_tokens=NEW, ignore_eos=True)
    assert [r.token_ids for r in pipelines["close"].generate(PROMPTS, config)] == baseline
    assert [r.token_ids for r in pipelines["close"].generate(PROMPTS, config, suffix_index=None)] == baseline


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("policy", ["fixed", "heuristic", "cost"])
@pytest.mark.parametrize("draft", ["close", "noise"])
def test_hybrid_drafter_is_lossless(pipelines, baseline, k, policy, draft):
    config = GenerationConfig(k=k, policy=policy, drafter="hybrid", max_new_tokens=NEW, ignore_eos=True)
    assert [r.token_ids for r in pipelines[draft].generate(PROMPTS, config)] == baseline


def test_hybrid_drafter_mixes_index_and_model_rows_losslessly(pipelines, baseline):
    """The batch's cycles include some where rows that repeat themselves draft by the index while the others
    draft with the model, and some with the index alone: the output is still the target's."""
    run = pipelines["close"].start(PROMPTS, GenerationConfig(k=4, policy="fixed", drafter="hybrid", max_new_tokens=NEW,
                                                               ignore_eos=True), suffix_index=None)  # own text alone
    kinds, propose = [], run.drafter.propose

    def spy(state, cache, k, found, caps):
        hits = [len(drafts) > 0 for drafts in found.drafts]
        kinds.append("mixed" if 0 < sum(hits) < len(hits) else "index" if all(hits) else "model")
        return propose(state, cache, k, found, caps)

    run.drafter.propose = spy
    while not run.done:
        run.step()
    assert {"mixed", "model"} <= set(kinds)
    assert [row.token_ids for row in run.results] == baseline


def test_ragged_acceptance_happens(pipelines):
    """The close pair really exercises ragged rows: in some cycle, rows accept different counts."""
    run = pipelines["close"].start(PROMPTS, GenerationConfig(k=4, policy="fixed", drafter="model", max_new_tokens=NEW,
                                                                      ignore_eos=True))
    ragged = False
    while not run.done:
        run.step()
        last = [run.results[i].records[-1].accepted for i in range(len(PROMPTS)) if run.results[i].records]
        ragged |= len(set(last)) > 1
    assert ragged


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_equal_to_target_accepts_every_token(pipelines, k):
    config = GenerationConfig(k=k, policy="fixed", drafter="model", max_new_tokens=NEW, ignore_eos=True)
    for result in pipelines["self"].generate(PROMPTS, config):
        verified = [r for r in result.records if r.drafted > 0]
        assert verified and all(r.accepted == r.drafted and r.final == "bonus" for r in verified)
        assert result.stats["acceptance_rate"] == 1.0


def test_noise_draft_is_mostly_rejected_yet_output_is_identical(pipelines, baseline):
    results = pipelines["noise"].generate(PROMPTS, GenerationConfig(k=4, policy="fixed", drafter="model", max_new_tokens=NEW,
                                                                    ignore_eos=True))
    assert [r.token_ids for r in results] == baseline
    assert max(r.stats["acceptance_rate"] for r in results) < 0.5


def test_stop_token_stops_a_row_and_it_leaves_the_batch(pipelines):
    pipeline = pipelines["close"]
    plain = pipeline.generate(PROMPTS, GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    stop = plain[1].token_ids[5]  # a token the second row emits mid-way
    results = pipeline.generate(PROMPTS, GenerationConfig(k=4, max_new_tokens=NEW, stop_token_ids=(stop,)))
    cut_rows = 0
    for result, reference in zip(results, plain):
        cut = next((i + 1 for i, t in enumerate(reference.token_ids) if t == stop), None)
        assert result.token_ids == reference.token_ids[: cut or NEW]
        assert result.finish_reason == ("eos" if cut else "length")
        cut_rows += cut is not None and cut < NEW
    assert cut_rows >= 1
