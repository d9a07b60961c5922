"""Draft-length policies without any model: the simple ones, and the cost policy's pure functions and choices."""

from __future__ import annotations

import math

import pytest

from specdeploy.runtime.answer_lengths import KEPT, AnswerLengths
from specdeploy.runtime.cost_policy import (
    EXPLORE_SHARE,
    PAST_BAND,
    PRIOR,
    CostPolicy,
    Costs,
    acceptance,
    band,
    best_k,
    call_seconds,
    cycle_prices,
    expected_rates,
    expected_tokens,
)
from specdeploy.runtime.policies import ConfidenceStop, CycleOutcome, FixedK, Heuristic
from specdeploy.runtime.registry import make_policy


def _costs(verify_ms=(10, 10.5, 11, 11.5, 12, 12.5, 13, 13.5, 14), first_ms=2.0, later_ms=2.0, catchup_ms=None, batch=1):
    """A cost table in milliseconds: v(T) for T = 1.., a cycle's first draft call (2 tokens) and later ones (1), and,
    given ``catchup_ms``, a 100-token catch-up at that much a token."""
    draft = {(batch, 1): later_ms / 1e3, (batch, 2): first_ms / 1e3}
    if catchup_ms is not None:
        draft[batch, 100] = 100 * catchup_ms / 1e3
    return Costs({(batch, t + 1): v / 1e3 for t, v in enumerate(verify_ms)}, draft)


def _cycle(k, accepted, lookup=False, batch=1):
    """A cycle of k drafts a row whose verification cost what ``_costs`` says by default (10 ms + 0.5 ms a draft)."""
    rows = accepted if isinstance(accepted, list) else [accepted]
    return CycleOutcome(batch, [k] * len(rows), rows, [lookup] * len(rows), verify_seconds=0.010 + 0.0005 * k,
                        verify_tokens=k + 1)


def test_fixed_confidence_and_heuristic():
    assert FixedK(5).next_k(1) == FixedK(5).next_k(3, lookup=True) == 5 and FixedK(5).stop_below is None
    assert ConfidenceStop(6, 0.3).next_k(1) == 6 and ConfidenceStop(6, 0.3).stop_below == 0.3
    policy = Heuristic(8, start=3)
    for k, kept, then in [(3, 3, 5), (5, 5, 7), (7, 7, 8), (8, 2, 7)]:  # +2 when all kept, capped at 8; -1 otherwise
        policy.observe(_cycle(k, kept))
        assert policy.next_k(1) == then
    for _ in range(20):
        policy.observe(_cycle(policy.next_k(1), 0))
    assert policy.next_k(1) == 1  # never below 1
    policy.observe(_cycle(1, [1, 0]))  # a batch: not every row kept everything
    assert policy.next_k(1) == 1


def test_make_policy_names_the_known_ones():
    assert isinstance(make_policy("cost", 4), CostPolicy) and isinstance(make_policy("fixed", 4), FixedK)
    with pytest.raises(ValueError, match="policy 'greedy' is unknown; expected one of cost, fixed, confidence, heuristic"):
        make_policy("greedy", 4)


def test_acceptance_shrinks_each_position_towards_the_one_before():
    assert acceptance([0, 0], [0, 0]) == pytest.approx([PRIOR, PRIOR])  # nothing seen: the prior everywhere
    a1, a2 = acceptance([9, 4], [3, 1], prior=0.0, weight=1.0)
    assert a1 == pytest.approx(3 / 10) and a2 == pytest.approx((1 + 0.3) / 5)
    a1, _ = acceptance([1, 0], [0, 0], prior=0.7, weight=4.0)
    assert a1 == pytest.approx(2.8 / 5)  # one rejected first draft moves a strong prior a fifth of the way


