"""tools/bench_cli_policies.py: each configuration runs what its name says, whatever the CLI's defaults, and the
tool runs every configuration in fresh processes and summarises them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.core import ParameterSource

from specdeploy.cli import main

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_cli_policies.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_cli_policies", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, policy, k, drafter, remember", [
    ("plain", "fixed", None, "none", True),
    ("k=2", "fixed", 2, "model", True),
    ("k=4", "fixed", 4, "model", True),
    ("cost", "cost", 8, "model", True),
    ("cost, cold", "cost", 8, "model", False),
    ("hybrid, cost", "cost", 8, "hybrid", True),
])
def test_each_configuration_spells_out_its_policy_k_and_drafter(tmp_path, name, policy, k, drafter, remember):
    """With the CLI's defaults at the cost policy over the hybrid drafter, "k=4" left to them ran the cost policy at
    K <= 4 over the hybrid drafter: every choice is now given on the command line, none taken from a default."""
    options = _tool().configurations([2, 4])[name]
    context = main.commands["generate"].make_context("generate", [str(tmp_path), *options])
    spelled = ["policy", "drafter"] + (["k"] if k is not None else [])
    assert all(context.get_parameter_source(p) == ParameterSource.COMMANDLINE for p in spelled), name
    assert (context.params["policy"], context.params["drafter"], context.params["remember_costs"]) == (
        policy, drafter, remember)
    if k is not None:
        assert context.params["k"] == k


def test_every_configuration_runs_in_a_fresh_process_and_is_summarised(pair_dir, tmp_path):
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, str(TOOL), "--artifact", str(pair_dir), "--humaneval", "1", "--humaneval-from",
                           "0", "--specbench", "0", "--lengths", "4", "--ks", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "SPECDEPLOY_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert sorted(r["config"] for r in report["runs"]) == sorted(["plain", "k=2", "cost", "cost, cold", "hybrid, cost"])
    assert all(r["tokens"] == 4 and r["seconds"] > 0 for r in report["runs"])
    assert [(s["group"], s["max_new_tokens"]) for s in report["summary"]] == [("humaneval", 4), ("all", 4)]
    assert "identical to plain: " in done.stdout
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # the cost configurations kept their record


def test_a_baseline_checkouts_cost_configurations_run_beside_with_a_record_of_their_own(pair_dir, tmp_path):
    """The baseline's runs import the baseline's package (a copy of this one here), not this checkout's: run from
    this checkout's directory, ``python -m`` had put it first on the path and the "baseline" ran today's code."""
    import shutil

    root = tmp_path / "baseline-checkout"
    shutil.copytree(Path(__file__).resolve().parents[2] / "specdeploy", root / "specdeploy")
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, str(TOOL), "--artifact", str(pair_dir), "--humaneval", "1", "--humaneval-from",
                           "0", "--specbench", "0", "--lengths", "4", "--ks", "1", "--no-cold", "--baseline", str(root),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "SPECDEPLOY_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"baseline: specdeploy from {(root / 'specdeploy').resolve()}" in done.stdout
    report = json.loads(out.read_text())
    assert sorted(r["config"] for r in report["runs"]) == sorted(
        ["plain", "k=1", "cost", "hybrid, cost", "cost @base", "hybrid, cost @base"])
    assert all(0 < s["base_hybrid_vs_plain"] for s in report["summary"]) and "base: cost/plain" in done.stdout
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    assert len(list((tmp_path / "baseline" / "costs").glob("*.json"))) == 1  # the baseline's record is its own
    done = subprocess.run([sys.executable, str(TOOL), "--artifact", str(pair_dir), "--baseline", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "not a checkout of specdeploy" in done.stderr
    assert _tool().imported_from(None) == Path(__file__).resolve().parents[2] / "specdeploy"
