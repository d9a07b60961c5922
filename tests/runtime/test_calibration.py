"""Engine costs measured at warm-up and remembered across processes (``Calibration``, ``remember_costs=True``)."""

from __future__ import annotations

import json

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.calibration import (
    CATCHUP_TOKENS,
    CHANGE_ROUNDS,
    FOLDER,
    NOTICEABLE,
    RememberedCosts,
    change_seconds,
    machine_key,
)
from specdeploy.runtime.cost_policy import Costs
from tests.runtime.stubs import Judge

CONFIG = GenerationConfig(max_new_tokens=24, ignore_eos=True, k=4)


def _record(cache) -> dict:
    files = list((cache / FOLDER).glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_a_new_process_starts_from_the_costs_the_last_one_measured(pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    plain = Pipeline.load(pair_dir).generate(["w5 w6"], GenerationConfig(max_new_tokens=24, ignore_eos=True,
                                                                          drafter="none"))[0]
    first = Pipeline.load(pair_dir, remember_costs=True)
    assert first.costs == Costs()  # nothing remembered yet
    out = first.generate(["w5 w6"], CONFIG)[0]
    kept = first.costs.to_dict()
    assert _record(tmp_path)["costs"] == kept and kept["verify"] and kept["draft"]

    second = Pipeline.load(pair_dir, remember_costs=True)  # as a new process would: nothing in memory
    assert second.costs.to_dict() == kept
    streamed = list(second.stream("w5 w6", CONFIG))[-1].result
    assert out.token_ids == streamed.token_ids == plain.token_ids  # lossless whatever the policy starts from
    assert _record(tmp_path)["costs"] != kept  # updated by what the second process measured

    assert Pipeline.load(pair_dir).costs == Costs()  # the default for the Python API: a process learns its own


def test_remembered_costs_belong_to_their_artifact_provider_and_threads(pair_dir, self_dir):
    keys = {machine_key(pair_dir, "cpu", None), machine_key(pair_dir, "cpu", 2), machine_key(pair_dir, "cuda", None),
            machine_key(self_dir, "cpu", None)}
    assert len(keys) == 4 and machine_key(pair_dir, "cpu", 2) == machine_key(pair_dir, "cpu", 2)


@pytest.mark.parametrize("junk", ["{not json", "[1, 2]", json.dumps({"costs": {"verify": "fast"}}),
                                  json.dumps({"costs": {"verify": [[1, 1, -0.5]]}}),
                                  json.dumps({"costs": {"draft": [[0, 1, 0.1]]}}),
                                  json.dumps({"costs": {"draft": {"1": 0.1}}})])
def test_an_unreadable_record_means_starting_from_the_warm_up_and_is_replaced(pair_dir, tmp_path, monkeypatch, junk):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    record = RememberedCosts(machine_key(pair_dir, "cpu", None)).path
    record.parent.mkdir(parents=True)
    record.write_text(junk)
    pipeline = Pipeline.load(pair_dir, remember_costs=True)
    assert pipeline.costs == Costs()
    pipeline.generate(["w5 w6"], CONFIG)
    assert Costs.from_dict(_record(tmp_path)["costs"]) == pipeline.costs


def test_generate_cli_remembers_costs_unless_told_not_to(pair_dir, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specdeploy.cli import main

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    args = ["generate", str(pair_dir), "--prompt", "w5 w6", "--max-new-tokens", "8"]  # the CLI's default: cost, K <= 8, hybrid
    assert CliRunner().invoke(main, [*args, "--no-remember-costs"]).exit_code == 0
    assert not (tmp_path / FOLDER).exists()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert {batch for batch, _, _ in _record(tmp_path)["costs"]["draft"]} == {1}


def test_exact_modes_costs_are_remembered_beside_the_defaults_and_kept_by_a_process_that_ran_the_other(
        pair_dir, tmp_path, monkeypatch):
    """Exact mode prices by its own table (its calls are padded to even token counts): a new process starts from what
    the last measured in that mode, and a process that ran only the default keeps it as it was."""
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    first = Pipeline.load(pair_dir, remember_costs=True)
    first.generate(["w5 w6"], GenerationConfig(max_new_tokens=24, ignore_eos=True, k=4, exact=True))
    exact = first.calibration.exact_costs.to_dict()
    assert exact["verify"] and first.costs == Costs()  # exact mode measured its own table alone
    assert _record(tmp_path) == {"costs": Costs().to_dict(), "exact_costs": exact, "answers": [[24, False]]}

    second = Pipeline.load(pair_dir, remember_costs=True)  # a new process
    assert second.calibration.exact_costs.to_dict() == exact and second.costs == Costs()
    second.generate(["w5 w6"], CONFIG)  # the default mode alone
    assert _record(tmp_path)["exact_costs"] == exact and _record(tmp_path)["costs"] == second.costs.to_dict() != {}
    assert Pipeline.load(pair_dir, remember_costs=True).costs == second.costs


def test_a_record_from_before_exact_mode_starts_exact_mode_cold(pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    kept = Costs.from_dict({"verify": [[1, 1, 0.01]]})
    record = RememberedCosts(machine_key(pair_dir, "cpu", None)).path
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"costs": kept.to_dict()}))
    pipeline = Pipeline.load(pair_dir, remember_costs=True)
    assert pipeline.costs == kept and pipeline.calibration.exact_costs == Costs()


def test_a_catch_up_is_judged_by_how_long_the_latest_answers_ran_and_a_new_process_recalls_them(
        pair_dir, tmp_path, monkeypatch):
    """An answer that ends long before its budget (a translation: 10-60 tokens of 128) never repays the draft's
    catch-up on its prompt: the catch-up is judged against the tokens the pipeline's latest answers made, remembered
    with the costs, not against the budget."""
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    first = Pipeline.load(pair_dir, remember_costs=True)
    assert first.answers.to_list() == []
    plain = first.generate(["w5 w6"], GenerationConfig(drafter="none", max_new_tokens=24, ignore_eos=True))[0]
    ends = plain.token_ids.index(plain.token_ids[3]) + 1  # a stop id: the answer ends there by itself
    short = GenerationConfig(drafter="none", max_new_tokens=24, ignore_eos=True, stop_token_ids=(plain.token_ids[3],))
    assert [r.finish_reason for r in first.generate(["w5 w6"] * 2, short, batch_size=1)] == ["eos"] * 2  # stop ids end as EOS
    answers = [[24, False], [ends, True], [ends, True]]  # cut at its budget, then two that ended by themselves
    assert first.answers.to_list() == _record(tmp_path)["answers"] == answers

    second = Pipeline.load(pair_dir, remember_costs=True)  # a new process
    assert second.answers.to_list() == answers
    judge = Judge(True)
    run = second.start(["w5 w6 w7 w8"], GenerationConfig(k=3, max_new_tokens=24), policy=judge)
    run.step()
    behind = len(second.encode("w5 w6 w7 w8")) - 2
    assert judge.asked[0] == (1, behind, pytest.approx((24 + 2 * ends) / 3))  # not the budget, 24
    assert Pipeline.load(pair_dir).answers.to_list() == []  # the Python API's default: a process learns its own


def test_unreadable_answers_mean_starting_from_each_requests_budget(pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    kept = Costs.from_dict({"verify": [[1, 1, 0.01]]})
    record = RememberedCosts(machine_key(pair_dir, "cpu", None)).path
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"costs": kept.to_dict(), "answers": [[3, "yes"]]}))
    pipeline = Pipeline.load(pair_dir, remember_costs=True)
    assert pipeline.costs == kept and pipeline.answers.to_list() == []