def test_expected_tokens_and_rates_match_a_hand_computation():
    rates = [0.5, 0.5]
    assert expected_tokens(rates, 0) == 1 and expected_tokens(rates, 2) == pytest.approx(1 + 0.5 + 0.25)
    costs = _costs(verify_ms=(10, 11, 12), first_ms=3, later_ms=2)
    assert cycle_prices(costs, 1, 2, model=True) == pytest.approx([0.010, 0.003 + 0.011, 0.003 + 0.002 + 0.012])
    model = expected_rates(rates, cycle_prices(costs, 1, 2, model=True))
    assert model == pytest.approx([1 / 0.010, 1.5 / (0.003 + 0.011), 1.75 / (0.003 + 0.002 + 0.012)])
    free = expected_rates(rates, cycle_prices(costs, 1, 2, model=False))  # prompt lookup: no draft call
    assert free == pytest.approx([1 / 0.010, 1.5 / 0.011, 1.75 / 0.012])
    assert cycle_prices(Costs(), 1, 2, model=True) is None  # nothing measured: no price
    assert expected_rates(rates, None) is None
    assert best_k([1.0, 2.0, 2.0]) == 1  # a tie: the fewer drafts


def test_call_costs_between_and_beyond_what_was_measured():
    table = {(1, 1): 0.010, (1, 3): 0.014}
    assert call_seconds(table, 1, 2) == pytest.approx(0.012)  # a line through the measured sizes
    assert call_seconds(table, 1, 9) == pytest.approx(0.026)
    # below the sizes measured (a band where only drafting cycles ran: two tokens and more), the line, no dearer than
    # the smallest measured call: a one-token call is not priced as a two-token one
    drafting = {(1, 2): 0.060, (1, 3): 0.070, (1, 5): 0.088}
    assert call_seconds(drafting, 1, 1) == pytest.approx(0.051)  # the line: 0.060 - 0.009, not 0.060
    assert call_seconds({(1, 2): 0.060, (1, 3): 0.059}, 1, 1) == 0.059  # a falling line (noise): the cheapest
    assert call_seconds({(1, 4): 0.010, (1, 5): 0.050}, 1, 1) == pytest.approx(0.010 / 4)  # steep: its share
    assert call_seconds({(1, 2): 0.060, (1, 3): 0.059}, 1, 9) == 0.059  # above them never below the cheapest
    # another batch size: batch 1's line, calls of several tokens scaled by the rows (the dearest a batch can be)
    assert call_seconds(table, 2, 1) == pytest.approx(0.010) and call_seconds(table, 2, 3) == pytest.approx(0.028)
    table[2, 1] = 0.015  # one size measured at 2 rows: the nearest line, at that level
    assert call_seconds(table, 2, 3) == pytest.approx(0.028 * 1.5)
    assert call_seconds({(1, 4): 0.02}, 3, 1) == 0.02  # one point only: flat
    assert call_seconds({}, 1, 1) is None
    costs = _costs(first_ms=3, later_ms=2, catchup_ms=0.5)
    assert costs.draft_cost(1, 4) == pytest.approx(0.003 + 3 * 0.002) and costs.draft_cost(4, 0) == 0.0
    assert costs.catchup_cost(1, 100) == pytest.approx(0.05) and costs.catchup_cost(2, 200) == pytest.approx(0.1)
    assert Costs(draft={(1, 2): 0.003}).draft_cost(1, 3) == pytest.approx(0.009)  # one point: later calls as the first


def test_the_cost_table_round_trips_and_refuses_what_it_did_not_write():
    costs = _costs(catchup_ms=0.5)
    costs.verify[4, 2] = 0.05
    assert Costs.from_dict(costs.to_dict()) == costs
    for bad, message in [([], "expected an object"), ({"verify": [[1, 2]]}, "batch, tokens, seconds"),
                         ({"verify": [[0, 1, 0.1]]}, "positive integer"), ({"draft": [[1, 1, "fast"]]}, "positive finite"),
                         ({"draft": {}}, "draft: expected a list"), ({"verify": [[1, 1, math.inf]]}, "positive finite")]:
        with pytest.raises(ValueError, match=message):
            Costs.from_dict(bad)


