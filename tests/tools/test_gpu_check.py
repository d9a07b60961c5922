"""tools/gpu_check.py: its build mode exports the tiny artifacts (a Gemma 2, a Granite 4.0-H hybrid and a Qwen3-MoE
mixture among them) and
onnxruntime-genai's build of the tiny target, and its run mode, with the CPU standing in for CUDA, finds greedy
speculative decoding exact for every drafter on a ragged batch, a second turn reusing the first's K/V (a hybrid's
states resumed), exact mode exact, a verification rolled back to every length, the imported build driven alike, every
node placed, the cache (and recurrent states) where the session computes, the timings sane, the replayed pair's
speedups and the results files written; what its budget leaves out is skipped with the reason, and a part that fails
is named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the explicit form's tracing takes ~30 s a pair: left to the device run
BUILT = ["fused-fp16", "fused-int4", "gemma2-fused-fp16", "granite4h-fused-fp16", "qwen3moe-fused-fp16"]
QWEN2 = ["fused-fp16", "fused-int4"]
HYBRID = "granite4h-fused-fp16"  # its case list: the draft model and the suffix index at K 4
MIXTURE = "qwen3moe-fused-fp16"  # its case list too


def _cases(name: str) -> list[str]:
    """The speculative cases the check runs for artifact ``name`` (``ARTIFACTS``' case list)."""
    from tools.gpu_check import ARTIFACTS
    from tools.gpu_decoding import SPECULATIVE

    return list(ARTIFACTS[name].get("cases", SPECULATIVE))


def _tool(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("gpucheck") / "art"
    done = _tool("--build", str(directory), "--only", ",".join(BUILT))
    assert all(f"{name}: " in done.stdout for name in [*BUILT, "genai-fp16", "genai-fp32"])
    return directory


@pytest.fixture(scope="module")
def report(built, tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("out") / "gpu_check.json"
    results = tmp_path_factory.mktemp("results")
    done = _tool("--run", str(built), "--provider", "cpu", "--big", "test", "--peer", "test", "--replay-tokens", "16",
                 "--replay-ks", "4", "--out", str(out), "--results", str(results), "--commit", "0123456789abcdef")
    return json.loads(out.read_text()), done.stdout, results


def test_greedy_speculative_decoding_is_exact_and_accepts_drafts(report):
    artifacts = report[0]["artifacts"]
    assert sorted(artifacts) == sorted(BUILT)
    for name, record in artifacts.items():
        assert record["manifest"]["graph"] == "fused" and record["load"]["device"]["via"] == "Pipeline.load"
        assert "stage" not in record  # every part ran to its end
        assert set(record["seconds"]) == {"exactness", "prefix", "exact", "rollback", "placement", "cache", "latency"}
        cases = record["exactness"]
        assert set(cases) == {"plain cpu vs cpu (2nd pipeline)", "spec k4 cpu vs plain"} | {
            f"spec {case} cpu (2nd pipeline) vs plain" for case in _cases(name)}, name
        for case, result in cases.items():
            assert (result["equal"], result["of"], result["diverged"]) == (3, 3, []), (name, case, result)
            assert [len(t) for t in result["tokens"]] == [24, 24, 24]
        if name in (HYBRID, MIXTURE):
            continue  # its drafters: its own test
        for k in (2, 4):  # the perturbed draft is accepted in part: drafts kept, yet not all of them
            case = cases[f"spec k{k} cpu (2nd pipeline) vs plain"]
            assert case["mean_accepted_length"] > 1.2 and case["rejected_cycles"] > 0, (name, k, case)
        # the suffix index drafts from text alone; the default's drafter (hybrid) at a fixed K drafted too. Whether the
        # default itself drafts is its cost policy's call at the times it measured (on a busy 2-core host one slow
        # call can price drafting out of a 24-token run), so of it only its cycles are asserted, each counted once
        assert cases["spec suffix-k4 cpu (2nd pipeline) vs plain"]["cycles"]["text"] > 0
        assert cases["spec suffix-k4 cpu (2nd pipeline) vs plain"]["cycles"]["model"] == 0
        assert sum(cases["spec hybrid-k4 cpu (2nd pipeline) vs plain"]["cycles"][s] for s in ("text", "model")) > 0
        default = cases["spec default cpu (2nd pipeline) vs plain"]["cycles"]
        assert sum(default.values()) >= 3 * -(-24 // 9), default  # 3 rows of 24 tokens, at most K + 1 = 9 a cycle
        # the costs the default priced by were measured on the provider: every verified shape up to K + 1 at batch 1
        verify = {(b, t) for b, t, _ in record["costs"]["verify"]}
        assert {(1, t) for t in range(1, 10)} <= verify and all(v > 0 for *_, v in record["costs"]["verify"])
    assert "no failures" in report[1] and "== fused-int4" in report[1]


def test_a_second_turn_reuses_the_first_turns_kv_and_decodes_as_a_cold_one(report):
    for name, record in report[0]["artifacts"].items():
        prefix = record["prefix"]
        assert prefix["second_turn_prompt"] == prefix["first_turn_tokens"] + 5 and prefix["kept_bytes"] > 0
        assert prefix["kept_in"] == ["numpy.ndarray"]  # where the CPU's engines compute (on CUDA: cupy.ndarray)
        assert prefix["cold_bytes_moved"] == {"to_device": 0, "to_host": 0}
        for case in ("plain reused vs cold", "spec model-k4 reused vs cold"):
            result = prefix[case]
            assert (result["equal"], result["of"], result["diverged"]) == (1, 1, []), (name, case, result)
            # the first turn's prompt and answer at least (all but its last token, which the cycle starts from)
            assert result["cached_prompt_tokens"] >= prefix["first_turn_tokens"] - 1, (name, case)


def test_exact_mode_drafted_is_exact_mode_plain_for_every_drafter(report):
    for name, record in report[0]["artifacts"].items():
        cases = record["exact"]
        assert set(cases) == {"plain exact vs plain default"} | {f"spec {c} exact vs plain" for c in _cases(name)}, name
        for case, result in cases.items():
            assert (result["equal"], result["of"]) == (3, 3), (name, case, result)


def test_the_hybrid_decodes_exactly_resumes_its_states_and_rolls_back_to_every_length(built, report):
    """Granite 4.0-H's Mamba-2 states in rings the engine owns: speculative == plain for the draft model (every accepted
    length 0-4 reached) and the suffix index at K 4 on the ragged batch, a second turn resuming the first turn's states
    (plainly, then speculatively: the turn asked again), exact mode, the states after a prefill and a verification
    equal to the CPU's, every node placed with no copy inside a call, and T = 1, 5, 9 timed."""
    import onnx

    record = report[0]["artifacts"][HYBRID]
    assert record["manifest"]["dtype"] == "float16" and record["manifest"]["graph"] == "fused"
    assert _cases(HYBRID) == ["k4", "suffix-k4"]
    drafted = record["exactness"]["spec k4 cpu (2nd pipeline) vs plain"]
    assert (drafted["equal"], drafted["of"]) == (3, 3) and drafted["cycles"]["model"] > 0
    assert len(drafted["accepted_counts"]) == 5 and all(drafted["accepted_counts"]), drafted  # each a rollback length
    assert record["exactness"]["spec suffix-k4 cpu (2nd pipeline) vs plain"]["cycles"]["text"] > 0
    prefix = record["prefix"]
    for case in ("plain reused vs cold", "spec model-k4 reused vs cold"):
        assert prefix[case]["equal"] == 1 and prefix[case]["cached_prompt_tokens"] == prefix["first_turn_tokens"] - 1
    cache = record["cache"]
    assert set(cache["states_max_abs_diff"]) == {"conv", "ssm"} and not any(cache["states_max_abs_diff"].values())
    assert all(cache["states_max_abs"].values())
    ops = record["placement"]["ops_per_provider"]["CPUExecutionProvider"]
    assert ops["ScatterND"] == 2 and "GatherND" not in ops and record["placement"]["copies_inside"] == 0
    inputs = [i.name for i in onnx.load(str(built / HYBRID / "target.onnx"), load_external_data=False).graph.input]
    assert {"read_slots_conv", "write_slots_conv", "read_slots_ssm", "write_slots_ssm"} <= set(inputs)
    assert all(record["latency"]["engine"][f"T{t}"]["median_ms"] > 0 for t in (1, 5, 9))


def test_the_mixture_runs_its_experts_on_the_moe_op_and_decodes_exactly(built, report):
    """Qwen3-MoE's routed experts on ONNX Runtime's MoE op in the fused fp16 form: speculative == plain for the draft
    model (drafts verified, some kept: a verification routes each token apart) and the suffix index at K 4 on the ragged
    batch, a second turn reusing the first's K/V, exact mode, and the op placed with the rest."""
    import onnx

    record = report[0]["artifacts"][MIXTURE]
    assert record["manifest"]["dtype"] == "float16" and record["manifest"]["graph"] == "fused"
    assert _cases(MIXTURE) == ["k4", "suffix-k4"]
    ops = [n.op_type for n in onnx.load(str(built / MIXTURE / "target.onnx"), load_external_data=False).graph.node]
    assert ops.count("MoE") == 2  # one a layer, every layer sparse
    drafted = record["exactness"]["spec k4 cpu (2nd pipeline) vs plain"]
    assert (drafted["equal"], drafted["of"]) == (3, 3) and drafted["cycles"]["model"] > 0
    # drafts kept, yet not all of them (a mean below K + 1 says nothing: a 24-token run's last cycle drafts fewer)
    assert drafted["mean_accepted_length"] > 1.0 and drafted["rejected_cycles"] > 0, drafted
    assert record["exactness"]["spec suffix-k4 cpu (2nd pipeline) vs plain"]["cycles"]["text"] > 0
    assert record["prefix"]["plain reused vs cold"]["equal"] == 1
    assert record["placement"]["ops_per_provider"]["CPUExecutionProvider"]["MoE"] == 2


def test_a_verification_rolled_back_to_every_length_computes_what_a_fresh_prefill_does(report):
    """For every artifact: K = 4 drafts after the longest prompt, rolled back to each of the 5 lengths a cycle can
    leave, then one token: its logits a fresh prefill's (to rounding), far from the text one position shorter."""
    for name, record in report[0]["artifacts"].items():
        rolled = record["rollback"]
        assert [c["length"] for c in rolled["lengths"]] == [15, 16, 17, 18, 19], name
        for case in rolled["lengths"]:
            assert case["argmax"][0] == case["argmax"][1] and "margin" not in case, (name, case)
            assert case["max_abs_diff"] < 0.01 * case["max_abs"] < case["one_behind_diff"], (name, case)


def test_the_gemma2_artifact_soft_caps_attention_on_group_query_attention_and_windows_a_layer(built, report):
    import onnx

    graph = onnx.load(str(built / "gemma2-fused-fp16" / "target.onnx"), load_external_data=False).graph
    attention = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in graph.node
                 if n.op_type == "GroupQueryAttention"]
    assert [a["softcap"] for a in attention] == [20.0, 20.0]
    assert [a.get("local_window_size", -1) for a in attention] == [8, -1]  # shorter than every text the check runs
    record = report[0]["artifacts"]["gemma2-fused-fp16"]
    assert record["manifest"]["dtype"] == "float16" and record["manifest"]["graph"] == "fused"
    assert record["placement"]["ops_per_provider"]["CPUExecutionProvider"]["GroupQueryAttention"] == 2


def test_the_imported_genai_fp16_build_decodes_exactly_reuses_kv_and_is_timed(report):
    """The builder's fp16 CUDA build, as the device runs it (the CPU EP runs its graph too), its logits cast to
    float32 by the import; its plain output against the fp32 build's may part at a near-tie only."""
    from tools.gpu_decoding import NEAR_TIE

    imported = report[0]["imported"]
    assert imported["folder"] == "genai-fp16" and imported["manifest"]["source"] == "onnxruntime-genai"
    assert imported["manifest"]["cache"] == "shared" and imported["manifest"]["dtype"] == "float16"
    assert any(r.startswith("logits cast from float16") for r in imported["manifest"]["rewrites"])
    assert "stage" not in imported
    # no draft model: the suffix index, the hybrid drafter (the index alone) and the default; and the fp32 build's
    # plain output on the CPU
    assert set(imported["exactness"]) == {"spec suffix-k4 cpu vs plain", "spec hybrid-k4 cpu vs plain",
                                          "spec default cpu vs plain", "plain cpu fp32 vs cpu fp16"}
    against_fp32 = imported["exactness"].pop("plain cpu fp32 vs cpu fp16")
    assert against_fp32["equal"] >= 1 and all(abs(d["margin"]) <= NEAR_TIE for d in against_fp32["diverged"])
    for section in ("exactness", "exact"):
        for case, result in imported[section].items():
            assert (result["equal"], result["of"]) == (3, 3), (section, case, result)
    reused = imported["prefix"]["spec suffix-k4 reused vs cold"]
    assert reused["equal"] == 1 and reused["cached_prompt_tokens"] >= imported["prefix"]["first_turn_tokens"] - 1
    assert 0 < imported["latency"]["engine"]["T5"]["median_ms"] < float("inf")


def test_every_node_is_placed_and_the_cache_is_a_host_array(report):
    for name, record in report[0]["artifacts"].items():
        if name not in QWEN2:
            continue
        placement = record["placement"]
        assert placement["session_providers"] == ["CPUExecutionProvider"]
        assert list(placement["nodes_per_provider"]) == ["CPUExecutionProvider"]
        ops = placement["ops_per_provider"]["CPUExecutionProvider"]
        assert ops["GroupQueryAttention"] == 2 and ops["SkipSimplifiedLayerNormalization"] == 4
        assert ops["MatMulNBits" if "int4" in name else "MatMul"] == 9  # per layer qkv, o, gate_up, down; the head
        assert ops["ArgMax"] == 1  # greedy acceptance's ids, from the graph
        cache = record["cache"]
        assert cache["buffer"] == "numpy.ndarray" and cache["on_host"] and cache["memory"] == "cpu"
        # the same provider: the same arithmetic, written in place at past_len .., nothing beyond touched
        assert cache["logits_max_abs_diff"] == 0 and cache["cache_max_abs_diff"] == 0 and cache["logits_max_abs"] > 1
        assert cache["new_slots_written"] and cache["beyond_valid_nonzero"] == 0


def test_latencies_are_measured_at_each_token_count(report):
    engines = [(name, record["latency"]["engine"]) for name, record in report[0]["artifacts"].items()]
    big = report[0]["big"]["test"]
    engines.append(("big", big["plain"]["latency"]))
    for name, latency in engines:
        for tokens in ("T1", "T5", "T9"):
            timing = latency[tokens]
            assert 0 < timing["engine_seconds_median_ms"] <= timing["median_ms"] <= timing["p90_ms"] < float("inf"), name
            assert timing["to_device_bytes"] == timing["to_host_bytes"] == 0  # the CPU moves nothing across
    assert big["shape"]["layers"] == 2 and big["bytes"] > 0 and big["logits_max_abs"] > 0
    assert "cuda graphs" not in big and not big["plain"]["captures"]  # CUDA graphs need CUDA


def test_the_real_pairs_traces_are_replayed_at_the_measured_costs(report):
    pair = report[0]["pairs"]["test+test"]
    costs = pair["costs"]
    assert set(costs) == {"pasts", "target", "draft", "change"}  # what a change of shape costs each model, too
    assert set(costs["change"]) == {"target", "draft"} and min(costs["change"].values()) >= 0
    assert all(len(seconds) == len(costs["pasts"]) for seconds in costs["target"]["full"].values())
    replayed = pair["replay"]
    assert set(replayed["tokens_per_s"]) == {"plain", "k=4", "cost", "lookup, cost", "suffix, cost", "hybrid, cost"}
    assert all(rate > 0 for rate in replayed["tokens_per_s"].values())
    assert replayed["speedup_over_plain"]["k=4"] == pytest.approx(
        replayed["tokens_per_s"]["k=4"] / replayed["tokens_per_s"]["plain"], rel=1e-2)
    assert pair["cycle_bytes"] == {"k": 4, "to_device": 0, "to_host": 0}


def test_the_peer_is_built_and_timed_and_the_results_name_the_machine_and_commit(report):
    """make test installs onnxruntime-genai (the import tests build folders with its builder), so the peer's graph of
    the test shape is built here and timed as the device run times it."""
    peer = report[0]["peer"]["test"]
    assert "error" not in peer and "skipped" not in peer, peer
    assert peer["build_s"] > 0 and peer["plain"], peer
    results = report[2]
    assert sorted(p.name for p in results.iterdir()) == ["no-gpu-0123456789ab.json", "no-gpu-0123456789ab.md"]
    summary = (results / "no-gpu-0123456789ab.md").read_text()
    assert summary.startswith("# GPU check: no GPU, driver -, commit 0123456789abcdef")
    assert "| ours test | plain |" in summary and "test+test" in summary
    assert "| fused-fp16 | prefix | spec model-k4 reused vs cold | 1/1 |" in summary
    assert "| imported genai | exact | spec default exact vs plain | 3/3 |" in summary


def test_without_the_peers_wheel_the_peer_is_skipped_with_what_to_carry(tmp_path, monkeypatch):
    import importlib.util

    from tools import gpu_timing

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime_genai" else real(name, *a))
    record = gpu_timing.check_peer("test", "cpu", tmp_path)
    assert "onnxruntime-genai-cuda==0.18.0" in record["skipped"] and not list(tmp_path.iterdir())


def test_environment_is_recorded(report):
    env = report[0]["environment"]
    assert "CPUExecutionProvider" in env["available_providers"] and env["probe_session_providers"] == ["CPUExecutionProvider"]
    assert env["onnx_ir_version"] >= 10 and env["modules"]["tokenizers"] and "preload_dlls" not in env


def test_the_pipeline_from_engines_decodes_what_pipeline_load_does(built, report, tmp_path):
    """Without ``tokenizers`` the pipeline is built from its engines (target and draft in their roles)."""
    out = tmp_path / "engines.json"
    _tool("--run", str(built), "--provider", "cpu", "--only", "fused-fp16", "--loader", "engines", "--out", str(out))
    record = json.loads(out.read_text())["artifacts"]["fused-fp16"]
    assert record["load"]["device"]["via"] == "Pipeline(engines), token ids"
    loaded = report[0]["artifacts"]["fused-fp16"]["exactness"]
    for case, result in record["exactness"].items():
        assert result["tokens"] == loaded[case]["tokens"]
        if "default" not in case:  # the default's cost policy drafts by the times it measured, which differ run to run
            assert result.get("mean_accepted_length") == loaded[case].get("mean_accepted_length"), case


def test_a_graph_onnxruntime_refuses_for_its_ir_version_runs_from_a_lowered_copy(built, tmp_path):
    import onnx

    from specdeploy.contract import Manifest, sha256_file

    directory = tmp_path / "art"
    shutil.copytree(built / "fused-int4", directory / "fused-int4")
    manifest = Manifest.read(directory / "fused-int4")
    for spec in manifest.models.values():
        path = directory / "fused-int4" / spec.file
        model = onnx.load(str(path))
        model.ir_version = 99
        onnx.save_model(model, str(path))
        manifest.files[spec.file] = sha256_file(path)
    manifest.write(directory / "fused-int4")
    out = tmp_path / "ir.json"
    done = _tool("--run", str(directory), "--provider", "cpu", "--out", str(out))
    record = json.loads(out.read_text())["artifacts"]["fused-int4"]
    assert "99" in record["ir_lowered"] and "IR lowered" in done.stdout
    assert all(r["equal"] == r["of"] == 3 for r in record["exactness"].values())
    assert onnx.load(str(directory / "fused-int4" / "target.onnx")).ir_version == 99  # the artifact itself untouched


def test_a_spent_budget_skips_every_part_with_the_reason_and_still_writes_the_report(built, tmp_path, monkeypatch):
    from tools import gpu_check

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "skipped.json"
    code = gpu_check.main(["--run", str(built), "--provider", "cpu", "--big", "test", "--peer", "test", "--budget", "0",
                           "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["imported"] == {"skipped": "budget of 0 s spent"}
    assert all(r == {"skipped": "budget of 0 s spent"} for r in report["artifacts"].values())
    assert len(report["artifacts"]) == len(BUILT)
    assert report["big"]["test"] == report["peer"]["test"] == {"skipped": "budget spent: 0 s left, test needs 0 s"}
    # a budget that has some seconds left, fewer than an artifact needs: not begun, with the seconds left and needed
    code = gpu_check.main(["--run", str(built), "--provider", "cpu", "--only", HYBRID, "--budget", "5", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["artifacts"][HYBRID]["skipped"].endswith(f"s left, {HYBRID} needs {gpu_check.NEEDS['artifact']} s")
    assert report["imported"]["skipped"].endswith(f"s left, the import needs {gpu_check.NEEDS['imported']} s")


def test_only_none_runs_neither_the_artifacts_nor_the_import(built, tmp_path, monkeypatch):
    """A rerun of the big shapes and the peer (what a first run's budget skipped) checks nothing else."""
    from tools import gpu_check

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "rerun.json"
    assert gpu_check.main(["--run", str(built), "--provider", "cpu", "--only", "none", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["artifacts"] == {} and report["imported"] == {"skipped": "--only none"}


def test_a_big_shape_is_not_begun_with_less_of_the_budget_left_than_it_needs(tmp_path, monkeypatch):
    """A shape begun near the budget's end would outrun the command's limit: it is skipped with the seconds left and
    needed, and the report and its summary (rewritten after each part) still name the machine and commit."""
    from tools import gpu_check

    report = {"environment": {"gpu": "", "onnxruntime": "1", "available_providers": ["CPUExecutionProvider"],
                              "numpy": "2"}, "artifacts": {}, "imported": {}, "big": {}, "pairs": {}, "peer": {}}
    saved = []
    gpu_check.check_big_shapes(report, "cpu", {"big": ["1.5b"], "peer": ["0.5b"]}, tmp_path, lambda: 45.0,
                               lambda: saved.append(True))
    assert report["big"]["1.5b"] == {"skipped": "budget spent: 45 s left, 1.5b needs 60 s"}
    assert report["peer"]["0.5b"] == {"skipped": "budget spent: 45 s left, 0.5b needs 60 s"}
    gpu_check._write(tmp_path / "out.json", report, 0.0, tmp_path / "results", "0123456789abcdef")
    assert json.loads((tmp_path / "out.json").read_text())["big"] == report["big"]
    assert (tmp_path / "results" / "no-gpu-0123456789ab.md").is_file()


def test_a_case_that_parts_where_it_must_not_is_named_as_a_failure():
    """Speculative against plain, exact mode, a reuse that reused nothing or parted beyond a near-tie: failures; plain
    across providers parting at any margin: reported, not a failure."""
    from tools.gpu_check import _failures
    from tools.gpu_decoding import NEAR_TIE

    def case(equal, margin=None, **extra):
        return {"equal": equal, "of": 3, "diverged": [] if margin is None else [{"prompt": 0, "margin": margin}], **extra}

    record = {"exactness": {"plain cpu vs cuda": case(2, 5.0), "spec k4 cuda vs plain": case(3)},
              "prefix": {"plain reused vs cold": case(2, NEAR_TIE / 2, cached_prompt_tokens=37)},
              "exact": {"spec k2 exact vs plain": case(3)}, "latency": {"engine": {"T1": {}}}}
    assert _failures(record) == []
    record["exact"]["spec default exact vs plain"] = case(2, 0.0)
    record["prefix"]["spec model-k4 reused vs cold"] = case(3, cached_prompt_tokens=0)
    record["prefix"]["plain reused vs cold"]["diverged"][0]["margin"] = 2 * NEAR_TIE
    record["placement"] = {"error": "RuntimeError: no CUDA"}
    assert sorted(_failures(record)) == ["exact: spec default exact vs plain", "placement",
                                         "prefix: plain reused vs cold", "prefix: spec model-k4 reused vs cold"]
    # a rollback whose argmax parts beyond a near-tie, or whose logits lie as near the text a position shorter; a copy
    # inside a call of a fused fp16 graph on CUDA (allowed elsewhere)
    length = {"length": 15, "max_abs_diff": 0.01, "max_abs": 8.0, "one_behind_diff": 3.0, "argmax": [4, 4]}
    record = {"rollback": {"lengths": [length, length | {"length": 16, "argmax": [4, 5], "margin": 2 * NEAR_TIE},
                                       length | {"length": 17, "max_abs_diff": 1.6}]},
              "placement": {"copies_inside": 2, "copies_allowed": False}}
    assert _failures(record) == ["rollback: length 16", "rollback: length 17", "placement: 2 copies inside a call"]
    record["placement"]["copies_allowed"] = True
    assert _failures(record) == ["rollback: length 16", "rollback: length 17"]
