"""ONNX Runtime's OpenVINO execution provider: choosing it, refusing what it cannot run whole, and speculation on it.

The provider ships in ``onnxruntime-openvino``, which replaces ``onnxruntime``: the runs on it happen in a venv of
their own (build/openvino-venv, which `make test` makes), through ``openvino_peer.py``; this process exports the tiny
artifacts and asserts on what the peer saw. The rest (options, refusals before any session) runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from scipy.stats import chi2_contingency

from specdeploy.cli import main as cli
from specdeploy.contract import Manifest
from specdeploy.engines import OrtEngine, Provider, ProviderError
from specdeploy.engines.providers import check_graph
from specdeploy.runtime.calibration import machine_key
from tests import tiny

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).parent / "openvino_peer.py"
OPENVINO_PYTHON = Path(os.environ.get("SPECDEPLOY_OPENVINO_PYTHON", ROOT / "build" / "openvino-venv" / "bin" / "python"))
PROMPTS = [[5, 17, 33, 9, 40, 41, 12, 88, 7, 3, 60, 61], [7, 8], [100, 3, 4, 5, 6, 7, 8, 22, 1], [50] * 20,
           [5, 17, 33, 9, 40, 41, 12], [7, 8, 9, 10, 11]]
TOKENS = 24
SAMPLED_ROWS = 1500


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """A tiny int4 pair (weights as a trained model's, so int4 rounding does not blow up) as ``export --provider
    openvino`` writes it; the same pair with its draft written for the CPU provider in the fused form (``--draft-provider
    cpu --graph fused``); and the target in the plain explicit form. Accuracy level 0 (fp32 compute): ONNX Runtime's CPU
    kernel then runs a one-row call apart from several rows (docs/results/exactness/), the control. One trace a model:
    OpenVINO's form is the explicit trace rewritten (tests/traces.py), the fused draft is written, not traced."""
    root = tmp_path_factory.mktemp("openvino")
    config = tiny.llama_config(head_dim=16, hidden_size=64, intermediate_size=128)  # head_dim 16: the fused form's least
    target = tiny.build_model(config, seed=0, conditioned=True)
    draft = tiny.build_model(config, seed=1, perturb_from=target, noise=0.05)
    saved = tiny.save_checkpoint(target, root / "t"), tiny.save_checkpoint(draft, root / "d")
    common = ["--weights", "int4", "--accuracy-level", "0", "--capacity", "128"]
    return {"openvino": tiny.export_cli(root / "openvino", *saved, *common, "--provider", "openvino"),
            "mixed": tiny.export_cli(root / "mixed", *saved, *common, "--provider", "openvino", "--draft-provider", "cpu",
                                     "--graph", "fused"),
            "explicit": tiny.export_cli(root / "explicit", saved[0], None, *common, "--graph", "explicit")}


@pytest.fixture(scope="module")
def seen(artifacts, tmp_path_factory):
    """What the peer saw on the OpenVINO provider (``openvino_peer.main``), running this checkout's code whichever
    checkout made the venv."""
    if not OPENVINO_PYTHON.is_file():
        pytest.fail(f"{OPENVINO_PYTHON}: no OpenVINO venv; `make openvino-venv` makes it (or set "
                    "SPECDEPLOY_OPENVINO_PYTHON)")
    root = tmp_path_factory.mktemp("openvino-peer")
    job = {name: str(directory) for name, directory in artifacts.items()} | {"prompts": PROMPTS,
           "tokens": TOKENS, "sampled_rows": SAMPLED_ROWS, "cache": str(root / "cache")}
    (root / "job.json").write_text(json.dumps(job))
    done = subprocess.run([str(OPENVINO_PYTHON), str(PEER), str(root / "job.json"), str(root / "out.json")],
                          capture_output=True, text=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "out.json").read_text())


# --- on the provider (the peer's runs) -------------------------------------------------------------------------------

def test_greedy_speculation_is_plain_decoding_bit_for_bit_on_openvino(seen):
    """Every drafter, k and batch size, in the default mode: the same tokens as plain greedy decoding, chosen from the
    same logits to the bit (OpenVINO's CPU kernels compute a position alike whatever the call's size, so nothing needs
    padding: exact mode runs the target as it is), and drafts were verified."""
    greedy = seen["greedy"]
    assert greedy["providers"] == {"target": "openvino/CPU/FP32", "draft": "openvino/CPU/FP32"} and greedy["rows_alike"]
    _assert_plain_bit_for_bit(greedy["runs"])


