"""Engine costs remembered from one process to the next (``Pipeline.load(..., remember_costs=True)``)."""

from __future__ import annotations

import json

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.calibration import FOLDER, RememberedCosts, machine_key

CONFIG = GenerationConfig(max_new_tokens=24, ignore_eos=True, k=4, policy="cost")


def _record(cache) -> dict:
    files = list((cache / FOLDER).glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_a_new_process_starts_from_the_costs_the_last_one_measured(pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    plain = Pipeline.load(pair_dir).generate(["w5 w6"], GenerationConfig(max_new_tokens=24, ignore_eos=True,
                                                                          drafter="none"))[0]
    first = Pipeline.load(pair_dir, remember_costs=True)
    assert first.policy_for(CONFIG).draft_step is None  # nothing remembered yet: a cold start
    out = first.generate(["w5 w6"], CONFIG)[0]
    kept = first._policies[("cost", 4, "model")]
    assert _record(tmp_path)["cost/4/model"]["verify"] == {str(t): v for t, v in kept.verify.items()}

    second = Pipeline.load(pair_dir, remember_costs=True)  # as a new process would: nothing in memory
    recalled = second.policy_for(CONFIG)
    assert recalled.draft_step == kept.draft_step and recalled.verify == kept.verify and 1 in recalled.verify
    streamed = list(second.stream("w5 w6", CONFIG))[-1].result
    assert out.token_ids == streamed.token_ids == plain.token_ids  # lossless whatever the policy starts from
    assert _record(tmp_path)["cost/4/model"]["verify"] != {str(t): v for t, v in kept.verify.items()}  # updated

    off = Pipeline.load(pair_dir)  # the default for the Python API: a process learns its own
    assert off.policy_for(CONFIG).draft_step is None


def test_remembered_costs_belong_to_their_artifact_provider_and_threads(pair_dir, self_dir):
    keys = {machine_key(pair_dir, "cpu", None), machine_key(pair_dir, "cpu", 2), machine_key(pair_dir, "cuda", None),
            machine_key(self_dir, "cpu", None)}
    assert len(keys) == 4 and machine_key(pair_dir, "cpu", 2) == machine_key(pair_dir, "cpu", 2)


def test_an_unreadable_record_means_a_cold_start_and_is_replaced(pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    record = RememberedCosts(machine_key(pair_dir, "cpu", None)).path
    record.parent.mkdir(parents=True)
    for junk in ("{not json", "[1, 2]", json.dumps({"cost/4/model": {"k_max": 4, "verify": "fast"}})):
        record.write_text(junk)
        pipeline = Pipeline.load(pair_dir, remember_costs=True)
        assert pipeline.policy_for(CONFIG).draft_step is None
    pipeline.generate(["w5 w6"], CONFIG)
    assert _record(tmp_path)["cost/4/model"]["k_max"] == 4


def test_generate_cli_remembers_costs_unless_told_not_to(pair_dir, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specdeploy.cli import main

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    args = ["generate", str(pair_dir), "--prompt", "w5 w6", "--max-new-tokens", "8"]  # the CLI's default: cost, K <= 8, hybrid
    assert CliRunner().invoke(main, [*args, "--no-remember-costs"]).exit_code == 0
    assert not (tmp_path / FOLDER).exists()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "cost/8/hybrid" in _record(tmp_path)
    result = CliRunner().invoke(main, [*args, "--k", "4", "--drafter", "model"])
    assert result.exit_code == 0, result.output
    assert {"cost/8/hybrid", "cost/4/model"} <= set(_record(tmp_path))
