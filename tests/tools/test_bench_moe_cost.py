"""tools/bench_moe_cost.py: a mixture and a dense model of its active size timed in the same rounds, the cost policy's
K read off a table, and cost tables tools/replay.py takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tools import bench_moe_cost, replay

ROOT = Path(__file__).resolve().parents[2]


def _table(one: float, per_token: float) -> dict:
    """A cost table whose target call costs ``one`` + ``per_token`` x (T - 1) seconds at every past."""
    full = {str(t): [one + per_token * (t - 1)] * 3 for t in replay.FULL}
    trimmed = {str(t): [one + per_token * (t - 1)] * 3 for t in replay.TRIMMED}
    return {"pasts": list(replay.PASTS), "target": {"full": full, "trimmed": trimmed},
            "draft": {"full": {str(t): [one / 4] * 3 for t in replay.FULL}, "trimmed": trimmed}}


def test_the_policy_drafts_more_where_a_verified_token_costs_less():
    """Free drafts kept at a rate of 0.8: a verification whose extra tokens cost nothing drafts the most (8), one whose
    every token costs a whole call drafts none."""
    free, dear = _table(0.04, 0.0), _table(0.04, 0.04)
    assert bench_moe_cost.policy_k(free["target"]["full"], None, free["pasts"], 0.8, model=False) == 8
    assert bench_moe_cost.policy_k(dear["target"]["full"], None, dear["pasts"], 0.8, model=False) == 0


def test_the_draft_is_scaled_by_the_ratio_of_the_targets_one_token_calls():
    recorded, ours = _table(0.04, 0.01), _table(0.02, 0.01)["target"]
    draft = bench_moe_cost.scaled_draft(recorded, ours)
    assert draft["full"]["1"] == [0.01 * 0.5] * 3  # the recorded draft's 10 ms, at half the recorded target's cost


def test_the_tool_times_a_mixture_beside_a_dense_model_and_writes_replay_tables(tmp_path):
    """A tiny mixture (experts 96 wide: QMoE's blocks of 32 divide them) and its dense model, one round each."""
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"costs": _table(0.04, 0.01)}))
    done = subprocess.run([sys.executable, "-m", "tools.bench_moe_cost", "--experts", "4", "--top-k", "2", "--hidden",
                           "256", "--layers", "1", "--vocab", "64", "--forms", "fused", "--rounds", "1", "--threads", "1",
                           "--traces", str(traces), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "experts on ONNX Runtime's QMoE (int4, blocks of 32)" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(("  mixture fused int4", "  dense, same active"))]
    assert len(rows) == 4, done.stdout  # each model's curve and its policy's K
    for model in ("mixture", "dense"):
        table = replay.cost_table(json.loads((tmp_path / "out" / f"costs_{model}_fused_int4.json").read_text()))
        assert set(table["target"]["full"]) >= {str(t) for t in range(1, 10)} and table["pasts"] == list(replay.PASTS)
