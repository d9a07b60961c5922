"""tools/bench_peer.py without the peer: its worker protocol, the peer's composite config and the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import Manifest
from tools import bench_peer

ROOT = Path(__file__).resolve().parents[2]


def test_specdeploy_worker_answers_over_its_protocol_as_the_pipeline_does(self_dir):
    ids = [5, 6, 7, 9]
    worker = bench_peer.Worker("specdeploy", str(self_dir), threads=1, k=3)
    try:
        assert worker.ready["load_s"]["artifact"] > 0 and worker.ready["rss_mb"] > 0
        plain = worker.run("plain", ids, 10)
        drafted = worker.run("fixed k=3", ids, 10)
    finally:
        worker.close()
    expected = Pipeline.load(self_dir).generate([ids], GenerationConfig(max_new_tokens=10, drafter="none"))[0].token_ids
    assert plain["tokens"] == drafted["tokens"] == expected and len(expected) > 1
    assert "divergence" not in drafted  # identical output: nothing to locate
    assert 0 < plain["first_s"] <= plain["seconds"] and plain["target_calls"] >= len(expected)
    assert drafted["target_calls"] < plain["target_calls"]  # the target drafting for itself: fewer target calls


def test_the_peers_pair_links_both_models_under_one_config_without_climbing_out(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_peer, "CACHE", tmp_path / "cache")
    models = {}
    for role in ("target", "draft"):
        folder = models[role] = tmp_path / role
        folder.mkdir()
        (folder / "model.onnx").write_bytes(role.encode())
        (folder / "model.onnx.data").write_bytes(role.encode() * 3)
        (folder / "tokenizer.json").write_text("{}")
        decoder = {"filename": "model.onnx", "num_hidden_layers": 2 if role == "target" else 1}
        (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": decoder}, "search": {}}))
    pair = bench_peer.peer_pair(models["target"], models["draft"], k=3)
    pair = bench_peer.peer_pair(models["target"], models["draft"], k=3)  # again: the links are replaced
    config = json.loads((pair / "genai_config.json").read_text())
    assert config["speculative"] == {"max_draft_tokens": 3}
    assert config["model"]["decoder"] == {"filename": "target/model.onnx", "num_hidden_layers": 2}
    assert config["model"]["draft"] == {"filename": "draft/model.onnx", "num_hidden_layers": 1}
    for role in ("target", "draft"):
        for name in ("model.onnx", "model.onnx.data"):
            assert (pair / role / name).stat().st_ino == (models[role] / name).stat().st_ino  # no copy
    assert (pair / "tokenizer.json").is_file()


def test_the_summary_counts_what_the_table_shows():
    reference = [[1, 2, 3], [4, 5]]
    runs = [
        {"tokens": [1, 2, 3], "seconds": 1.0, "first_s": 0.5, "target_calls": 3, "rss_mb": 100.0},
        {"tokens": [4, 6], "seconds": 0.5, "first_s": 0.25, "target_calls": 1, "rss_mb": 300.0,
         "divergence": {"position": 1, "margin": 0.1234}},
    ]
    summary = bench_peer.summarize(runs, own_plain=reference, reference=[[1, 2, 3], [4, 6]])
    assert summary["tok_s_e2e"] == 3.5 and summary["tok_s_e2e_total"] == 5 / 1.5
    assert summary["tok_s_decode"] == 4.0  # medians of 2 / 0.5 and 1 / 0.25
    assert summary["tokens_per_target_call"] == 5 / 4 and summary["peak_rss_mb"] == 300.0
    assert (summary["identical_to_own_plain"], summary["identical_to_specdeploy_plain"]) == (1, 2)
    assert summary["divergence_margins"] == [0.123]
    setup = {"date": "d", "command": "c", "machine": "m", "onnxruntime": "o", "peer": "p", "specdeploy": "s",
             "prompts": {"humaneval": 2, "spec_bench/qa": 1}, "max_tokens": 3, "threads": 2, "peer_models": "pm",
             "artifacts": "a", "reference": "r"}
    other = dict(summary, tok_s_e2e=7.25, prompts=1)
    text = bench_peer.markdown({"setup": setup, "results": {"specdeploy: fixed k=4": summary},
                                "by_group": {"humaneval": {"specdeploy: fixed k=4": summary},
                                             "spec_bench/qa": {"specdeploy: fixed k=4": other}},
                                "workers": {"specdeploy": {"process_s": 1.0, "load_s": {"artifact": 0.5}}}})
    assert "| specdeploy | fixed k=4 | 3.5 | 4.0 | 375 ms | 1.25 | 1/2 (differing: margins 0.123) | 2/2 | 0.29 GB |" in text
    assert "Prompts: humaneval 2, spec_bench/qa 1;" in text and "The table: humaneval;" in text
    assert "| humaneval (2) | 3.5 |" in text and "| spec_bench/qa (1) | 7.2 |" in text


@pytest.mark.parametrize("args, message", [
    (["--specbench", "81"], "asked for 81 prompts per group; each group has 80"),
    (["--humaneval", "165"], "it has 164"),
    (["--conversations", "9"], "conversation workload: asked for 9 conversations; it has 8"),
    (["--structured", "9"], "structured workload: asked for 9 prompts; it has 8"),
    (["--specbench", "1", "--specbench-groups", "qa,coding"], "--specbench-groups: got 'qa,coding'; expected a comma list"),
])
def test_a_workload_that_cannot_be_had_stops_the_tool_before_the_peers_set_up(tmp_path, args, message):
    """Spec-Bench ships with specdeploy now (a fresh clone had no ../shared, and --specbench 1 ran no Spec-Bench
    prompt in silence): a workload the sets cannot fill is an error, before minutes of installing and building."""
    done = subprocess.run([sys.executable, "-m", "tools.bench_peer", "--artifact", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert "installing" not in done.stderr


def test_specbench_groups_keep_those_groups_and_every_other_workload():
    from specdeploy.workloads import workload

    prompts = workload(1, 2, conversation_count=1)
    kept = bench_peer._only_groups(prompts, "rag,qa", parser=None)
    assert [g for g, _ in kept] == ["humaneval", "spec_bench/qa", "spec_bench/qa", "spec_bench/rag", "spec_bench/rag",
                                    "conversation/turn_1", "conversation/later_turns", "conversation/later_turns"]
    assert bench_peer._only_groups(prompts, None, parser=None) == prompts


def test_both_systems_get_a_chat_prompt_as_the_artifacts_chat_template_renders_it(chat_target_dir):
    """Rendered in the main process from the tokenizer and template alone, as the pipeline would render it."""
    from specdeploy.workloads import Prompt

    encode = bench_peer.prompt_encoder(chat_target_dir)
    pipeline = Pipeline.load(chat_target_dir)
    messages = ({"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
                {"role": "user", "content": "w8 w9"})
    assert encode(Prompt("c", "w8 w9", messages=messages)) == pipeline.chat_prompt(list(messages))
    assert encode(Prompt("t", "w5 w6")) == pipeline.tokenizer.encode("w5 w6", add_special_tokens=False).ids


def test_a_prompt_over_the_artifacts_capacity_stops_the_tool_before_the_peers_set_up(chat_target_dir):
    done = subprocess.run([sys.executable, "-m", "tools.bench_peer", "--artifact", str(chat_target_dir), "--humaneval",
                           "0", "--conversations", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "prompt HumanEval/0/turn-1: " in done.stderr, done.stderr[-2000:]
    assert f"{chat_target_dir} has 96" in done.stderr and "installing" not in done.stderr


def test_specdeploy_drives_the_peers_own_graphs_beside_the_peers_generator(foreign, tmp_path, monkeypatch):
    """--peer-graphs, on folders onnxruntime-genai's builder made from tiny checkpoints (standing in for the demo's
    GGUF pair): the peer's two folders imported, specdeploy's plain and default rows over them, each output compared
    with the peer's own greedy output."""
    from specdeploy.workloads import Prompt

    monkeypatch.setattr(bench_peer, "CACHE", tmp_path / "cache")
    folders = {"target": foreign["folders"]["genai-llama"], "draft": foreign["folders"]["genai-llama-draft"]}
    monkeypatch.setattr(bench_peer, "peer_model", lambda gguf, *_: folders["target" if "1.5b" in gguf.name else "draft"])
    artifact = foreign["artifacts"]["genai-llama"]
    args = bench_peer._parser().parse_args(["--artifact", str(artifact), "--peer-graphs", "--no-fixed", "--k", "3",
                                            "--threads", "1"])
    prompts = [("humaneval", Prompt("a", "w5 w6 w7 w8")), ("humaneval", Prompt("b", "w40 w41 w42"))]
    encode = bench_peer.prompt_encoder(artifact)
    workers, grid = bench_peer._start_workers(args)
    try:
        runs = bench_peer._run_grid(workers, grid, prompts, [encode(p) for _, p in prompts], encode, max_tokens=12)
    finally:
        for worker in workers.values():
            worker.close()
    assert [config for system, config in grid if system == bench_peer.PEER_GRAPHS] == list(bench_peer.PEER_GRAPH_CONFIGS)
    report = bench_peer._report(args, "0.18.0", prompts, workers, grid, runs)
    peer = [r["tokens"] for r in runs["onnxruntime-genai: target"]]
    assert all(len(tokens) > 1 for tokens in peer)
    for config in bench_peer.PEER_GRAPH_CONFIGS:
        name = f"{bench_peer.PEER_GRAPHS}: {config}"
        assert [r["tokens"] for r in runs[name]] == peer  # the peer's graphs, driven by specdeploy: its own output
        assert report["results"][name]["identical_to_peer"] == 2
    imported = Manifest.read(tmp_path / "cache" / "peer" / "imported-genai-llama+genai-llama-draft")
    assert imported.target.imported.source == imported.draft.imported.source == "onnxruntime-genai"
    text = bench_peer.markdown(report)
    assert f"| {bench_peer.PEER_GRAPHS} | plain |" in text and f"| {bench_peer.PEER_GRAPHS} | default" in text
