"""CLI: export, inspect and doctor, with their errors (click's CliRunner)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from tests import tiny


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def ckpt(checkpoints):
    return checkpoints["target"]


def _copy(src, dst, drop=()):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    return dst


def test_export_writes_manifest_with_every_field(pair_dir):
    manifest = tiny.read_json(pair_dir / "manifest.json")
    assert manifest["contract"] == "verify-v1" and manifest["exporter_version"]
    assert set(manifest["files"]) == {"target.onnx", "draft.onnx", "tokenizer.json"}
    for role in ("target", "draft"):
        spec = manifest["models"][role]
        assert spec["architecture"] == "llama" and spec["num_layers"] == 2 and spec["kv_heads"] == 2
        assert spec["head_dim"] == 8 and spec["vocab_size"] == 128 and spec["capacity"] == 96
        assert spec["dtype"] == "float32" and spec["weights"] == "full" and len(spec["tokenizer_fingerprint"]) == 64
    assert not [p for p in pair_dir.parent.iterdir() if p.name.startswith(".")]  # no staging dir left


def test_missing_config_json(ckpt, tmp_path):
    src = _copy(ckpt, tmp_path / "src", drop=("config.json",))
    result = run("export", "--target", src, "--out", tmp_path / "out")
    assert result.exit_code != 0 and "missing config.json" in result.output
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import OPTConfig

    config = OPTConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                       word_embed_proj_dim=16)
    src = tiny.save_checkpoint(tiny.build_model(config), tmp_path / "opt")
    result = run("export", "--target", src, "--out", tmp_path / "out")
    assert result.exit_code != 0
    from specdeploy.exporter import ARCHITECTURES

    # every registered family is named, in order, and the ones this test knows of are among them
    assert f"model_type 'opt' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}" in result.output
    assert {"gemma2", "gemma3", "gemma3_text", "gpt2", "granite", "granitemoehybrid", "lfm2", "llama", "mistral", "olmo2",
            "phi3", "qwen2", "qwen3", "smollm3"} <= set(ARCHITECTURES)


def test_corrupt_safetensors(ckpt, tmp_path):
    src = _copy(ckpt, tmp_path / "src")
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run("export", "--target", src, "--out", tmp_path / "out")
    assert result.exit_code != 0 and "corrupt or unreadable safetensors" in result.output


def test_bin_only_checkpoint_is_refused_without_unpickling(ckpt, tmp_path):
    src = _copy(ckpt, tmp_path / "src", drop=("*.safetensors",))
    marker = tmp_path / "unpickled"
    # a pickle that would create a file if anything loaded it
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    (src / "pytorch_model.bin").write_bytes(payload)
    result = run("export", "--target", src, "--out", tmp_path / "out")
    assert result.exit_code != 0
    assert "only pickled weights (pytorch_model.bin); refusing to unpickle" in result.output
    assert not marker.exists()


def test_tokenizer_mismatch_reports_differences(checkpoints, tmp_path):
    other = _copy(checkpoints["close"], tmp_path / "other")
    tiny.make_tokenizer(words=110, shift=3).save(str(other / "tokenizer.json"))
    result = run("export", "--target", checkpoints["target"], "--draft", other, "--out", tmp_path / "out")
    assert result.exit_code != 0
    assert "draft's tokenizer differs" in result.output
    assert "vocab sizes differ: target 120, draft 110" in result.output
    assert "first: 4: 'w4' vs 'w7'" in result.output


def test_existing_output_dir_needs_force(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run("export", "--target", ckpt, "--out", out)
    assert result.exit_code != 0 and "already exists; pass --force" in result.output
    assert (out / "keep.txt").read_text() == "mine"
    result = run("export", "--target", ckpt, "--out", out, "--force", "--capacity", "96")
    assert result.exit_code != 0 and "not an artifact directory (no manifest.json)" in result.output
    assert (out / "keep.txt").read_text() == "mine"  # --force replaces artifacts only, never a user's files
    artifact = tmp_path / "art"
    for weights in ("full", "int8"):  # at conftest's pairs' capacity: their trace (tests/traces.py)
        result = run("export", "--target", ckpt, "--out", artifact, "--force", "--capacity", "96", "--weights", weights)
        assert result.exit_code == 0, result.output
    assert tiny.read_json(artifact / "manifest.json")["models"]["target"]["weights"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "out"]  # no .art.old, no staging left


def test_failed_export_leaves_nothing_behind(ckpt, tmp_path):
    result = run("export", "--target", ckpt, "--out", tmp_path / "out", "--capacity", "100000")
    assert result.exit_code != 0 and "exceeds the model's max_position_embeddings 256" in result.output
    assert list(tmp_path.iterdir()) == []


def test_inspect_table_and_json(pair_dir):
    result = run("inspect", pair_dir)
    assert result.exit_code == 0
    for text in ("verify-v1", "target", "draft", "cache_key.{i}", "new_value.{i}", "tokenizer.json"):
        assert text in result.output
    data = json.loads(run("inspect", pair_dir, "--json").output)
    assert data["models"]["target"]["inputs"][:3] == ["input_ids", "past_len", "cache_key.0"]
    assert data["file_sizes"]["target.onnx"] == (pair_dir / "target.onnx").stat().st_size


def test_inspect_counts_nodes_per_layer_as_a_layer_more_adds_them(tmp_path):
    """The per-layer count is what one more layer adds to the graph, op counts add up to the nodes, and the
    table shows them."""
    summaries = {}
    for layers in (3, 4):
        model = tiny.build_model(tiny.llama_config(num_hidden_layers=layers), seed=0)
        art = tiny.export_cli(tmp_path / f"art{layers}", tiny.save_checkpoint(model, tmp_path / f"ckpt{layers}"))
        summaries[layers] = json.loads(run("inspect", art, "--json").output)["graphs"]["target"]
        assert summaries[layers]["layers_found"] == layers
        assert sum(summaries[layers]["ops"].values()) == summaries[layers]["nodes"]
    per_layer = summaries[4]["nodes_per_layer"]
    assert per_layer == summaries[3]["nodes_per_layer"] and per_layer > 10
    assert summaries[4]["nodes"] - summaries[3]["nodes"] == per_layer
    table = run("inspect", art).output
    assert f"│ {summaries[4]['nodes']} " in table and "MatMul" in table


def test_inspect_shows_the_fused_form_at_a_dozen_nodes_a_layer(exported_architecture):
    """The fused form's layers are a handful of ONNX Runtime's fused ops (issue #13: at most 15 nodes), against
    the explicit form's dozens, and inspect says which form each graph is (parity's two-layer Llama)."""
    summaries = {}
    for form in ("explicit", "fused"):
        model, art = exported_architecture("llama", form)
        data = json.loads(run("inspect", art, "--json").output)
        assert data["models"]["target"]["graph"] == form
        summaries[form] = data["graphs"]["target"]
        assert summaries[form]["layers_found"] == model.config.num_hidden_layers == 2
    fused, explicit = summaries["fused"], summaries["explicit"]
    assert fused["nodes_per_layer"] <= 15 < explicit["nodes_per_layer"]
    assert fused["ops"]["GroupQueryAttention"] == 2
    assert fused["ops"]["SkipSimplifiedLayerNormalization"] == 2 * 2  # every norm but the first, plus the final one
    assert data["models"]["target"]["outputs"][1:3] == ["present_key.0", "present_value.0"]
    table = run("inspect", art).output
    assert "present_key.{i}" in table and "fused" in table and "GroupQueryAttention" in table


def test_inspect_not_an_artifact(tmp_path):
    result = run("inspect", tmp_path)
    assert result.exit_code != 0 and "no manifest" in result.output


def test_doctor_ok_then_hash_mismatch(pair_dir, tmp_path):
    assert run("doctor", pair_dir).exit_code == 0
    broken = _copy(pair_dir, tmp_path / "broken")
    with open(broken / "tokenizer.json", "a") as handle:
        handle.write(" ")
    result = run("doctor", broken)
    assert result.exit_code == 1
    assert "tokenizer.json: sha256" in result.output and "fix:" in result.output


def test_doctor_bad_manifest(pair_dir, tmp_path):
    broken = _copy(pair_dir, tmp_path / "broken")
    manifest = tiny.read_json(broken / "manifest.json")
    manifest["contract"] = "verify-v9"
    (broken / "manifest.json").write_text(json.dumps(manifest))
    result = run("doctor", broken)
    assert result.exit_code == 1 and "contract 'verify-v9' is not supported" in result.output


@pytest.mark.parametrize("version, flagged", [("0.3.2", True), ("", True), ("0.3.3", False), ("0.10.0", False)])
def test_doctor_flags_int8_weights_written_at_full_range_by_older_exporters(pair_dir, tmp_path, version, flagged):
    """Exporters before 0.3.3 wrote int8 weights that ONNX Runtime's GEMM saturates on AVX2 without VNNI."""
    old = _copy(pair_dir, tmp_path / "old")
    manifest = tiny.read_json(old / "manifest.json")
    manifest["exporter_version"], manifest["models"]["target"]["weights"] = version, "int8"
    (old / "manifest.json").write_text(json.dumps(manifest))
    result = run("doctor", old)
    assert ("target: int8 weights at full range" in result.output) == flagged
    assert ("draft: int8" in result.output) is False  # the draft's weights are not int8
    if flagged:
        assert result.exit_code == 1 and "re-export with specdeploy 0.3.3 or later" in result.output


