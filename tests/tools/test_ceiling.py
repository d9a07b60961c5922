"""tools/ceiling.py: what a cost table allows at best, the draft model's drafts and free ones, and each workload
group's bound end to end from a live run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import ceiling
from tools.replay import CostTable

ROOT = Path(__file__).resolve().parents[2]
PASTS = (8, 32)


def _table(base=0.010, per_token=0.002, tokens=(1, 2, 3, 5, 9, 17)) -> dict:
    """A target call costs base + per_token x T (+ a little per past slot); the draft a third of it."""
    def rows(scale):
        return {str(t): [scale * (base + per_token * t) + 1e-5 * p for p in PASTS] for t in tokens}

    return {"pasts": list(PASTS), "target": {"full": rows(1.0), "trimmed": rows(1.0)},
            "draft": {"full": rows(1 / 3), "trimmed": rows(1 / 3)}}


def test_the_draft_models_ceiling_is_fixed_k_at_a_constant_acceptance_against_plain_decoding():
    costs = CostTable(_table())
    found = ceiling.model_ceiling(costs, 8, rates=(1.0, 0.5), k_max=3, log=lambda *_: None)
    plain = costs.seconds("target", 1, 8, 1)
    step = costs.seconds("draft", 1, 8, 1)
    for a, k in ((1.0, 2), (0.5, 3)):
        tokens = sum(a**j for j in range(k + 1))
        assert found[a]["by_k"][k] == pytest.approx(tokens / (k * step + costs.seconds("target", k + 1, 8, k + 1)) * plain)
    assert found[1.0]["best_k"] == max(found[1.0]["by_k"], key=found[1.0]["by_k"].get)
    assert found[1.0]["speedup"] > found[0.5]["speedup"]


def test_at_a_fixed_k_the_target_keeps_its_shape_and_the_draft_changes_its_own_twice_a_cycle():
    """A table measured on OpenVINO holds what a change of shape costs each model: the target's calls at a fixed K keep
    their shape (no change), the draft's first two calls of a cycle change it."""
    plain_table = CostTable(_table())
    costs = CostTable(_table() | {"change": {"target": 0.009, "draft": 0.004}})
    same, changed = (ceiling.model_ceiling(c, 8, rates=(0.8,), k_max=3, log=lambda *_: None)[0.8]["by_k"]
                     for c in (plain_table, costs))
    plain, step = plain_table.seconds("target", 1, 8, 1), plain_table.seconds("draft", 1, 8, 1)
    for k in (1, 2, 3):
        tokens = sum(0.8**j for j in range(k + 1))
        cycle = k * step + min(k, 2) * 0.004 + plain_table.seconds("target", k + 1, 8, k + 1)
        assert changed[k] == pytest.approx(tokens / cycle * plain) and changed[k] < same[k]


def test_free_drafts_are_bounded_by_the_cheapest_verification_a_token_and_by_the_tables_slope():
    """v(T) = a + b T: T v(1) / v(T) grows with T, so the bound is the largest size measured, at the past where a
    verification is cheapest relative to one token; drafts of any length tend to v(1) / b."""
    table = _table()
    best = ceiling.free_speedup(CostTable(table))
    ratios = {(t, p): t * table["target"]["full"]["1"][i] / table["target"]["full"][str(t)][i]
              for t in (1, 2, 3, 5, 9, 17) for i, p in enumerate(PASTS)}
    (tokens, past), top = max(ratios.items(), key=lambda item: item[1])
    assert (best["tokens"], best["past"], best["speedup"]) == (tokens, past, pytest.approx(top))
    assert tokens == 17
    assert best["any_length"] == pytest.approx(max(table["target"]["full"]["1"]) / 0.002)
    flat = _table(per_token=0.0)  # a verification of any size costs one token's: no line to follow, no bound
    assert ceiling.free_speedup(CostTable(flat))["any_length"] == float("inf")


