"""tools/profile_ops.py: each kernel's time lands on the call (and token count) it ran in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import profile_ops  # noqa: E402

from specdeploy.contract import Manifest  # noqa: E402


def test_the_profile_of_a_fused_target_names_its_matrices(fused_dirs, tmp_path):
    directory = fused_dirs["close"]
    spec = Manifest.read(directory).target
    profiled = profile_ops.profile(directory / spec.file, spec, [1, 3], past=6, rounds=2, threads=1, workdir=tmp_path)
    assert {t: len(ms) for t, ms in profiled["calls"].items()} == {1: 2, 3: 2}  # the warm-up round is not counted
    for tokens in (1, 3):
        assert {"MatMul", "GroupQueryAttention"} <= set(profiled["ops"][tokens])
        kernels = [sum(ms[i] for ms in profiled["ops"][tokens].values()) for i in range(2)]
        assert all(0 < k <= call for k, call in zip(kernels, profiled["calls"][tokens]))
        # nodes are named after their weights, one entry per timed call
        nodes = profiled["nodes"][tokens]
        assert nodes["lm_head"][0] == "MatMul" and len(nodes["lm_head"][1]) == 2
        assert nodes["layers.0.gate_up"][0] == "MatMul"
        assert nodes["layers.1.attention"][0] == "GroupQueryAttention"
    summary = profile_ops.summarize(profiled, [1, 3], top=3)
    growth = [ms[3] - ms[1] for _, _, ms in summary["growth"]]
    assert len(growth) == 3 and growth == sorted(growth, reverse=True)
    assert list(summary["ops"]) == sorted(summary["ops"], key=lambda op: -summary["ops"][op][3])


def test_a_trace_that_does_not_match_the_calls_made_is_refused():
    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 10}]
    with pytest.raises(RuntimeError, match="holds 1 runs; expected 2"):
        profile_ops.attribute(events, [(1, False), (1, True)])


def test_kernels_are_attributed_to_the_enclosing_run():
    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},
              {"cat": "Session", "name": "model_run", "ts": 200, "dur": 100},
              {"cat": "Node", "name": "a_kernel_time", "ts": 10, "dur": 40, "args": {"op_name": "MatMul"}},
              {"cat": "Node", "name": "a_fence_before", "ts": 9, "dur": 1, "args": {"op_name": "MatMul"}},
              {"cat": "Node", "name": "a_kernel_time", "ts": 210, "dur": 70, "args": {"op_name": "MatMul"}},
              {"cat": "Node", "name": "b_kernel_time", "ts": 285, "dur": 5, "args": {"op_name": "Add"}}]
    profiled = profile_ops.attribute(events, [(1, True), (5, True)])
    assert profiled["calls"] == {1: [0.1], 5: [0.1]}
    assert profiled["ops"] == {1: {"MatMul": [0.04]}, 5: {"MatMul": [0.07], "Add": [0.005]}}
    assert profiled["nodes"][5]["b"] == ("Add", [0.005])


def test_the_command_prints_both_models_and_writes_json(fused_dirs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["profile_ops.py", "--artifact", str(fused_dirs["close"]), "--tokens", "1,2",
                                      "--past", "4", "--rounds", "1", "--threads", "1", "--out", str(out)])
    profile_ops.main()
    printed = capsys.readouterr().out
    assert "target (target.onnx)" in printed and "draft (draft.onnx)" in printed and "(whole call)" in printed
    report = json.loads(out.read_text())
    assert set(report["models"]) == {"target", "draft"}
    assert report["models"]["target"]["call_ms"]["1"] > 0


def test_a_past_beyond_the_capacity_is_refused(fused_dirs, monkeypatch, capsys):
    capacity = Manifest.read(fused_dirs["close"]).target.capacity
    monkeypatch.setattr(sys, "argv", ["profile_ops.py", "--artifact", str(fused_dirs["close"]), "--past", str(capacity)])
    with pytest.raises(SystemExit):
        profile_ops.main()
    assert f"exceed the target's capacity {capacity}" in capsys.readouterr().err
