"""tools/bench_int8_range.py: one checkpoint at fp32 and at int8 with 7- and 8-bit weights, scored against fp32."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_int8_range.py"


def test_both_ranges_are_scored_against_fp32_and_timed(checkpoints, pair_dir, tmp_path):
    shutil.copytree(pair_dir, tmp_path / "work" / "full")  # its full-weights export (the suite's, to save one)
    out = tmp_path / "range.json"
    done = subprocess.run([sys.executable, str(TOOL), "--checkpoint", str(checkpoints["target"]), "--workdir",
                           str(tmp_path / "work"), "--tasks", "2", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())["figures"]
    assert list(figures) == ["fp32", "int8, 7-bit weights (0.3.3)", "int8, 8-bit weights (0.3.2)"]
    assert all(row["ms T=1"] > 0 and row["ms T=5"] > 0 for row in figures.values())
    seven = figures["int8, 7-bit weights (0.3.3)"]
    assert seven["positions"] > 10 and seven["relative error mean"] < 0.05 and seven["top-1 agreement"] > 0.9
    # a second run reuses the rewrites it finds
    again = subprocess.run([sys.executable, str(TOOL), "--checkpoint", str(checkpoints["target"]), "--workdir",
                            str(tmp_path / "work"), "--tasks", "1", "--rounds", "1"], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "exporting" not in again.stderr and "rewritten" not in again.stderr
