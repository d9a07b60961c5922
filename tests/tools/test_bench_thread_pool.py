"""tools/bench_thread_pool.py: the three ways to share the cores all run, each configuration measured in each
worker, and the table printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_thread_pool.py"


def test_every_pool_mode_decodes_every_configuration(pair_dir, tmp_path):
    out = tmp_path / "pools.json"
    done = subprocess.run([sys.executable, str(TOOL), "--artifact", str(pair_dir), "--rounds", "1", "--repeats", "2",
                           "--max-new-tokens", "4", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    names = ["plain", "fixed k=4", "cost k<=8, hybrid"]
    for mode in ("spinning", "stop", "shared"):
        assert list(figures["rates"][mode]) == names
        assert all(len(rates) == 2 and all(r > 0 for r in rates) for rates in figures["rates"][mode].values())
    table = done.stdout.splitlines()[-3:]
    assert [line.split()[0] for line in table] == ["plain", "fixed", "cost"]
    medians = figures["medians"]
    for line, name in zip(table, names):
        ratios = [float(x) for x in line.split()[-2:]]
        assert ratios == [round(medians[mode][name] / medians["spinning"][name], 2) for mode in ("stop", "shared")]