def test_loading_full_range_int8_weights_warns(pair_dir, tmp_path):
    from specdeploy.contract import Manifest
    from specdeploy.engines import load_engine

    old = _copy(pair_dir, tmp_path / "old")
    manifest = tiny.read_json(old / "manifest.json")
    manifest["exporter_version"], manifest["models"]["target"]["weights"] = "0.3.2", "int8"
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="target: int8 weights at full range .* re-export with specdeploy 0.3.3"):
        load_engine(old, Manifest.read(old), "target")


def test_doctor_checkpoint_pair(checkpoints, tmp_path):
    assert run("doctor", "--target", checkpoints["target"], "--draft", checkpoints["close"]).exit_code == 0
    other = _copy(checkpoints["close"], tmp_path / "other")
    tiny.make_tokenizer(words=110).save(str(other / "tokenizer.json"))
    result = run("doctor", "--target", checkpoints["target"], "--draft", other)
    assert result.exit_code == 1 and "vocab sizes differ" in result.output
    assert run("doctor").exit_code == 2  # neither a dir nor --target: a usage error


def test_abandoned_staging_of_a_killed_export_is_removed(ckpt, tmp_path):
    dead = tmp_path / ".out.abc123"
    dead.mkdir()
    (dead / ".pid").write_text("999999999")  # no such process
    (dead / "target.onnx.data").write_bytes(b"\0" * 1024)
    alive = tmp_path / ".out.def456"
    alive.mkdir()
    (alive / ".pid").write_text(str(__import__("os").getpid()))  # an export still running
    result = run("export", "--target", ckpt, "--out", tmp_path / "out", "--capacity", "64")
    assert result.exit_code == 0, result.output
    assert not dead.exists() and alive.exists()
    assert ".pid" not in tiny.read_json(tmp_path / "out" / "manifest.json")["files"]


