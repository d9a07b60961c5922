"""specdeploy bench and report on tiny exported models, end to end through the CLI."""

from __future__ import annotations

import json
import struct

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specdeploy.cli import main
from specdeploy.reports.bench import read_records, summarize
from specdeploy.reports.plots import PLOTS
from specdeploy.reports.prometheus import SpecDecodingMetrics
from specdeploy.runtime.telemetry import CycleRecord


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def bench_dir(pair_dir, tmp_path_factory):
    prompts = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    lines = [{"prompt": "w5 w6 w7", "id": "a", "category": "x"}, {"prompt": "w30 w31 w30 w31", "id": "b", "category": "y"},
             {"prompt": "w9", "id": "c", "category": "x"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path_factory.mktemp("bench") / "out"
    result = run("bench", pair_dir, "--prompts", prompts, "--k", "0,1,3", "--policy", "fixed,cost",
                 "--drafter", "model,prompt-lookup", "--temperature", "0,0.8", "--max-new-tokens", "10",
                 "--repeat", "2", "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_summary_is_recomputed_exactly_from_records(bench_dir):
    summary = json.loads((bench_dir / "summary.json").read_text())
    recomputed = json.loads(json.dumps(summarize(read_records(bench_dir / "records.jsonl"))))
    assert summary == recomputed
    assert set(summary) == {"all", "prompts/x", "prompts/y"}  # segmented by prompt set and category


def test_grid_and_baseline_in_one_process(bench_dir):
    summary = json.loads((bench_dir / "summary.json").read_text())["all"]
    # 2 temperatures x (baseline + 2 drafters x 2 policies x 2 ks)
    assert len(summary) == 2 * (1 + 2 * 2 * 2)
    runs = [r for r in read_records(bench_dir / "records.jsonl") if r["type"] == "run"]
    assert {r["config"] for r in runs} == set(summary)
    assert all(r["repeat"] in (0, 1) for r in runs) and len(runs) == len(summary) * 3 * 2
    # the baseline ran interleaved with the others in the same file (same process, same rounds)
    configs_in_order = [r["config"] for r in runs]
    first_base = configs_in_order.index("plain t=0")
    last_base = len(configs_in_order) - 1 - configs_in_order[::-1].index("plain t=0")
    assert first_base < len(summary) and last_base > len(runs) - len(summary) - 1
    for name, entry in summary.items():
        if entry["k"] == 0:
            assert entry["speedup_median"] == pytest.approx(1.0)
        if name.endswith("t=0"):
            assert entry["identical_to_baseline"] == entry["runs"]  # greedy: always identical
    assert all(0 <= s <= 1 for e in summary.values() for s in e["time_share"].values())


def test_report_writes_valid_pngs_and_pages(bench_dir):
    result = run("report", bench_dir)
    assert result.exit_code == 0, result.output
    for name in PLOTS:
        data = (bench_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (800, 500)
    page = (bench_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(PLOTS) and "model fixed k=3 t=0" in page
    assert "| configuration |" in (bench_dir / "report.md").read_text()


def test_prometheus_exposition_matches_records(bench_dir):
    cycles = [r for r in read_records(bench_dir / "records.jsonl") if r["type"] == "cycle"]
    registry = CollectorRegistry()
    metrics = SpecDecodingMetrics(registry)
    metrics.observe_all(CycleRecord.from_dict(c) for c in cycles)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    value = {f: sum(s.value for s in families[f].samples if s.name.endswith("_total")) for f in
             ("specdeploy_cycles", "specdeploy_drafted_tokens", "specdeploy_accepted_tokens", "specdeploy_emitted_tokens",
              "specdeploy_committed_tokens")}
    assert value["specdeploy_cycles"] == len(cycles)
    assert value["specdeploy_drafted_tokens"] == sum(c["drafted"] for c in cycles)
    assert value["specdeploy_accepted_tokens"] == sum(c["accepted"] for c in cycles)
    assert value["specdeploy_emitted_tokens"] == sum(c["committed"] for c in cycles)
    assert value["specdeploy_committed_tokens"] == value["specdeploy_emitted_tokens"]  # the old name: the same count
    verify_sum = [s.value for s in families["specdeploy_cycle_phase_seconds"].samples
                  if s.name.endswith("_sum") and s.labels["phase"] == "verify"]
    assert verify_sum[0] == pytest.approx(sum(c["verify_s"] for c in cycles))


def test_a_records_file_written_before_0_5_reads_under_the_new_field_names(bench_dir, tmp_path):
    """A records.jsonl whose cycle lines say k / emitted / lookup (before 0.5) summarizes as the same lines under
    drafted / committed / free do, with a DeprecationWarning, and `specdeploy report` still draws it."""
    new = (bench_dir / "records.jsonl").read_text().splitlines()
    renamed = {"drafted": "k", "committed": "emitted", "free": "lookup"}
    old = [json.dumps({renamed.get(key, key): value for key, value in json.loads(line).items()}) if '"cycle"' in line
           else line for line in new]
    assert any('"k":' in line and '"emitted":' in line and '"lookup":' in line for line in old)
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "records.jsonl").write_text("\n".join(old) + "\n")
    with pytest.warns(DeprecationWarning, match="k, emitted, lookup are deprecated"):
        lines = read_records(old_dir / "records.jsonl")
    assert lines == read_records(bench_dir / "records.jsonl")
    (old_dir / "summary.json").write_text(json.dumps(summarize(lines)))
    assert json.loads((old_dir / "summary.json").read_text()) == json.loads((bench_dir / "summary.json").read_text())
    result = run("report", old_dir)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args,message", [
    (["--prompts", "{missing}"], "no such file"),
    (["--prompts", "{empty}"], "contains no prompt"),
    (["--prompts", "{bad}"], "bad.jsonl:2: not valid JSON"),
    (["--prompts", "{good}", "--k", ""], "--k: empty"),
    (["--prompts", "{good}", "--k", "0"], "no speculative configuration"),
    (["--prompts", "{good}", "--policy", "fixed,magic"], "--policy: unknown ['magic']"),
    (["--prompts", "{good}", "--drafter", "eagle"], "--drafter: unknown ['eagle']"),
    (["--prompts", "{good}", "--k", "1,x"], "expected a comma-separated list of int"),
    (["--prompts", "{good}", "--provider", "cuda"], "'cuda' (CUDAExecutionProvider) is not available"),
])
def test_bench_bad_input(pair_dir, tmp_path, args, message):
    files = {"missing": tmp_path / "missing.txt", "empty": tmp_path / "empty.txt", "bad": tmp_path / "bad.jsonl",
             "good": tmp_path / "good.txt"}
    files["empty"].write_text("\n")
    files["bad"].write_text('{"prompt": "w5"}\n{nope\n')
    files["good"].write_text("w5 w6\n")
    args = [a.format(**files) for a in args]
    result = run("bench", pair_dir, *args, "--out", tmp_path / "out")
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_bench_refuses_existing_out(pair_dir, tmp_path):
    (tmp_path / "good.txt").write_text("w5 w6\n")
    (tmp_path / "out").mkdir()
    result = run("bench", pair_dir, "--prompts", tmp_path / "good.txt", "--out", tmp_path / "out")
    assert result.exit_code != 0 and "already exists; pass --force" in result.output


def test_bench_force_replaces_only_a_bench_directory(pair_dir, tmp_path):
    (tmp_path / "good.txt").write_text("w5 w6\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    result = run("bench", pair_dir, "--prompts", tmp_path / "good.txt", "--out", mine, "--force")
    assert result.exit_code != 0 and "not a bench output directory" in result.output
    assert (mine / "thesis.tex").read_text() == "years of work"
    out = tmp_path / "out"
    for _ in range(2):  # a bench directory is replaced
        result = run("bench", pair_dir, "--prompts", tmp_path / "good.txt", "--k", "0,1", "--max-new-tokens", "3",
                     "--out", out, "--force")
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["records.jsonl", "summary.json"]


def test_report_on_a_non_bench_dir(tmp_path):
    result = run("report", tmp_path)
    assert result.exit_code != 0 and "no summary.json" in result.output


def test_several_artifacts_run_side_by_side_each_against_its_own_plain_and_the_first(pair_dir, noise_dir, tmp_path):
    """Two exports of the same target with different drafts: every configuration of both, interleaved per prompt; each
    is compared with its own artifact's plain decoding, and the second artifact with the first one's."""
    (tmp_path / "p.txt").write_text("w5 w6 w7\nw30 w31 w30 w31\n")
    out = tmp_path / "out"
    result = run("bench", pair_dir, noise_dir, "--prompts", tmp_path / "p.txt", "--k", "0,2", "--max-new-tokens", "8",
                 "--out", out)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())["all"]
    assert sorted(summary) == ["noise | model fixed k=2 t=0", "noise | plain t=0", "pair | model fixed k=2 t=0",
                               "pair | plain t=0"]
    for label in ("pair", "noise"):
        assert summary[f"{label} | model fixed k=2 t=0"]["baseline"] == f"{label} | plain t=0"
        assert summary[f"{label} | plain t=0"]["artifact"] == label
    # the same target: plain decoding of the second artifact is the first one's, token for token
    second = summary["noise | plain t=0"]
    assert second["reference"] == "pair | plain t=0" and second["identical_to_reference"] == second["runs"] == 2
    assert second["speedup_vs_reference_median"] > 0 and "reference" not in summary["pair | plain t=0"]
    assert summary["noise | model fixed k=2 t=0"]["identical_to_baseline"] == 2
    runs = [r for r in read_records(out / "records.jsonl") if r["type"] == "run"]
    first_prompt = [r["config"] for r in runs if r["prompt_id"] == "1"]
    assert sorted(first_prompt) == sorted(summary)  # every configuration of both artifacts on each prompt


def test_spec_bench_runs_from_the_package_segmented_by_group(pair_dir, tmp_path):
    out = tmp_path / "out"
    # Spec-Bench's first MT-bench question is short enough for the tiny models' 96 slots
    result = run("bench", pair_dir, "--specbench", "1", "--limit", "1", "--k", "0,1", "--max-new-tokens", "4", "--out", out)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"all", "spec_bench/mt_bench"}
    runs = [r for r in read_records(out / "records.jsonl") if r["type"] == "run"]
    assert {(r["prompt_set"], r["category"], r["prompt_id"]) for r in runs} == {("spec_bench", "mt_bench", "81")}


@pytest.mark.parametrize("args, message", [
    ([], "no prompts: give --prompts, --humaneval N, --specbench N, --conversations N or --structured N"),
    (["--specbench", "81"], "asked for 81 prompts per group; each group has 80"),
    (["--conversations", "9"], "conversation workload: asked for 9 conversations; it has 8"),
    (["--structured", "9"], "structured workload: asked for 9 prompts; it has 8"),
    (["--humaneval", "2", "--humaneval-from", "163"], "HumanEval: asked for tasks 163..164; it has 164"),
    (["--humaneval-from", "3"], "--humaneval-from goes with --humaneval N"),
])
def test_a_workload_that_cannot_be_had_is_an_error(pair_dir, tmp_path, args, message):
    result = run("bench", pair_dir, *args, "--out", tmp_path / "out")
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_spec_bench_missing_from_the_install_is_an_error(pair_dir, tmp_path, monkeypatch):
    from specdeploy import workloads

    monkeypatch.setattr(workloads, "SPEC_BENCH_FILE", "data/not-shipped.jsonl")
    result = run("bench", pair_dir, "--specbench", "1", "--out", tmp_path / "out")
    assert result.exit_code != 0 and "not-shipped.jsonl is missing from the installed specdeploy package" in result.output


class _Scripted:
    """A pipeline that answers each configuration with set tokens, and locates a divergence as plain decoding would."""

    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs, self.located, self.indexes = outputs, [], []

    def generate(self, prompts, config, batch_size=1, suffix_index=None, scope="shared"):
        from specdeploy.runtime.pipeline import GenerationResult

        self.indexes.append((config.drafter, config.max_new_tokens > 4, suffix_index, scope))
        ids = self.outputs[config.drafter] if config.max_new_tokens > 4 else [0]
        return [GenerationResult(text="", token_ids=list(ids), stats={"tokens": len(ids), "seconds": 0.5}) for _ in prompts]

    def first_divergence(self, prompt, reference, other, config):
        self.located.append((prompt, reference, other, config.drafter))
        position = next(i for i, (a, b) in enumerate(zip(reference, other)) if a != b)
        return {"position": position, "reference_token": reference[position], "other_token": other[position],
                "margin": 0.25}


def test_a_greedy_run_that_leaves_plain_decoding_is_located_with_the_plain_margin(tmp_path):
    from specdeploy.reports.bench import build_grid, run_bench
    from specdeploy.reports.plots import summary_table
    from specdeploy.workloads import Prompt

    pipeline = _Scripted({"none": [5, 6, 7, 8], "model": [5, 6, 9, 9], "prompt-lookup": [5, 6, 7, 8]})
    grid = build_grid([0, 2], ["fixed"], ["model", "prompt-lookup"], [0.0], 8, artifacts=["a"])
    summary = run_bench({"a": pipeline}, grid, [Prompt("p1", "w5 w6")], tmp_path, repeat=2)["all"]
    model, lookup = summary["model fixed k=2 t=0"], summary["prompt-lookup fixed k=2 t=0"]
    assert model["identical_to_baseline"] == 0 and lookup["identical_to_baseline"] == 2
    assert model["divergences"] == [{"prompt_id": "p1", "repeat": r, "position": 2, "reference_token": 7, "other_token": 9,
                                     "margin": 0.25} for r in (0, 1)]
    assert lookup["divergences"] == [] and summary["plain t=0"]["divergences"] == []
    # located against the plain run's tokens, under plain decoding's configuration
    assert pipeline.located == [("w5 w6", [5, 6, 7, 8], [5, 6, 9, 9], "none")] * 2
    header, rows = summary_table(summary)
    assert dict(zip(header, next(r for r in rows if r[0] == "model fixed k=2 t=0")))["identical"] == \
        "0/2 (differing: margin <= 0.25)"


def test_each_setting_drafts_from_its_own_index_fresh_each_round(tmp_path):
    """No setting drafts from another's answer to the same prompt, nor from its own of an earlier round, nor reuses
    another's K/V (each index its own scope); warm-ups draft from none."""
    from specdeploy.reports.bench import build_grid, run_bench
    from specdeploy.workloads import Prompt

    pipeline = _Scripted({"none": [5, 6], "model": [5, 6], "suffix": [5, 6]})
    grid = build_grid([0, 2], ["fixed"], ["model", "suffix"], [0.0], 8, artifacts=["a"])
    run_bench({"a": pipeline}, grid, [Prompt("p1", "w5"), Prompt("p2", "w6")], tmp_path, repeat=2)
    assert all(index is None for _, measured, index, _ in pipeline.indexes if not measured)
    runs = [(drafter, index, scope) for drafter, measured, index, scope in pipeline.indexes if measured]
    assert len(runs) == 2 * 2 * 3 and all(index is not None for _, index, _ in runs)
    by_index, scopes = {}, {}
    for drafter, index, scope in runs:
        by_index.setdefault(id(index), set()).add(drafter)
        scopes.setdefault(id(index), set()).add(scope)
    assert len(by_index) == 3 * 2 and all(len(drafters) == 1 for drafters in by_index.values())
    assert all(len(names) == 1 for names in scopes.values()) and len(set().union(*scopes.values())) == 3 * 2
