"""tools/bench_provider_rates.py: every side's plain decoding and default interleaved, and its target calls told apart
by whether their token count changed since the request's previous call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tools.bench_provider_rates import calls_by_shape

ROOT = Path(__file__).resolve().parents[2]


def _cycle(config: str, request: str, drafted: int, seconds: float) -> str:
    return json.dumps({"type": "cycle", "config": config, "request_id": request, "drafted": drafted,
                       "verify_s": seconds})


def test_calls_by_shape_parts_calls_after_the_same_token_count_from_those_after_another(tmp_path):
    # request a: T = 1, 1, 3, 1, 3, 3; request b starts over (its first call follows nothing of its own)
    cycles = [_cycle("ov | default", "a", d, s) for d, s in
              [(0, 0.9), (0, 0.050), (2, 0.070), (0, 0.060), (2, 0.072), (2, 0.055)]]
    cycles += [_cycle("ov | default", "b", 2, 0.9), _cycle("ov | default", "b", 0, 0.062)]
    cycles += [_cycle("cpu | plain", "c", 0, s) for s in (0.9, 0.048, 0.049)]
    cycles.append(json.dumps({"type": "run", "config": "ov | default"}))  # not a cycle: not read
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(cycles) + "\n")

    lines = calls_by_shape(records)

    assert len(lines) == 2
    ov, cpu = lines
    # T = 1 after a T = 1: 50 ms (a's second call; first calls of a request are not counted); after a T = 3: a's 60 and
    # b's 62 ms, median 61
    assert "T=1: 50.0 (n 1) / 61.0 (n 2)" in ov
    # T = 3 after a T = 3: 55 ms; after a T = 1: 70 and 72 ms
    assert "T=3: 55.0 (n 1) / 71.0 (n 2)" in ov
    assert "T=2" not in ov  # no call of 2 tokens
    assert cpu.split()[:3] == ["cpu", "|", "plain"] and "T=1: 48.5 (n 2) / -" in cpu


def test_the_tool_runs_a_side_and_prints_its_calls_by_shape(pair_dir, tmp_path):
    out = tmp_path / "rates"
    done = subprocess.run([sys.executable, "-m", "tools.bench_provider_rates", "--side", f"cpu={pair_dir}@cpu",
                           "--humaneval", "2", "--specbench", "0", "--max-new-tokens", "6", "--threads", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["all"]) == {"cpu | plain", "cpu | default"}
    printed = done.stdout.split("Target calls by tokens T")[1]
    assert "cpu | plain" in printed and "cpu | default" in printed
    assert "T=1: " in printed.split("cpu | plain")[1].splitlines()[0]