def test_warm_up_calls_each_shape_the_cost_table_lacks_twice_and_measures_the_quicker(pair_dir):
    """T = 1 .. k + 1 in the target, then T = 1, 2 and a catch-up in the draft, each twice (the first call at a shape is
    cold), on throwaway caches, after a prefill of ``prompt_tokens`` in each; the quicker of the two calls is the cost
    table's first entry (a call stalled by a busy host, here every other one, is not); after each model's shapes, what
    a change of shape costs it; a shape the table has is not called again; the next request's output is the same as
    without it."""
    alone = Pipeline.load(pair_dir).generate(["w1 w2 w3"], GenerationConfig(k=3, max_new_tokens=12))[0].token_ids
    loaded, calls, seconds = Pipeline.load(pair_dir), [], {}
    for name, engine in (("target", loaded.target), ("draft", loaded.draft)):
        infer = engine.infer

        def recorded(input_ids, past_len, cache, last=None, widths=None, name=name, infer=infer):
            calls.append((name, input_ids.shape[1], int(past_len[0]), last))
            done = infer(input_ids, past_len, cache, last, widths)
            if len(calls) % 2:  # stalled: a second's wait in the first or the second call of each shape
                done.seconds += 1.0
            seconds.setdefault((name, input_ids.shape[1]), []).append(done.seconds)
            return done

        engine.infer = recorded
    assert loaded.warm_up(3, prompt_tokens=20) > 0
    twice = [call for call in [*(("target", t, 20, None) for t in range(1, 5)),
                               *(("draft", t, 20, 1) for t in (1, 2, CATCHUP_TOKENS))] for _ in range(2)]
    changes = {name: [(name, t, 20, last) for t in (2, 1, 1)] * CHANGE_ROUNDS
               for name, last in (("target", None), ("draft", 1))}  # after each model's shapes: what a change costs
    assert calls == [("target", 20, 0, 1), *twice[:8], *changes["target"], ("draft", 20, 0, 1), *twice[8:],
                     *changes["draft"]]
    costs = loaded.costs
    assert costs.verify == {(1, t): min(seconds["target", t][:2]) for t in range(1, 5)}
    assert costs.draft == {(1, t): min(seconds["draft", t][:2]) for t in (1, 2, CATCHUP_TOKENS)}
    assert max(costs.verify.values()) < 1.0 and max(costs.draft.values()) < 1.0
    for name, model in (("verify", "target"), ("draft", "draft")):  # the one-token calls after the shapes' two
        ones = seconds[model, 1][2:]
        changed, kept = min(ones[0::2]), min(ones[1::2])
        assert costs.change[name] == (changed - kept if changed - kept >= NOTICEABLE * kept else 0.0)
    calls.clear()
    loaded.warm_up(4)  # only what the table lacks: a verification of 5 (what a change costs is measured)
    assert calls == [("target", 5, 0, None)] * 2 and (1, 5) in costs.verify
    calls.clear()
    assert loaded.generate(["w1 w2 w3"], GenerationConfig(k=3, max_new_tokens=12))[0].token_ids == alone
    assert ("target", 1, 20, None) not in calls  # k = 3 is warm: a request does not warm it again


