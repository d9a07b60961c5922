"""The hybrid drafter's choices: lookup rows that stop paying give way to the model, and a policy that finds the
model's catch-up or drafting not worth paying leaves the rows to lookup alone, never to a wrong token."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from specdeploy.runtime.drafters import HybridDrafter

from .test_drafters import _state

PROMPTS = ["w5 w6 w5 w6 w5 w6 w5", "w30 w31 w32 w30 w31 w32 w30 w31", "w20"]
NEW = 20


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


@pytest.fixture(scope="module")
def baseline(pipeline):
    return [r.token_ids for r in pipeline.generate(PROMPTS, GenerationConfig(drafter="none", max_new_tokens=NEW,
                                                                               ignore_eos=True))]


class Recorder:
    """A policy that never wants the draft model: ``catch_up`` False refuses its catch-up as well."""

    learns = True

    def __init__(self, k: int, catch_up: bool | None = None):
        self.k, self.outcomes = k, []
        self.weighs_catchup = catch_up is not None

    def next_k(self) -> int:
        return self.k

    def catchup_pays(self, batch: int, behind: int, to_come: int) -> bool:
        return False

    def observe(self, outcome) -> None:
        self.outcomes.append(outcome)


@pytest.mark.parametrize("catch_up", [None, False], ids=["plain", "no-catchup"])
def test_a_row_left_to_lookup_alone_never_calls_the_model(pipeline, baseline, catch_up):
    """A single row's plain cycles (the policy's k = 0) and refused catch-ups become lookup cycles: the
    model is never called, the output is the target's, and the policy learns no acceptance from them."""
    verified = []
    for prompt, expected in zip(PROMPTS[:2], baseline[:2]):  # (a 1-token prompt leaves nothing to catch up on)
        policy = Recorder(0 if catch_up is None else 4, catch_up)
        run = pipeline.start([prompt], GenerationConfig(k=4, drafter="hybrid", max_new_tokens=NEW, ignore_eos=True))
        run.policy = policy
        while not run.done:
            run.step()
            assert not run.drafter.cache.past_len.any()  # the model has seen nothing: never called
        assert run.rows[0].token_ids == expected
        assert all(o.proposed == 0 and o.draft_steps == 0 for o in policy.outcomes)
        verified.append(max(o.verify_tokens for o in policy.outcomes))
    assert min(verified) > 1  # the repeating prompts' lookup drafts were verified


def test_rows_of_a_batch_stay_plain_where_the_policy_says_so(pipeline, baseline):
    """From 2 rows on, a row's lookup drafts would cost about what a plain step costs the whole batch:
    the policy's plain cycles stay plain."""
    policy = Recorder(0)
    run = pipeline.start(PROMPTS, GenerationConfig(k=4, drafter="hybrid", max_new_tokens=NEW, ignore_eos=True))
    run.policy = policy
    while not run.done:
        run.step()
    assert [row.token_ids for row in run.rows] == baseline
    assert {o.verify_tokens for o in policy.outcomes} == {1}


def test_a_row_whose_lookups_are_rejected_drafts_with_the_model_then_retries(pair_dir):
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    tokens = np.zeros((1, 64), np.int64)
    tokens[0, :6] = [1, 2, 3, 9, 1, 2]  # "1 2" seen before
    drafter = HybridDrafter(engine)
    drafter.start(1, 64, GenerationConfig(k=3), None)
    state = _state(tokens, [6])
    assert drafter.propose(state, 3).without_model  # a first lookup is tried
    drafter.rollback([6])  # and nothing of it accepted
    assert drafter.gains[0] < drafter.min_gain
    proposal = drafter.propose(state, 3)
    assert proposal.steps > 0 and not proposal.without_model  # the model drafts instead
    drafter.rollback([5])  # (the state stays at 6 tokens: the model keeps 5, as after a cycle it is one behind)
    skipped = 1
    while drafter.propose(state, 3).steps:  # each skipped match brings a retry nearer
        drafter.rollback([5])
        skipped += 1
    assert 2 <= skipped <= 1 / drafter.retry
    drafter.rollback([6 + 3])  # the retried lookup accepted all 3
    assert drafter.gains[0] >= drafter.min_gain


def test_a_row_whose_lookups_pay_keeps_them(pair_dir):
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    tokens = np.zeros((1, 64), np.int64)
    tokens[0, :6] = [1, 2, 3, 9, 1, 2]
    drafter = HybridDrafter(engine)
    drafter.start(1, 64, GenerationConfig(k=3), None)
    for _ in range(5):
        assert drafter.propose(_state(tokens, [6]), 3).without_model
        drafter.rollback([6 + 2])  # two of three accepted each time
    assert drafter.gains[0] >= 1.9



@pytest.mark.parametrize("model", [True, False], ids=["with the model", "lookup alone"])
def test_a_lookup_is_as_long_as_its_record_whatever_k_the_policy_chose_for_the_model(pair_dir, model):
    """A lookup costs no model call: the K a policy chooses for the model's drafts (1, where a model draft is dear)
    does not cut it. Capped at that K, lookups that copied a retrieved passage 4 tokens a cycle were cut to 1
    (tools/replay.py). It stays within the request's k and the tokens the row has left."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    tokens = np.zeros((1, 64), np.int64)
    tokens[0, :10] = [1, 2, 3, 9, 4, 5, 6, 7, 1, 2]  # "1 2" seen before, followed by 3 9 4 5 6 7
    drafter = HybridDrafter(engine)
    drafter.start(1, 64, GenerationConfig(k=4, max_new_tokens=32), None)
    drafter.gains[0] = 3.0  # its lookups have been gaining 3 tokens: the next proposes 4
    proposal = drafter.propose(_state(tokens, [10], GenerationConfig(k=4, max_new_tokens=32)), 1, model=model)
    assert proposal.without_model and proposal.drafts.tolist() == [[3, 9, 4, 5]]
    assert proposal.limits is None  # all four may be kept
    short = _state(tokens, [10], GenerationConfig(k=4, max_new_tokens=3))  # 3 tokens left: 2 drafts and the target's
    assert drafter.propose(short, 1, model=model).drafts.tolist() == [[3, 9]]