def test_capacity_defaults_to_what_the_model_allows(checkpoints, tmp_path):
    """A model with max_position_embeddings below 2048 exports without --capacity, at its own limit;
    a pair at the smaller of its two limits."""
    from specdeploy.contract import Manifest

    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["export", "--target", str(checkpoints["target"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert Manifest.read(out).target.capacity == 256  # the tiny model's max_position_embeddings
    short = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(max_position_embeddings=128), seed=5), tmp_path / "d")
    pair = tmp_path / "pair"
    result = CliRunner().invoke(main, ["export", "--target", str(checkpoints["target"]), "--draft", str(short),
                                       "--out", str(pair)])
    assert result.exit_code == 0, result.output
    assert [spec.capacity for spec in Manifest.read(pair).models.values()] == [128, 128]


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that a recursive parser cannot hold


def _deep_manifest(art):
    (art / "manifest.json").write_text(DEEP)


def _hostile_cases(tmp_path, pair_dir, ckpt):
    """(command line, what the one line must say) for files that used to end in a traceback."""
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    _deep_manifest(art)
    deep_prompts = tmp_path / "deep.jsonl"
    deep_prompts.write_text(DEEP + "\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81 not text")
    deep_config = tmp_path / "deep_config"
    shutil.copytree(ckpt, deep_config)
    (deep_config / "config.json").write_text('{"model_type": "llama", "x": ' + DEEP + "}")
    broken_generation = tmp_path / "broken_generation"
    shutil.copytree(ckpt, broken_generation)
    (broken_generation / "generation_config.json").write_text("{ eos_token_id: 2")
    bench_out = tmp_path / "bench"
    bench_out.mkdir()
    (bench_out / "summary.json").write_text('{"all": {}}')
    (bench_out / "records.jsonl").write_text('{"type": "cycle"}\n{half a record\n')
    return [
        (["inspect", art], "nested too deeply to be a manifest"),
        (["doctor", art], "nested too deeply to be a manifest"),
        (["generate", pair_dir, "--prompt-file", deep_prompts], "nested too deeply to be a prompt record"),
        (["generate", pair_dir, "--prompt-file", binary], "not UTF-8 text"),
        (["export", "--target", deep_config, "--out", tmp_path / "o1"], "nested too deeply to be a model config"),
        (["export", "--target", broken_generation, "--out", tmp_path / "o2", "--capacity", "64"],
         "generation_config.json: cannot be read"),
        (["report", bench_out], "records.jsonl:2: not a bench record"),
    ]


def test_hostile_files_get_one_line_not_a_traceback(tmp_path, pair_dir, ckpt):
    for args, message in _hostile_cases(tmp_path, pair_dir, ckpt):
        result = run(*args)
        assert result.exit_code != 0 and message in result.output, (args, result.output[-500:], result.exception)
        assert isinstance(result.exception, SystemExit), (args, repr(result.exception))  # a clean exit, no traceback


def test_doctor_summarises_many_problems(pair_dir, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"] |= {f"gone-{i}.bin": "0" * 64 for i in range(10_000)}
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run("doctor", art)
    assert result.exit_code == 1 and "… and 9,980 more problems (10,000 in all)" in result.output
    assert result.output.count("problem ") <= 21


def _tampered(pair_dir, directory, change):
    """A copy of the artifact, changed, with a manifest rehashed to match (as an attacker or a bad disk would)."""
    from specdeploy.contract import sha256_file

    shutil.copytree(pair_dir, directory)
    change(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = {p.name: sha256_file(p) for p in directory.iterdir() if p.is_file() and p.name != "manifest.json"}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def _foreign_op(directory):
    import onnx

    graph = onnx.load(str(directory / "target.onnx"))
    graph.graph.node[0].domain = "evil.ops"
    onnx.save(graph, str(directory / "target.onnx"))


@pytest.mark.parametrize("change,message", [
    (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer.json: not a readable tokenizer"),
    (lambda d: (d / "target.onnx").write_bytes((d / "target.onnx").read_bytes()[:1000]), "not a readable ONNX graph"),
    (lambda d: (d / "target.onnx").write_bytes(b""), "ONNX Runtime cannot load it"),
    (_foreign_op, "ONNX Runtime cannot load it (InvalidGraph"),
])
def test_unloadable_artifacts_get_one_line(pair_dir, tmp_path, change, message):
    art = _tampered(pair_dir, tmp_path / "art", change)
    for args in (["generate", art, "--prompt", "w5"], ["doctor", art]):
        result = run(*args)
        assert result.exit_code != 0 and message in result.output, (args, result.output[-500:])
        assert isinstance(result.exception, SystemExit), repr(result.exception)


def test_unusable_configs_and_values_get_one_line(pair_dir, ckpt, tmp_path):
    zero_heads = tmp_path / "zero_heads"
    shutil.copytree(ckpt, zero_heads)
    config = json.loads((zero_heads / "config.json").read_text())
    config["num_attention_heads"] = 0
    (zero_heads / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6\n")
    for args, message in [
        (["export", "--target", zero_heads, "--out", tmp_path / "o", "--capacity", "64"],
         "config.json: num_attention_heads: got 0; expected an integer >= 1"),
        (["bench", pair_dir, "--prompts", prompts, "--temperature", "-1", "--out", tmp_path / "b"], "temperature: got -1.0"),
    ]:
        result = run(*args)
        assert result.exit_code != 0 and message in result.output, (args, result.output[-500:])
        assert isinstance(result.exception, SystemExit), repr(result.exception)