@pytest.mark.parametrize("extra", [0.0, 0.0085])
def test_what_a_change_of_shape_costs_is_measured_and_none_below_what_the_calls_differ_by(pair_dir, extra):
    """An engine whose call pays ``extra`` seconds when its token count differs from its previous call's (OpenVINO's
    execution provider, 8.2-8.8 ms of a 48 ms call) measures about that; one that pays nothing measures none, though
    its calls after a change read up to 1.5 ms dearer (the CPU provider's differ by -1.0 to +0.75 ms of 46 ms). The calls'
    seconds are set, not timed."""
    target = Pipeline.load(pair_dir).target
    infer, previous, jitter = target.infer, [], iter([0.001, 0.0015, 0.0, 0.0, 0.002, 0.0004] * 2)

    def shaped(input_ids, past_len, cache, last=None, widths=None):
        done = infer(input_ids, past_len, cache, last, widths)
        done.seconds = 0.046 + next(jitter) + (extra if previous and previous[-1] != input_ids.shape else 0.0)
        previous.append(input_ids.shape)
        return done

    target.infer = shaped
    measured = change_seconds(target, target.allocate_cache(1, target.spec.capacity), 10, None)
    assert len(previous) == 3 * CHANGE_ROUNDS and previous[:3] == [(1, 2), (1, 1), (1, 1)]
    assert measured == pytest.approx(extra + 0.0015) if extra else measured == 0.0