def _bench() -> dict:
    """A bench_peer run: two groups, plain and default (and a model-only configuration whose first token was faster)."""
    def run(group, seconds, first, tokens=100):
        return {"group": group, "seconds": seconds, "first_s": first, "tokens": tokens, "target_calls": tokens}

    plain = [run("long", 10.0, 6.0), run("long", 12.0, 8.0), run("short", 4.0, 0.5)]
    default = [run("long", 8.0, 6.0), run("long", 9.0, 7.5), run("short", 2.0, 0.5)]
    model = [run("long", 9.5, 5.0), run("long", 11.0, 8.0), run("short", 3.5, 0.4)]
    return {"by_group": {"long": {}, "short": {}},
            "runs": {"onnxruntime-genai: target": plain, "specdeploy (int4): plain": plain,
                     "specdeploy (int4): model, cost k<=8": model, "specdeploy (int4): default (hybrid cost k<=8)": default}}


def test_a_groups_bound_keeps_its_fastest_first_token_and_divides_decoding_by_the_speedup():
    groups = {g["group"]: g for g in ceiling.group_bounds(_bench(), 4.0, {"long": 1.6})}
    # first tokens: prompt 1's the model configuration's 5.0, prompt 2's the default's 7.5; then plain's decoding / 4
    assert groups["long"]["bound"] == pytest.approx((100 / (5.0 + 5.0 / 4) + 100 / (7.5 + 4.5 / 4)) / 2)
    assert groups["long"]["plain"] == pytest.approx((10 + 100 / 12) / 2)
    assert groups["long"]["default_vs_plain"] == pytest.approx(((12.5 + 100 / 9) / 2) / ((10 + 100 / 12) / 2))
    assert groups["short"]["bound"] == pytest.approx(100 / (0.4 + 3.6 / 4))
    # the goal 1.6x: 1 / 1.6 of plain's time, of which the first token takes the median share (0.5, 0.625)
    share = (5.0 / 10 + 7.5 / 12) / 2
    assert groups["long"]["first_token_share"] == pytest.approx(share)
    assert groups["long"]["decoding_speedup_needed"] == pytest.approx((1 - share) / (1 / 1.6 - share))
    assert "goal" not in groups["short"]


def test_a_goal_the_first_token_alone_exceeds_needs_an_infinite_decoding_speedup():
    groups = {g["group"]: g for g in ceiling.group_bounds(_bench(), 4.0, {"long": 1.5, "short": 1.5})}
    assert groups["long"]["decoding_speedup_needed"] == pytest.approx((1 - 0.5625) / (1 / 1.5 - 0.5625))
    assert groups["short"]["decoding_speedup_needed"] == pytest.approx((1 - 0.1) / (1 / 1.5 - 0.1))
    groups = {g["group"]: g for g in ceiling.group_bounds(_bench(), 4.0, {"long": 2.0})}
    assert groups["long"]["decoding_speedup_needed"] == float("inf")  # 56 % of plain's time is its first token


def test_the_tool_prints_and_writes_each_bound_and_refuses_a_bad_goal_in_one_line(tmp_path):
    costs, live, out = tmp_path / "costs.json", tmp_path / "live.json", tmp_path / "out.json"
    costs.write_text(json.dumps({"costs": _table()}))
    live.write_text(json.dumps(_bench()))
    command = [sys.executable, "-m", "tools.ceiling", "--costs", str(costs), "--live", str(live), "--past", "8"]
    done = subprocess.run([*command, "--goal", "short=1.5", "--out", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "free drafts, every one kept:" in done.stdout and "the draft model, acceptance 1.00" in done.stdout
    written = json.loads(out.read_text())
    assert [g["group"] for g in written["groups"]] == ["long", "short"] and written["groups"][1]["goal"] == 1.5
    assert written["free_drafts"]["tokens"] == 17
    for bad in ("short", "short=fast", "short=0.9"):
        done = subprocess.run([*command, "--goal", bad], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode != 0 and done.stderr.strip().count("\n") == 0 and "--goal" in done.stderr


def test_a_file_that_is_not_a_cost_table_or_a_run_is_refused_in_one_line(tmp_path):
    costs, other = tmp_path / "costs.json", tmp_path / "other.json"
    costs.write_text(json.dumps({"costs": _table()}))
    other.write_text(json.dumps({"rows": []}))
    for args, message in [(["--costs", str(other)], "no pasts, target; expected a cost table"),
                          (["--costs", str(tmp_path / "absent.json")], "cannot be read as JSON"),
                          (["--costs", str(costs), "--live", str(other)], "no runs, by_group; expected a tools/bench_peer.py run")]:
        done = subprocess.run([sys.executable, "-m", "tools.ceiling", *args], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode != 0 and message in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