def test_the_cost_table_keeps_what_a_change_of_shape_costs_and_refuses_a_malformed_one():
    costs = _costs()
    costs.change.update(verify=0.009, draft=0.0)  # none measured is a measurement: not measured again
    assert Costs.from_dict(costs.to_dict()) == costs
    old = costs.to_dict()
    del old["change"]  # a record written before it: read, not measured
    assert Costs.from_dict(old).change == {}
    for bad, message in [({"change": []}, "change: got"), ({"change": {"prefill": 0.1}}, "expected {\"verify\""),
                         ({"change": {"verify": -0.001}}, "non-negative finite"),
                         ({"change": {"draft": math.nan}}, "non-negative finite")]:
        with pytest.raises(ValueError, match=message):
            Costs.from_dict(bad)


def test_the_cost_table_by_past_round_trips_and_refuses_a_malformed_band():
    costs = _costs()
    costs.learn("verify", (1, 3), 0.03, past=10)
    costs.learn("draft", (1, 1), 0.002, past=500)
    assert costs.by_past == {("verify", 0): {(1, 3): 0.03}, ("draft", band(500)): {(1, 1): 0.002}}
    assert Costs.from_dict(costs.to_dict()) == costs
    old = costs.to_dict()
    del old["by_past"]  # a record written before the bands: read, with none
    assert Costs.from_dict(old) == Costs(costs.verify, costs.draft)
    for bad, message in [({"by_past": {}}, "by_past: expected a list"), ({"by_past": [["prefill", 0, []]]}, "band 0-64"),
                         ({"by_past": [["verify", -1, []]]}, "band 0-64"), ({"by_past": [["verify", True, []]]}, "band"),
                         ({"by_past": [["draft", 2, [[1, 1]]]]}, "by_past.draft: got .* expected \\[batch, tokens")]:
        with pytest.raises(ValueError, match=message):
            Costs.from_dict(bad)


def test_a_change_of_shape_is_priced_where_a_cycle_makes_one_and_learned_apart():
    """OpenVINO's execution provider pays ~9 ms for a call whose shape differs from the model's previous call's: a
    verification of drafts at another length than the last verification of drafts is priced with it, so the policy
    keeps the length it drafted at where the lengths are near a tie; a change between plain decoding and drafting is
    not (it starts a stretch of one or the other); the table learns every call without the change it paid."""
    verify = {(1, t): ms / 1e3 for t, ms in enumerate((48, 53, 57, 61, 65, 69, 73, 77, 81), start=1)}
    costs = Costs(dict(verify), change={"verify": 0.009})
    policy = CostPolicy(8, costs)  # prompt lookup's drafts at the prior's acceptance, 0.7 a draft
    unpriced = CostPolicy(8, Costs(dict(verify)))  # no change measured: none priced
    assert policy.next_k(1, lookup=True) == unpriced.next_k(1, lookup=True) == 4  # after the prompt's prefill
    for k, shape_kept in [(3, False), (4, False), (4, True), (0, False)]:  # model-drafted cycles (lookup's counts unmoved)
        paid = 0.0 if shape_kept else 0.009
        policy.observe(CycleOutcome(1, [k], [min(k, 1)], [False], verify_seconds=verify[1, k + 1] + paid,
                                    verify_tokens=k + 1))
        assert costs.verify[1, k + 1] == pytest.approx(verify[1, k + 1])  # learned less the change it paid
        # the length drafted at is kept (priced without the change: 4 each time); after plain decoding, no change
        assert policy.next_k(1, lookup=True) == (k or 4)
    assert policy.prices(1, model=False) == unpriced.prices(1, model=False)

    draft = Costs(draft={(1, 1): 0.020, (1, 2): 0.022, (1, 32): 0.030}, change={"draft": 0.005})
    assert draft.draft_cost(1, 1) == pytest.approx(0.022 + 0.005)  # the first call changes shape
    assert draft.draft_cost(1, 3) == pytest.approx(0.022 + 2 * 0.020 + 2 * 0.005)  # and the second
    assert draft.catchup_cost(1, 32) == pytest.approx(0.035)
    CostPolicy(3, draft).observe(CycleOutcome(1, [3], [3], [False], first_call_seconds=0.027, first_call_tokens=2,
                                              later_call_seconds=0.045, later_calls=2))
    assert draft.draft == pytest.approx({(1, 1): 0.020, (1, 2): 0.022, (1, 32): 0.030})


