"""One greedy batch-1 cycle reads in a handful of modules (tools/trace_cycle.py lists them)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import trace_cycle  # noqa: E402

from specdeploy import GenerationConfig, Pipeline  # noqa: E402


def test_a_greedy_cycle_visits_at_most_six_modules(pair_dir):
    run = Pipeline.load(pair_dir).start(["w5 w6 w7 w8"], GenerationConfig(k=4, max_new_tokens=40, ignore_eos=True))
    run.prefill()
    run.step()
    visited = trace_cycle.trace_step(run)
    assert len(visited) <= 6, visited
    # the cycle's named steps all ran: policy, drafter, target, acceptance, commit
    assert visited["specdeploy.runtime.policies"] == ["FixedK.next_k"]
    assert "ModelDrafter.propose" in visited["specdeploy.runtime.drafters"]
    assert "greedy_accept_row" in visited["specdeploy.runtime.acceptance"]
    assert {"Generation._cycle", "BatchState.commit"} <= set(visited["specdeploy.runtime.decoder"])
    assert "Engine.infer" in visited["specdeploy.engines.base"]
