"""tools/bench_first_token.py: fresh `specdeploy generate` processes per artifact, timed to their first byte."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tools.bench_first_token", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_every_artifact_runs_each_prompt_each_round_in_turn(pair_dir, fused_dirs, tmp_path):
    out = tmp_path / "first.json"
    done = _tool("--artifact", pair_dir, "--artifact", fused_dirs["close"], "--prompt", "w5 w6", "--humaneval", 0,
                 "--specbench", 0, "--rounds", 2, "--max-new-tokens", 4, "--option=--drafter=none", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [Path(r["artifact"]) for r in report["runs"]] == [pair_dir, fused_dirs["close"], fused_dirs["close"], pair_dir]
    assert all(0 < r["first_token_s"] <= r["whole_run_s"] for r in report["runs"])
    assert [(s["prompt"], Path(s["artifact"])) for s in report["summary"]] == [("prompt 0", pair_dir),
                                                                             ("prompt 0", fused_dirs["close"])]
    assert report["options"] == ["--drafter=none"]
    for row in report["summary"]:  # medians of the runs they summarise
        mine = [r for r in report["runs"] if Path(r["artifact"]) == Path(row["artifact"])]
        assert row["first_token_s"] == statistics.median(r["first_token_s"] for r in mine)


def test_a_run_that_fails_stops_the_tool_with_its_error(tmp_path):
    done = _tool("--artifact", tmp_path / "missing", "--prompt", "w5", "--humaneval", 0, "--specbench", 0, "--rounds", 1)
    assert done.returncode != 0 and "failed" in done.stderr and "missing" in done.stderr


def test_a_workload_that_cannot_be_had_is_an_error(pair_dir):
    done = _tool("--artifact", pair_dir, "--humaneval", 0, "--specbench", 81)
    assert done.returncode == 2 and "each group has 80" in done.stderr