def test_calls_are_priced_at_the_nearest_band_of_their_past_that_measured_a_line():
    assert [band(p) for p in (0, PAST_BAND - 1, PAST_BAND, 2 * PAST_BAND - 1, 2 * PAST_BAND, 1000)] == [0, 0, 1, 1, 2, 4]
    costs = Costs()
    for past, tokens, seconds in [(600, 1, 0.010), (600, 3, 0.012), (20, 1, 0.004), (20, 3, 0.009), (150, 1, 0.007)]:
        costs.learn("verify", (1, tokens), seconds, past)
    assert costs.verify_cost(1, 3, past=20) == 0.009 and costs.verify_cost(1, 3, past=700) == 0.012  # its own band
    assert costs.verify_cost(1, 3, past=150) == 0.009  # one size measured there: the nearest band with two
    assert costs.verify_cost(1, 3, past=5000) == 0.012
    assert costs.verify_cost(1, 3) == pytest.approx(0.9 * 0.012 + 0.1 * 0.009)  # no past: every past's table, blended
    assert costs.verify_cost(2, 1, past=20) == costs.verify_cost(2, 1)  # no band measured that batch: every past's


def test_the_cost_policy_prices_a_cycle_at_the_past_it_is_told():
    """A mixture's verification is steep after a short past (each token brings its own experts) and flat after a long
    one (the attention over the past dominates): the same acceptance pays drafting after the long past only."""
    costs = Costs()
    for t, short, long in [(1, 3.6, 10.0), (2, 7.4, 11.0), (3, 10.5, 12.0)]:
        costs.learn("verify", (1, t), short / 1e3, past=10)
        costs.learn("verify", (1, t), long / 1e3, past=400)
    for t in (1, 2):
        costs.learn("draft", (1, t), 0.5e-3, past=10)
        costs.learn("draft", (1, t), 1e-3, past=400)
    policy = CostPolicy(2, costs)
    policy.at_past(400)
    assert policy.next_k(1) == 2
    policy.at_past(12)
    assert policy.next_k(1) == 0
    policy.at_past(410)
    assert policy.next_k(1) == 2


def _train(policy, accept, cycles=60, batch=1):
    """Cycles at the policy's choice where each drafted row keeps ``accept`` drafts of its k."""
    for _ in range(cycles):
        k = policy.next_k(batch)
        policy.observe(_cycle(k, min(accept, k), batch=batch))
    return policy


def test_the_cost_policy_drafts_long_when_everything_is_kept_and_stops_when_nothing_is():
    assert _train(CostPolicy(8, _costs()), accept=8).next_k(1) == 8
    refused = _train(CostPolicy(8, _costs()), accept=0)
    assert refused.acceptance("model")[0] < PRIOR / 2
    assert [refused.next_k(1) for _ in range(5)].count(0) >= 4


def test_the_cost_policy_drafts_nothing_where_a_draft_call_costs_what_a_verification_does():
    dear = CostPolicy(4, _costs(first_ms=10, later_ms=10))
    assert dear.next_k(1) == 0  # at the prior's acceptance, plain decoding has the most tokens per second
    cheap = CostPolicy(4, _costs(first_ms=1, later_ms=1))
    assert cheap.next_k(1) > 0