@pytest.mark.parametrize("pairing", ["greedy_draft_on_cpu", "greedy_mixed"])
def test_with_the_draft_on_the_cpu_provider_greedy_speculation_is_still_plain_decoding_bit_for_bit(seen, pairing):
    """The target on OpenVINO, its draft on ONNX Runtime's CPU provider (the pair's draft in OpenVINO's form, or written
    fused for the CPU provider): the draft's other kernels change which drafts are proposed, never what the target
    emits, and its rows are computed alike, so speculative output is its plain decoding's to the bit."""
    greedy = seen[pairing]
    assert greedy["providers"] == {"target": "openvino/CPU/FP32", "draft": "cpu"} and greedy["rows_alike"]
    _assert_plain_bit_for_bit(greedy["runs"])
    # the same target, whichever draft sits beside it: the same plain decoding as the pair on OpenVINO alone
    assert greedy["runs"]["plain"] == seen["greedy"]["runs"]["plain"]


def _assert_plain_bit_for_bit(runs: dict) -> None:
    runs = dict(runs)
    plain = runs.pop("plain")
    for name, run in runs.items():
        for i, (row, alone) in enumerate(zip(run, plain)):
            assert row["tokens"] == alone["tokens"], f"{name}, prompt {i}"
            assert row["logits"] == alone["logits"], f"{name}, prompt {i}: the logits differ"
        assert name == "exact plain" or sum(row["drafted"] for row in run) > 0, f"{name}: nothing was drafted"


def test_on_the_cpu_provider_the_same_graph_computes_rows_apart(seen):
    """The control: ONNX Runtime's CPU int4 kernels give a verification's rows other bits than one-token calls (which
    is why exact mode pads there), so the test above holds OpenVINO to something the CPU provider does not give."""
    runs = dict(seen["greedy_cpu"]["runs"])
    plain = runs.pop("plain")
    assert not seen["greedy_cpu"]["rows_alike"]
    assert any(row["logits"] != alone["logits"] for run in runs.values() for row, alone in zip(run, plain))


def test_sampling_on_openvino_follows_the_targets_distribution(seen):
    """The first two tokens of 1,500 rows sampled speculatively and plainly come from one joint distribution."""
    sampled = seen["sampled"]
    assert sampled["speculative drafted"] > 0
    pairs = sorted({tuple(p) for p in sampled["plain"] + sampled["speculative"]})
    table = np.array([[sum(tuple(p) == pair for p in sampled[name]) for pair in pairs]
                      for name in ("plain", "speculative")])
    table = table[:, table.sum(0) >= 5]
    assert table.shape[1] >= 4  # a test of something: several outcomes seen often enough
    assert chi2_contingency(table).pvalue >= 1e-3


def test_the_cost_table_is_measured_and_kept_per_provider(seen):
    """The policy prices calls measured on OpenVINO, and a process keeps them under the provider with its options."""
    table = seen["greedy"]["costs"]
    assert {t for _, t, _ in table["verify"]} >= {1, 5}
    assert all(seconds > 0 for _, _, seconds in table["verify"] + table["draft"])
    kept = seen["remembered"]
    keys = kept["keys"]
    assert keys["openvino"] == keys["openvino object"]  # the word and the Provider with its defaults are one provider
    assert keys["openvino"] == keys["openvino, draft on openvino"]  # a draft on the target's provider: the pair's key
    assert len({keys["openvino"], keys["cpu"], keys["openvino bf16"]}) == 3
    assert kept["recalled"]["verify"]


def test_each_models_calls_are_priced_as_its_own_provider_ran_them(seen):
    """The target on OpenVINO, the draft on the CPU provider: each entry of the cost table warm_up left is the quicker of
    the two calls of that shape that model's engine timed on its own provider, what a change of shape costs each model
    is read from the rounds of calls after them (``calibration.change_seconds``) on its own provider, and the table is
    kept under a key that names both providers."""
    from specdeploy.runtime.calibration import CHANGE_ROUNDS, NOTICEABLE

    priced = seen["priced"]
    measured = {}
    for call in priced["calls"]:
        assert call["provider"] == {"target": "openvino/CPU/FP32", "draft": "cpu"}[call["role"]]
        measured.setdefault((call["role"], call["tokens"]), []).append(call["seconds"])
    table = {("target", t): seconds for _, t, seconds in priced["costs"]["verify"]}
    table |= {("draft", t): seconds for _, t, seconds in priced["costs"]["draft"]}
    assert set(table) == set(measured) >= {("target", 1), ("target", 5), ("draft", 1), ("draft", 2)}
    rounds = {1: 2 * CHANGE_ROUNDS, 2: CHANGE_ROUNDS}  # the change's rounds: a two-token call, then two one-token calls
    assert all(len(times) == 2 + rounds.get(shape[1], 0) and table[shape] == min(times[:2])
               for shape, times in measured.items())
    for role, name in (("target", "verify"), ("draft", "draft")):
        ones = measured[role, 1][2:]
        changed, kept = min(ones[0::2]), min(ones[1::2])
        assert priced["costs"]["change"][name] == (changed - kept if changed - kept >= NOTICEABLE * kept else 0.0)
    keys, files = seen["remembered"]["keys"], seen["remembered"]["files"]
    assert keys["mixed, draft on cpu"] != keys["mixed, one provider"]
    assert files == sorted([f"{keys['openvino']}.json", f"{keys['mixed, draft on cpu']}.json"])
    # the answers' lengths a catch-up is repaid over are kept in the same record, under the pair's key: the mixed
    # pipeline's answers (warm-up's are not answers), the last of them the 8-token request it finished
    answers = seen["remembered"]["mixed answers"]
    assert answers and answers[-1][0] == 8


