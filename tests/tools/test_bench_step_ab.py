"""tools/bench_step_ab.py: one call of each of two exports in turn, and what it reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from specdeploy import Pipeline
from tools import bench_step_ab

ROOT = Path(__file__).resolve().parents[2]


def test_each_token_count_gets_both_sides_medians_and_the_paired_ratio(pair_dir, self_dir):
    engines = {"a": Pipeline.load(pair_dir).target, "b": Pipeline.load(self_dir).target}  # the same target, twice
    lines = []
    found = bench_step_ab.paired(engines, [1, 3], past=4, capacity=16, rounds=5, log=lines.append)
    assert list(found) == [1, 3] and len(lines) == 2
    for row in found.values():
        assert row["a_ms"] > 0 and row["b_ms"] > 0 and row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]


def test_a_past_beyond_the_capacity_is_refused_in_one_line(pair_dir):
    done = subprocess.run([sys.executable, "-m", "tools.bench_step_ab", "--a", str(pair_dir), "--b", str(pair_dir),
                           "--past", "95", "--tokens", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--past 95 + 2 tokens exceeds the capacity 96" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