def test_lookup_drafts_cost_no_draft_call_and_are_chosen_only_where_they_beat_the_model():
    policy = CostPolicy(4, _costs(first_ms=10, later_ms=10))  # the model does not pay
    assert policy.next_k(1) == 0 and policy.next_k(1, lookup=True) > 0  # lookup's drafts cost a longer verification only
    good = CostPolicy(4, _costs(first_ms=0.5, later_ms=0.5))
    for _ in range(30):  # the model's drafts all kept, lookup's all rejected
        good.observe(_cycle(4, 4))
        good.observe(_cycle(4, 0, lookup=True))
    assert good.next_k(1) == 4 and max(good.rates("lookup", 1)) < max(good.rates("model", 1))
    good.budget["lookup"] = 0.0  # what the model's cycles left for re-measuring lookup, spent
    assert good.next_k(1, lookup=True) == 0


def test_a_refused_source_is_re_measured_from_a_share_of_plain_time_halved_per_confirmed_no():
    """Draft calls so dear that the prior's acceptance does not pay (forgetting never brings drafting back), though
    drafts all kept would: the budget re-measures the "no" ever more rarely, until a re-measure finds it paying."""
    policy = CostPolicy(4, _costs(first_ms=7, later_ms=7))
    assert max(policy.rates("model", 1)) == policy.rates("model", 1)[0]  # refused at the prior
    explored, plain_seconds = [], 0.0
    while len(explored) < 4 and plain_seconds < 100:
        k = policy.next_k(1)
        if k:
            explored.append(plain_seconds)
            policy.observe(_cycle(k, 0))  # the re-measure confirms the "no"
        else:
            policy.observe(_cycle(0, 0))
            plain_seconds += 0.010
    assert len(explored) == 4 and policy.share["model"] == EXPLORE_SHARE / 16
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[0] < gaps[1] < gaps[2]  # a smaller share: longer between re-measures
    drafted = 0
    for _ in range(200_000):  # the text's acceptance came back: the next re-measure keeps all it drafts
        k = policy.next_k(1)
        policy.observe(_cycle(k, k))
        drafted += k > 0
        if drafted > 10:
            break
    assert drafted > 10 and policy.share["model"] == EXPLORE_SHARE  # a re-measure that paid reset the share


def test_a_catch_up_is_paid_when_what_drafting_saves_over_the_tokens_to_come_repays_it():
    policy = _train(CostPolicy(4, _costs(first_ms=1, later_ms=1, catchup_ms=1)), accept=4, cycles=30)
    assert policy.catchup_pays(1, 100, 1000)  # 0.1 s to catch up; drafting saves far more over 1000 tokens
    assert not policy.catchup_pays(1, 10_000, 10)  # 10 s to catch up for 10 tokens
    assert CostPolicy(4, _costs()).catchup_pays(1, 10_000, 10)  # the rate never measured: drafting measures it
    assert policy.catchup_pays(1, 0, 10)  # nothing to catch up on


def test_tokens_to_come_are_what_the_latest_answers_made_beyond_this_ones():
    """A request's budget bounds its tokens to come; the pipeline's latest answers tell how many it will make."""
    assert AnswerLengths().to_come(0, 127) == 127  # nothing known: the budget
    answers = AnswerLengths([(20, True), (30, True), (40, True)])  # answers that ended by themselves (EOS, a stop)
    assert answers.to_come(0, 127) == pytest.approx(30)  # (20 + 30 + 40) / 3
    assert answers.to_come(25, 102) == pytest.approx(10)  # of those that went on past 25: (5 + 15) / 2
    assert answers.to_come(0, 10) == pytest.approx(10)  # never more than the budget
    assert answers.to_come(50, 77) == 50  # it outlived them all: as long again as it ran
    assert answers.to_come(100, 27) == 27  # ... within its budget
    answers.add(128, ended=False)  # cut at its budget: it did not end by itself, so it counts as running to this one's
    assert answers.to_come(50, 77) == 77 and answers.to_come(0, 127) == pytest.approx((20 + 30 + 40 + 127) / 4)
    # cut at a small budget (bench's 4-token warm-ups): known to run past 4 tokens, and nothing beyond
    warmed = AnswerLengths([(4, False), (4, False), (20, True), (30, True), (40, True)])
    assert warmed.to_come(0, 127) == pytest.approx(30)  # as the three that ended; not (2 * 127 + 90) / 5
    assert warmed.to_come(10, 117) == pytest.approx(20)  # past the cut: the three alone
    cut_between = AnswerLengths([(20, True), (25, False), (30, True)])  # runs past 25: ends as the 30 did
    assert cut_between.to_come(0, 127) == pytest.approx(20 + 10 * 2 / 3)  # one in three ends at 20, two at 30
    for _ in range(KEPT):  # the latest KEPT answers: a workload that changes is learnt again
        answers.add(5, ended=True)
    assert answers.to_come(0, 127) == 5
    assert AnswerLengths.from_list(answers.to_list()).to_list() == answers.to_list() == [[5, True]] * KEPT
    for bad in ([[5]], [[-1, True]], [[5, 1]], [[True, True]], {"5": True}, [[5.0, True]]):
        with pytest.raises(ValueError, match="answers: expected"):
            AnswerLengths.from_list(bad)


