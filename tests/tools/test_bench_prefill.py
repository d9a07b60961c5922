"""tools/bench_prefill.py: prefill timed through the runtime's path for each artifact and model, the last logits
compared between artifacts (the same weights as fused graphs that trim their logits and explicit ones that do not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_prefill.py"


def test_each_artifact_and_model_is_timed_and_their_last_logits_agree(exported_architecture, tmp_path):
    # the parity suite's llama in both graph forms: the same weights, the fused graph trimming its logits
    _, explicit = exported_architecture("llama", "explicit")
    _, fused = exported_architecture("llama", "fused")
    out = tmp_path / "prefill.json"
    done = subprocess.run([sys.executable, str(TOOL), "--artifact", str(explicit), "--artifact", str(fused),
                           "--lengths", "3,40", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["index"], r["role"], r["tokens"]) for r in rows) == sorted(
        (i, "target", n) for i in (0, 1) for n in (3, 40))
    assert {(r["index"], r["trims_logits"]) for r in rows} == {(0, False), (1, True)}
    assert all(r["warm_ms"] > 0 and r["cold_ms"] > 0 for r in rows)
    # the fused graph's last position, computed alone, is the explicit graph's, computed among all of them
    assert all(r["max_logit_difference"] < 1e-3 for r in rows), [r["max_logit_difference"] for r in rows]


def test_lengths_the_models_cannot_hold_are_refused(fused_dirs):
    done = subprocess.run([sys.executable, str(TOOL), "--artifact", str(fused_dirs["close"]), "--lengths", "5000"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "do not fit" in done.stderr and "capacity 96" in done.stderr
