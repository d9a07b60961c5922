"""tools/bench_thread_pool.py: the three ways to share the cores all run, each configuration measured in each
worker, and the medians taken over what the workers measured."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_pool_mode_decodes_every_configuration(pair_dir, tmp_path):
    out = tmp_path / "pools.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench_thread_pool", "--artifact", str(pair_dir), "--rounds", "1",
                           "--repeats", "2", "--max-new-tokens", "4", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    names = ["plain", "fixed k=4", "cost k<=8, hybrid"]
    for mode in ("spinning", "stop", "shared"):
        assert list(figures["rates"][mode]) == names
        assert all(len(rates) == 2 and all(r > 0 for r in rates) for rates in figures["rates"][mode].values())
        assert figures["medians"][mode] == {name: statistics.median(v) for name, v in figures["rates"][mode].items()}