def test_a_graph_it_would_run_in_pieces_is_refused_in_one_line(seen):
    said = seen["refusals"]
    assert "the draft model is a fused graph, which OpenVINO runs only in pieces" in said["fused"]
    assert "specdeploy export --provider openvino" in said["fused"] and "--draft-provider cpu" in said["fused"]
    assert "would run only in pieces on openvino" in said["in_pieces"]
    assert "GroupQueryAttention x2" in said["in_pieces"] and "\n" not in said["in_pieces"]


def test_the_explicit_forms_run_whole(seen):
    """The plain explicit form, and the form written for OpenVINO (its Slices of the filled slots, its trimmed head)."""
    for placed in [seen["refusals"]["placement"], *seen["placement"].values()]:
        assert list(placed) == ["OpenVINOExecutionProvider"] and sum(placed["OpenVINOExecutionProvider"].values()) > 0
    assert seen["placement"]["target"]["OpenVINOExecutionProvider"]["Slice"] >= 4  # the form's, one a cache input


# --- here: options and refusals before any session ----------------------------------------------------------------

def test_openvinos_options_belong_to_it():
    assert Provider("openvino").key == "openvino/CPU/FP32"
    assert Provider("openvino", "GPU", "FP16").key == "openvino/GPU/FP16" and Provider("cpu").key == "cpu"
    with pytest.raises(ProviderError, match="provider 'cpu': device 'GPU' is an option of provider 'openvino' only"):
        Provider("cpu", device="GPU")
    with pytest.raises(ProviderError, match="precision 'INT3' is unknown; expected one of FP32, BF16, FP16, ACCURACY"):
        Provider("openvino", precision="INT3")
    with pytest.raises(ProviderError, match="provider 'vulkan' is unknown"):
        Provider.of("vulkan")
    options = Provider("openvino", precision="BF16").ep_options(2, Path("/c"))
    assert json.loads(options["load_config"]) == {"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}}
    assert options["num_of_threads"] == "2" and options["cache_dir"] == "/c" and "precision" not in options


def test_a_missing_openvino_says_how_to_install_it(artifacts, monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    spec = Manifest.read(artifacts["explicit"]).target
    with pytest.raises(ProviderError, match=r"'openvino' \(OpenVINOExecutionProvider\) is not available .* pip "
                                            r"uninstall -y onnxruntime && pip install 'onnxruntime-openvino"):
        OrtEngine(artifacts["explicit"] / spec.file, spec, provider="openvino")


def test_the_fused_form_is_refused_before_a_session_is_made(artifacts):
    spec = Manifest.read(artifacts["mixed"]).draft
    with pytest.raises(ProviderError, match="re-export it with `specdeploy export --provider openvino`, or run the "
                                            "draft with --draft-provider cpu"):
        check_graph(artifacts["mixed"] / spec.file, spec, Provider("openvino"))
    check_graph(artifacts["mixed"] / spec.file, spec, Provider("cpu"))  # the CPU provider runs it whole


def test_export_writes_each_model_for_its_own_provider(artifacts):
    """--provider openvino --draft-provider cpu --graph fused: OpenVINO's form for the target, the fused form for the
    draft; --provider openvino alone: OpenVINO's form for both."""
    mixed, openvino = Manifest.read(artifacts["mixed"]), Manifest.read(artifacts["openvino"])
    assert (mixed.target.graph, mixed.target.filled_slots, mixed.target.trims_logits) == ("explicit", 64, True)
    assert (mixed.draft.graph, mixed.draft.filled_slots, mixed.draft.takes_seqlens_k) == ("fused", 0, True)
    assert [(spec.graph, spec.filled_slots) for spec in openvino.models.values()] == [("explicit", 64)] * 2


def test_the_cost_key_names_each_models_provider_and_its_options(artifacts):
    directory = artifacts["openvino"]
    keys = {machine_key(directory, *providers) for providers in
            (("cpu", 2), ("openvino", 2), (Provider("openvino", precision="BF16"), 2), (Provider("openvino", device="GPU"), 2),
             ("openvino", 2, "cpu"), ("cpu", 2, "openvino"), ("openvino", 2, Provider("openvino", precision="BF16")))}
    assert len(keys) == 7
    assert machine_key(directory, "openvino", 2) == machine_key(directory, Provider("openvino"), 2)
    assert machine_key(directory, "openvino", 2) == machine_key(directory, "openvino", 2, Provider("openvino"))


def test_the_draft_provider_reaches_the_draft(artifacts, monkeypatch):
    """generate --draft-provider openvino loads the draft on OpenVINO (missing here: refused in one line), the target
    on --provider's; without a draft model in the artifact there is nothing to place, and nothing is refused."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    args = ["--prompt", "w5", "--max-new-tokens", "2", "--draft-provider", "openvino"]
    result = CliRunner().invoke(cli, ["generate", str(artifacts["openvino"]), "--provider", "cpu", *args])
    assert result.exit_code == 1
    assert "provider 'openvino' (OpenVINOExecutionProvider) is not available" in result.output
    assert "\n" not in result.output.strip().removeprefix("Error: ")
    result = CliRunner().invoke(cli, ["generate", str(artifacts["explicit"]), "--provider", "cpu", *args, "--json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["generate", "doctor", "bench"])
def test_openvinos_options_without_it_are_refused(artifacts, command):
    extra = {"generate": ["--prompt", "w5"], "doctor": [], "bench": ["--out", "unused"]}[command]
    result = CliRunner().invoke(cli, [command, str(artifacts["explicit"]), "--device", "GPU", *extra])
    assert result.exit_code == 2
    assert "device 'GPU' is an option of provider 'openvino' only" in result.output


def test_doctor_on_openvino_names_what_to_do(artifacts, monkeypatch):
    """Here OpenVINO is missing: doctor says so as a problem with its fix, exit 1."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    result = CliRunner().invoke(cli, ["doctor", str(artifacts["explicit"]), "--provider", "openvino"])
    assert result.exit_code == 1
    assert "is not available in this onnxruntime build" in result.output
    assert "fix: OpenVINO needs onnxruntime-openvino in place of onnxruntime" in result.output


def test_the_form_for_openvino_computes_what_the_explicit_form_does(artifacts):
    """On the CPU provider, a ragged batch over caches with stale slots past each row's length: the same logits and new
    K/V as the plain explicit form (reading the filled slots alone leaves out only slots no query sees), and the last
    position's logits alone where only they are asked for."""
    engines = {}
    for name in ("explicit", "openvino"):
        spec = Manifest.read(artifacts[name]).target
        engines[name] = OrtEngine(artifacts[name] / spec.file, spec)
    assert engines["openvino"].spec.filled_slots == 64 and engines["openvino"].spec.trims_logits
    rng = np.random.default_rng(0)
    ids, past = rng.integers(0, tiny.VOCAB, (2, 3)), np.array([70, 9], np.int64)  # 70 + 3 slots: past one bucket
    out = {}
    for name, engine in engines.items():
        cache = engine.allocate_cache(2, 128)
        cache.stacked[...] = np.random.default_rng(1).standard_normal(cache.stacked.shape)  # stale slots everywhere
        result = engine.infer(ids, past, cache)
        out[name] = (result.logits.copy(), result.new_kv.copy(), engine.infer(ids, past, cache, last=1).logits.copy())
    (logits, new_kv, _), (filled_logits, filled_kv, last) = out["explicit"], out["openvino"]
    np.testing.assert_allclose(filled_logits, logits, atol=1e-4 * np.abs(logits).max())
    np.testing.assert_allclose(filled_kv, new_kv, atol=1e-5)
    assert last.shape == (2, 1, tiny.VOCAB) and np.array_equal(last[:, 0], filled_logits[:, -1])


def test_export_for_openvino_refuses_the_fused_form(tmp_path):
    result = CliRunner().invoke(cli, ["export", "--target", str(tmp_path), "--out", str(tmp_path / "a"), "--graph", "fused",
                                      "--provider", "openvino"])
    assert result.exit_code == 1
    assert "graph: got 'fused' with provider 'openvino'; expected 'explicit'" in result.output
