"""Requests join a running batch and leave it early; every other request's output stays what it is alone."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.cache import CapacityError
from specdeploy.runtime.drafters import Found, HybridDrafter, ModelDrafter, SuffixDrafter
from specdeploy.runtime.telemetry import FinishReason

from .stubs import Judge

CONFIG = GenerationConfig(k=3, policy="fixed", drafter="model", max_new_tokens=16, ignore_eos=True)
PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14", "w20", "w30 w31 w30 w31"]


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    # prompts prefilled from nothing, every time: these tests follow prefills and joins, not the prefix cache's reuse
    return Pipeline.load(pair_dir, prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def alone(pipeline):
    return {p: pipeline.generate(p, CONFIG)[0].token_ids for p in PROMPTS}


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "suffix", "hybrid", "none"])
@pytest.mark.parametrize("join_after", [0, 1, 4])
def test_requests_joining_a_running_batch_decode_as_alone(pipeline, alone, drafter, join_after):
    config = GenerationConfig(k=3, max_new_tokens=16, ignore_eos=True, drafter=drafter)
    # no index shared with the earlier runs of these prompts: they would finish before the others join
    run = pipeline.start(PROMPTS[:2], config, suffix_index=None)
    for _ in range(join_after):
        run.step()
    run.join([pipeline.encode(p) for p in PROMPTS[2:]], ["late-a", "late-b"])
    assert len(run.active) == 4 and run.cache.shape[1] == 4
    while not run.done:
        run.step()
        _assert_target_saw_all_but_the_last_token(run)  # where the next verification starts (``cycle_rows``)
    expected = alone if drafter == "model" else {p: pipeline.generate(p, config, suffix_index=None)[0].token_ids
                                                 for p in PROMPTS}
    assert [row.token_ids for row in run.results] == [expected[p] for p in PROMPTS]
    assert [row.request_id for row in run.results][2:] == ["late-a", "late-b"]
    assert all(row.finish_reason == "length" and row.prefill_seconds > 0 for row in run.results)


def _assert_target_saw_all_but_the_last_token(run):
    assert run.cache.past_len.tolist() == [length - 1 for length in run.state.lengths]


def test_a_cancelled_request_leaves_and_frees_its_rows(pipeline, alone):
    run = pipeline.start(PROMPTS, CONFIG)
    for _ in range(2):
        run.step()
    run.cancel(1)
    assert run.results[1].finish_reason == FinishReason.CANCELLED and list(run.active) == [0, 2, 3]
    assert run.cache.shape[1] == 3 and run.draft_cache.shape[1] == 3
    run.cancel(1)  # leaving twice changes nothing
    while not run.done:
        run.step()
        _assert_target_saw_all_but_the_last_token(run)
    assert [run.results[i].token_ids for i in (0, 2, 3)] == [alone[PROMPTS[i]] for i in (0, 2, 3)]
    assert len(run.results[1].token_ids) < len(alone[PROMPTS[1]])


def test_a_request_that_cannot_fit_is_refused_and_the_batch_goes_on(pipeline, alone):
    run = pipeline.start(PROMPTS[:1], CONFIG)
    run.step()
    with pytest.raises(CapacityError, match=r"prompt \(40 tokens\) \+ k \(3\) \+ 1 = 44 cache slots leave no room for a new token"):
        run.join([pipeline.encode("w5 " * 40)], ["too-long"])
    while not run.done:
        run.step()
    assert len(run.results) == 1 and run.results[0].token_ids == alone[PROMPTS[0]]


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "suffix", "hybrid", "none"])
def test_requests_prefilled_a_chunk_at_a_time_between_cycles_then_merged_decode_as_alone(pipeline, drafter):
    """What a server does: the running batch keeps cycling while newcomers prefill in chunks beside it."""
    config = GenerationConfig(k=3, max_new_tokens=16, ignore_eos=True, drafter=drafter)
    expected = {p: pipeline.generate(p, config)[0].token_ids for p in PROMPTS}
    run = pipeline.start(PROMPTS[:2], config, capacity=64)
    run.step()
    staging = pipeline.start(PROMPTS[2:], config, capacity=64)
    chunks, cycles = 0, 0
    while not staging.prefill_chunk(1):
        chunks += 1
        cycles += len(run.step()) > 0  # the running rows go on between chunks
        if drafter == "model":  # the draft prefills beside the target, a chunk at a time
            assert staging.draft_cache.past_len.tolist() == staging.cache.past_len.tolist() == [
                min(chunks, len(pipeline.encode(p)) - 1) for p in PROMPTS[2:]]
    assert chunks >= 2 and cycles == chunks and staging.prefill_seconds > 0
    if drafter == "model":  # the draft has seen the newcomers' prompts too: no long catch-up in the batch
        assert staging.draft_cache.past_len.tolist() == [len(pipeline.encode(p)) - 1 for p in PROMPTS[2:]]
    run.merge(staging)
    assert len(run.active) == 4 and run.cache.shape[1] == 4
    while not run.done:
        run.step()
    assert [row.token_ids for row in run.results] == [expected[p] for p in PROMPTS]


def test_merging_batches_of_different_capacity_is_refused(pipeline):
    run = pipeline.start(PROMPTS[:1], CONFIG, capacity=64)
    with pytest.raises(ValueError, match="capacity 60 != 64"):
        run.merge(pipeline.start(PROMPTS[1:2], CONFIG, capacity=60))


@pytest.mark.parametrize("pays", [False, True])
def test_rows_prefilled_without_the_draft_decode_plainly_or_catch_up_as_the_policy_judges(pipeline, alone, pays):
    """A server under load skips the draft's prefill of joining rows; a cycle then pays the catch-up only when
    the policy finds it pays, and stays plain otherwise. Either way every row decodes as alone."""
    judge = Judge(pays)
    run = pipeline.start(PROMPTS[:2], CONFIG, capacity=64)
    run.policy = judge
    while not run.prefill_chunk(64):  # as a server starts a batch: the draft prefills beside the target
        pass
    run.step()
    fed = list(judge.fed)
    staging = pipeline.start(PROMPTS[2:], CONFIG, capacity=64)
    staging.policy = judge
    while not staging.prefill_chunk(2, draft=False):
        pass
    assert staging.draft_cache.past_len.tolist() == [0, 0] and judge.fed == fed and judge.asked == []
    run.merge(staging)
    merged_at, lengths, to_come = run.cycle, run.state.lengths, run.to_come(run.state.budgets()[0])
    behind = sum(max(0, n - 2 - past) for n, past in zip(lengths, run.draft_cache.past_len.tolist()))
    while not run.done:
        run.step()
    assert [row.token_ids for row in run.results] == [alone[p] for p in PROMPTS]
    assert judge.asked[0] == (4, behind, to_come) and behind >= sum(len(pipeline.encode(p)) - 2 for p in PROMPTS[2:])
    first = [r.drafted for row in run.results for r in row.records if r.cycle == merged_at]
    drafted = {r.drafted for row in run.results for r in row.records if r.cycle >= merged_at}
    if pays:  # caught up at once, then drafting as usual: asked no more
        assert first == [3] * 4 and len(judge.asked) == 1
    else:
        assert drafted == {0}


def test_a_draft_prefill_tells_the_policy_what_it_fed(pipeline):
    """Each chunk of the draft's prefill reports its time and its widest row's tokens: a catch-up's cost by width."""
    judge = Judge(True)
    staging = pipeline.start(PROMPTS[2:], CONFIG, capacity=64)
    staging.policy = judge
    while not staging.prefill_chunk(2):
        pass
    assert all(0 < fed <= 2 for fed in judge.fed)
    assert sum(judge.fed) == max(len(pipeline.encode(p)) - 1 for p in PROMPTS[2:])


