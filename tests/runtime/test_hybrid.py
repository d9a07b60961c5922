"""The hybrid drafter under a policy: each source drafts as the policy prices it (the model's drafts, its catch-up,
prompt lookup's drafts), and whatever it chooses, the output is the target's."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from specdeploy.runtime.policies import Policy

from .test_drafters import _hybrid, _propose, _state

PROMPTS = ["w5 w6 w5 w6 w5 w6 w5", "w30 w31 w32 w30 w31 w32 w30 w31", "w20"]
NEW = 20


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


@pytest.fixture(scope="module")
def baseline(pipeline):
    return [r.token_ids for r in pipeline.generate(PROMPTS, GenerationConfig(drafter="none", max_new_tokens=NEW,
                                                                               ignore_eos=True))]


class Recorder(Policy):
    """Drafts ``model`` tokens by the draft model and ``lookup`` by prompt lookup; ``catch_up`` answers catch-ups."""

    def __init__(self, model: int, lookup: int, catch_up: bool = True):
        self.model, self.lookup, self.catch_up, self.outcomes, self.asked = model, lookup, catch_up, [], []

    def next_k(self, batch: int, lookup: bool = False) -> int:
        return self.lookup if lookup else self.model

    def catchup_pays(self, batch: int, behind: int, to_come: int) -> bool:
        self.asked.append((batch, behind, to_come))
        return self.catch_up

    def observe(self, outcome) -> None:
        self.outcomes.append(outcome)


def _run(pipeline, prompts, policy):
    run = pipeline.start(prompts, GenerationConfig(k=4, drafter="hybrid", max_new_tokens=NEW, ignore_eos=True))
    run.policy = policy
    calls = []
    while not run.done:
        run.step()
        calls.append(run.draft_cache.past_len.tolist())
    return run, calls


@pytest.mark.parametrize("model,catch_up", [(0, True), (4, False)], ids=["model refused", "catch-up refused"])
def test_a_row_left_to_the_index_never_calls_the_model(pipeline, baseline, model, catch_up):
    """The policy refuses the draft model (its drafts, or its catch-up on the prompt) but not the index: the model
    is never called, the output is the target's, and the policy hears free drafts only."""
    for prompt, expected in zip(PROMPTS[:2], baseline[:2]):
        policy = Recorder(model, 4, catch_up)
        run, seen = _run(pipeline, [prompt], policy)
        assert not any(any(past) for past in seen)  # the model has seen nothing: never called
        assert run.results[0].token_ids == expected
        drafted = [o for o in policy.outcomes if any(o.drafted)]
        assert drafted and all(all(o.free) and o.first_call_seconds == 0 for o in drafted)
        assert bool(policy.asked) == (model > 0)  # a refused catch-up was asked about; a refused model never got there


def test_a_batch_stays_plain_where_the_policy_refuses_both_sources(pipeline, baseline):
    policy = Recorder(0, 0)
    run, _ = _run(pipeline, PROMPTS, policy)
    assert [row.token_ids for row in run.results] == baseline
    assert {o.verify_tokens for o in policy.outcomes} == {1}


def test_rows_draft_by_the_index_or_the_model_in_one_cycle_and_the_policy_hears_which(pipeline, baseline):
    policy = Recorder(3, 2)
    run, _ = _run(pipeline, PROMPTS, policy)
    assert [row.token_ids for row in run.results] == baseline
    mixed = [o for o in policy.outcomes if any(o.free) and not all(o.free)]
    assert mixed  # some cycle had an index row beside a model row
    for outcome in mixed:
        for drafted, free in zip(outcome.drafted, outcome.free):
            assert drafted <= (2 if free else 3)


@pytest.mark.parametrize("model_k", [0, 1])
def test_an_index_draft_is_as_long_as_the_policy_prices_it_whatever_k_the_model_got(pair_dir, model_k):
    """An index draft costs no model call: the K chosen for the model's drafts (1, where a model draft is dear) does not
    cut it. It stays within the row's cap (its k and tokens left)."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    tokens = np.zeros((1, 64), np.int64)
    tokens[0, :10] = [1, 2, 3, 9, 4, 5, 6, 7, 1, 2]  # "1 2" seen before, followed by 3 9 4 5 6 7
    drafter, cache = _hybrid(engine), engine.allocate_cache(1, 64)
    state = _state(tokens, [10], GenerationConfig(k=4, max_new_tokens=32))
    proposal = _propose(drafter, state, cache, model_k, 4, [4])
    assert proposal.free == [True] and proposal.drafts.tolist() == [[3, 9, 4, 5]] and proposal.drafted == [4]
    assert _propose(drafter, state, cache, model_k, 4, [2]).drafts.tolist() == [[3, 9]]  # 3 tokens left: 2 drafts