def test_a_catch_up_is_not_paid_for_answers_that_end_long_before_their_budget():
    """A translation's answer ends after 10-60 of its 128 tokens: its draft's catch-up on the prompt, priced against
    the budget, was paid on every request and never repaid (docs/results/spec_bench_groups). Priced against the
    tokens the latest answers made, it is paid where answers run long and refused where they end early."""
    policy = CostPolicy(4, _costs(verify_ms=(10, 10.5, 11, 11.5, 12), first_ms=1, later_ms=1, catchup_ms=1))
    prompt = 100  # a 100-token catch-up: 0.1 s; drafting at the prior's acceptance saves ~4 ms a token
    assert policy.catchup_pays(1, prompt, 127)  # the budget: paid
    short = AnswerLengths([(12, True), (20, True), (9, True)])
    assert not policy.catchup_pays(1, prompt, short.to_come(0, 127))  # the answers end early: not repaid
    long = AnswerLengths([(128, False), (90, True)])
    assert policy.catchup_pays(1, prompt, long.to_come(0, 127))


def test_the_cost_policy_learns_each_cost_from_what_it_observes():
    costs = Costs()
    policy = CostPolicy(4, costs)
    assert policy.next_k(1) == 4  # nothing measured: drafting is how costs are measured
    policy.observe(CycleOutcome(2, [3, 3], [1, 2], [False, False], first_call_seconds=0.004, first_call_tokens=2,
                                later_call_seconds=0.006, later_calls=2, verify_seconds=0.02, verify_tokens=4))
    assert costs.draft == {(2, 2): 0.004, (2, 1): 0.003} and costs.verify == {(2, 4): 0.02}
    policy.observe(CycleOutcome(2, first_call_seconds=0.064, first_call_tokens=64))  # a draft prefill: a catch-up
    assert costs.draft[2, 64] == 0.064 and costs.catchup_cost(2, 128) == 0.064
    policy.observe(CycleOutcome(2, [0, 0], [0, 0], [False, False], verify_seconds=0.03, verify_tokens=1))
    assert costs.verify[2, 1] == 0.03
    policy.observe(CycleOutcome(2, [0, 0], [0, 0], [False, False], verify_seconds=0.01, verify_tokens=1))
    assert costs.verify[2, 1] == pytest.approx(0.9 * 0.03 + 0.1 * 0.01)  # later measurements blend in
    assert costs.by_past == {}  # none of them said their past
    policy.observe(CycleOutcome(2, [0, 0], [0, 0], [False, False], verify_seconds=0.02, verify_tokens=1, past=300))
    assert costs.by_past == {("verify", band(300)): {(2, 1): 0.02}}  # its band's first, taken whole


def test_the_registry_makes_exactly_the_names_a_config_accepts():
    """config.py lists the names (it imports no implementation, so no module imports back into it); the registry
    maps each to what it makes, in the same order (the order the error messages list them)."""
    from specdeploy.runtime import config, registry

    assert tuple(registry.POLICIES) == config.POLICIES and tuple(registry.DRAFTERS) == config.DRAFTERS