class _PlainThenDraft(Judge):
    """Plain steps first (the draft falls behind), then drafts: the first drafting cycle catches up."""

    def __init__(self, plain_steps: int):
        super().__init__(True)
        self.plain_steps, self.caught_up = plain_steps, []

    def next_k(self, batch, lookup=False):
        self.plain_steps -= 0 if lookup else 1
        return 0 if lookup or self.plain_steps >= 0 else 3

    def observe(self, outcome):
        if outcome.verify_tokens and outcome.first_call_tokens > 2:
            self.caught_up.append((outcome.first_call_seconds, outcome.first_call_tokens))


def test_a_catch_up_inside_a_cycle_tells_the_policy_its_time_and_tokens(pipeline, alone):
    """A request decoded by ``generate`` (no staged prefill) still prices the draft's catch-up: the
    first drafting cycle after 5 plain ones feeds the draft the prompt and those tokens, once, timed."""
    judge = _PlainThenDraft(plain_steps=5)
    run = pipeline.start(PROMPTS[:2], CONFIG)
    run.policy = judge
    while not run.done:
        run.step()
    assert [row.token_ids for row in run.results] == [alone[p] for p in PROMPTS[:2]]
    longest = max(len(pipeline.encode(p)) for p in PROMPTS[:2])
    (seconds, tokens), = judge.caught_up  # later cycles feed 1-2 tokens a row: not a catch-up
    assert seconds > 0 and tokens == longest + 5  # as wide as the row furthest behind: its prompt + 5


