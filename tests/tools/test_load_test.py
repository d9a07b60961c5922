"""tools/load_test.py on a tiny artifact: every mode and concurrency reported, every request accounted for, in
every round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_test_reports_every_mode_and_level(pair_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"  # 2 rounds x (1 + 3 clients) x 2 requests + 2 to warm up: none repeats
    prompts.write_text("".join(f"w{i} w{i + 40} w{i + 1}\n" for i in range(5, 23)))
    out = tmp_path / "load"
    done = subprocess.run([sys.executable, "-m", "tools.load_test", "--artifact", str(pair_dir), "--concurrency", "1,3",
                           "--requests", "2", "--max-tokens", "12", "--context", "96", "--prompt-file", str(prompts),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    setup = report["setup"]  # where the result came from, written beside it
    assert setup["command"].startswith("python -m tools.load_test --artifact") and "--concurrency 1,3" in setup["command"]
    assert setup["machine"].endswith("cores") and setup["date"].count("-") == 2
    assert setup["command"] in out.with_suffix(".md").read_text()
    rows = report["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, n) for m in ("plain", "fixed", "cost") for n in (1, 3)]
    for row in rows:  # two rounds by default, the modes taking turns within each
        assert row["rounds"] == 2 and row["requests"] == 2 * 2 * row["concurrency"] == row["completed"]
        assert not row["errors"]
        # the modes' servers share one pipeline and are sent the same prompts: each mode's own key scopes the prefix
        # cache and the suffix index, and each stage sends prompts no server has answered, so nothing is reused
        assert row["cached_prompt_tokens"] == 0
        assert row["tokens"] > 0 and row["throughput"] > 0 and 0 < row["ttft_p50"] <= row["ttft_p99"]
        # what speculation did, from each response's speculative block: none in plain decoding, drafts at fixed K
        if row["mode"] == "plain":
            assert row["drafted"] == 0 and row["tokens_per_cycle"] == 1.0
        if row["mode"] == "fixed":
            assert row["drafted"] > 0 and row["tokens_per_cycle"] >= 1.0
    order = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("round ") and "N=1:" in line]
    assert order == ["plain", "fixed", "cost", "fixed", "cost", "plain"]  # each round starts with the next mode
    assert "| cost | 3 |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size > 0
    throughput = {(r["mode"], r["concurrency"]): r["throughput"] for r in rows}
    for versus in report["versus"]:  # the cost policy against the better rival, pooled as the main table is
        n = versus["concurrency"]
        best = max(("plain", "fixed"), key=lambda mode: throughput[mode, n])
        assert versus["best"] == best and versus["pooled"] == throughput["cost", n] / throughput[best, n]
        assert len(versus["rounds"]) == 2 and all(r > 0 for r in versus["rounds"])
        assert versus["rounds_at_least"] == sum(r >= 1 for r in versus["rounds"])
    assert [v["concurrency"] for v in report["versus"]] == [1, 3]
    assert len(report["client_pids"]) == 1 and report["server_pid"] not in report["client_pids"]  # clients apart
    assert "| 3 | " in done.stdout.split("better rival")[1]
    assert report["repeated_requests"] == 0 and "repeat a prompt" not in done.stdout


def test_requests_beyond_the_prompt_set_are_counted_as_repeats():
    from argparse import Namespace

    from tools.load_test import repeats

    args = Namespace(rounds=2, requests=2, warmup=2)
    assert repeats(18, [1, 3], args) == 0  # 2 x 4 x 2 = 16 measured, 2 warm-up
    assert repeats(10, [1, 3], args) == 8
    assert repeats(16, [1, 3], Namespace(rounds=2, requests=2, warmup=0)) == 1  # no warm-up still sends one


def test_load_test_refuses_zero_rounds_before_loading_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.load_test", "--artifact", str(tmp_path / "none"), "--rounds", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--rounds: got 0; expected an integer >= 1" in done.stderr