@pytest.mark.parametrize("drafter,policy,temperature", [("model", "fixed", 0.0), ("model", "confidence", 0.0),
                                                         ("hybrid", "fixed", 0.0), ("model", "fixed", 1.0),
                                                         ("hybrid", "fixed", 1.0)])
def test_a_draft_said_caught_up_lacks_no_token_a_catch_up_would_feed(pipeline, drafter, policy, temperature):
    # the cycle skips judging a catch-up after one that drafted every row by the model (``draft_caught_up``): the
    # draft must then lack nothing, whatever the drafter, policy, sampling, rows' own k, joins and leaves
    config = GenerationConfig(k=4, policy=policy, drafter=drafter, max_new_tokens=14, ignore_eos=True,
                              temperature=temperature, seed=5)
    short = GenerationConfig(k=2, policy=policy, drafter=drafter, max_new_tokens=9, ignore_eos=True,
                             temperature=temperature, seed=6)
    run = pipeline.start(PROMPTS[:2], config, row_configs=[config, short])
    said, cycles = [], 0
    while not run.done:
        run.step()
        cycles += 1
        if cycles == 3:
            run.join([pipeline.encode(p) for p in PROMPTS[2:]], ["late-a", "late-b"])
            assert not run.draft_caught_up  # the draft has seen nothing of the rows that joined
        if not run.done:
            said.append(run.draft_caught_up)
            if run.draft_caught_up:
                assert run.drafter.behind(run.state, run.draft_cache) == 0
    assert any(said)  # the claim was made, and checked


class TargetsOwnText(SuffixDrafter):
    """Free drafts that are, for request 0 alone, the next tokens of the target's own greedy text: all kept (no
    estimates to price), so the draft, which sees none of them, falls behind by all but one."""

    def __init__(self, text: list[int], prompt_length: int):
        super().__init__()
        self.text, self.prompt_length = text, prompt_length

    def find(self, state, free_k, caps):
        at = state.lengths[0] - self.prompt_length if state.active[0] == 0 else None
        return Found([np.array(self.text[at : at + min(free_k, cap)] if b == 0 and at is not None else [], np.int64)
                      for b, cap in enumerate(caps)])


def test_a_cycle_with_free_rows_does_not_say_the_draft_caught_up(pipeline):
    config = GenerationConfig(k=3, policy="fixed", drafter="hybrid", max_new_tokens=12, ignore_eos=True)
    text = pipeline.generate(PROMPTS[0], config)[0].token_ids
    run = pipeline.start(PROMPTS[:2], config)
    run.drafter = HybridDrafter(TargetsOwnText(text, len(pipeline.encode(PROMPTS[0]))), ModelDrafter(pipeline.draft))
    lagged = 0
    while not run.done:
        run.step()
        if not run.done:
            lag = run.drafter.behind(run.state, run.draft_cache)
            assert not (run.draft_caught_up and lag)
            lagged += lag > 0
    assert lagged and [row.token_ids for row in run.results][0] == text  # free rows left the draft behind, losslessly


def test_a_generations_rows_are_a_deprecated_name_of_its_results(pipeline):
    """``Generation.rows`` (before 0.5) still gives the results by request number, with a DeprecationWarning."""
    run = pipeline.start(PROMPTS[:2], CONFIG, suffix_index=None)
    with pytest.warns(DeprecationWarning, match="Generation.rows is deprecated: use Generation.results"):
        rows = run.rows
    assert rows == run.results and [row.request_id for row in rows] == [r.request_id for r in run.results]
    run.cancel(1)
    assert run.results[1].finish_reason == FinishReason.CANCELLED and list(run.active) == [0]
