"""Hostile artifacts: every one is refused with a clear error before ONNX Runtime reads a byte of it."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

from specdeploy import Pipeline
from specdeploy.contract import ContractError, sha256_file


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rehash(directory):
    """Make the manifest agree with the (tampered) files, as an attacker who controls both would."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = {p.name: sha256_file(p) for p in directory.iterdir() if p.is_file() and p.name != "manifest.json"}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _point_external(directory, location):
    graph = onnx.load(str(directory / "target.onnx"))
    tensor = max(graph.graph.initializer, key=lambda t: len(t.raw_data))
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    tensor.external_data.add(key="offset", value="0")
    tensor.external_data.add(key="length", value="64")
    onnx.save(graph, str(directory / "target.onnx"))


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside.bin", "sub/../../x.bin", "unlisted.bin"])
def test_external_data_escaping_the_artifact_is_refused(self_dir, tmp_path, location):
    art = _copy(self_dir, tmp_path / "art")
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    (art / "unlisted.bin").write_bytes(b"\0" * 64)
    _point_external(art, location)
    _rehash(art)
    if location == "unlisted.bin":  # present in the dir, but not in the manifest's files
        manifest = json.loads((art / "manifest.json").read_text())
        del manifest["files"]["unlisted.bin"]
        (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match="points its external data at"):
        Pipeline.load(art)


def test_symlink_out_of_the_artifact_is_refused(self_dir, tmp_path):
    art = _copy(self_dir, tmp_path / "art")
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    (art / "weights.bin").symlink_to(tmp_path / "secret.bin")
    _point_external(art, "weights.bin")
    _rehash(art)
    with pytest.raises(ContractError, match="missing or not a regular file|points its external data"):
        Pipeline.load(art)
    with pytest.raises(ContractError, match="points its external data"):
        Pipeline.load(art, verify_hashes=False)


@pytest.mark.parametrize("mutate,match", [
    (lambda m: m.pop("models"), "missing field 'models'"),
    (lambda m: m.update(contract="verify-v2"), "contract 'verify-v2' is not supported"),
    (lambda m: m["models"]["target"].update(num_layers="2"), "'num_layers' must be int, got str"),
    (lambda m: m["models"]["target"].update(kv_heads=0), "kv_heads must be positive"),
    (lambda m: m["models"]["target"].update(dtype="bfloat16"), "dtype 'bfloat16' not in"),
    (lambda m: m["models"]["target"].update(file="../target.onnx"), "must be a plain file name"),
    (lambda m: m["models"].update(oracle=m["models"]["target"]), "unknown role"),
    (lambda m: m["files"].update({"target.onnx": "abc"}), "expected a sha256 hex digest"),
    (lambda m: m["models"]["target"].update(num_layers=3), "disagree with the manifest"),
    (lambda m: m.update(opset="17"), "field 'opset' must be int, got str '17'"),
    (lambda m: m.update(opset=float("inf")), "field 'opset' must be int, got float inf"),
    (lambda m: m["models"]["target"].update(parameters=1e400), "field 'parameters' must be int, got float inf"),
    (lambda m: m.update(exporter_version="x" * 100_000), "field 'exporter_version' is 100,000 characters"),
    (lambda m: m["models"]["target"].update(vocab_size=10**12), r"field 'vocab_size' is 1000000000000; expected"),
    (lambda m: m["models"]["target"].update(eos_token_ids=list(range(100_000))), "at most 64 token ids"),
    (lambda m: m["models"]["target"].update(eos_token_ids=[2, 500]), r"eos_token_ids \[2, 500\] reach outside the vocab"),
])
def test_malformed_manifests(self_dir, tmp_path, mutate, match):
    art = _copy(self_dir, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    mutate(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises((ContractError, RuntimeError), match=match):
        Pipeline.load(art)


def test_manifest_that_is_not_json(self_dir, tmp_path):
    art = _copy(self_dir, tmp_path / "art")
    (art / "manifest.json").write_text("{ not json")
    with pytest.raises(ContractError, match="not valid JSON"):
        Pipeline.load(art)


def _external_tensor(location):
    tensor = onnx.helper.make_tensor("hidden", onnx.TensorProto.FLOAT, [16], [0.0] * 16)
    tensor.ClearField("float_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    tensor.external_data.add(key="length", value="64")
    return tensor


@pytest.mark.parametrize("where", ["constant", "subgraph"])
def test_external_data_outside_the_initializers_is_vetted_too(self_dir, tmp_path, where):
    """A Constant node (or any attribute tensor, in any subgraph) naming a file the manifest does not
    hash could be swapped after export: refused by load and reported by doctor."""
    from specdeploy.doctor import diagnose

    art = _copy(self_dir, tmp_path / "art")
    (art / "swappable.bin").write_bytes(b"\0" * 64)
    graph = onnx.load(str(art / "target.onnx"))
    constant = onnx.helper.make_node("Constant", [], ["hidden_out"], value=_external_tensor("swappable.bin"))
    if where == "subgraph":
        branch = onnx.helper.make_graph([constant], "branch", [], [onnx.helper.make_tensor_value_info(
            "hidden_out", onnx.TensorProto.FLOAT, [16])])
        true = onnx.helper.make_tensor("f", onnx.TensorProto.BOOL, [], [True])
        flag = onnx.helper.make_node("Constant", [], ["flag"], value=true)
        constant = onnx.helper.make_node("If", ["flag"], ["if_out"], then_branch=branch, else_branch=branch)
        graph.graph.node.append(flag)
    graph.graph.node.append(constant)
    onnx.save(graph, str(art / "target.onnx"))
    _rehash(art)
    manifest = json.loads((art / "manifest.json").read_text())
    del manifest["files"]["swappable.bin"]  # the attacker keeps it out of the hashed files
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match=r"node .* points its external data at 'swappable.bin'"):
        Pipeline.load(art)
    assert any("points its external data at 'swappable.bin'" in problem for problem, _ in diagnose(art))


@pytest.mark.parametrize("field,value", [("head_dim", 16), ("kv_heads", 1), ("vocab_size", 1000), ("dtype", "float16")])
def test_manifest_disagreeing_with_the_graph_is_refused(self_dir, tmp_path, field, value):
    """Sizes and types the manifest claims must be the graph's: refused by load, reported by doctor."""
    from specdeploy.doctor import diagnose

    art = _copy(self_dir, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["models"]["target"][field] = value
    if field == "vocab_size":
        manifest["models"]["draft"][field] = value  # the pair still agrees with itself
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="graph disagrees with the manifest"):
        Pipeline.load(art)
    assert any("graph disagrees with the manifest" in problem for problem, _ in diagnose(art))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(self_dir, tmp_path):
    from specdeploy.doctor import diagnose

    art = _copy(self_dir, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    for spec in manifest["models"].values():
        spec["vocab_size"] = 100  # the tokenizer has 120 entries
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match="120 tokens, more than the models' vocabulary of 100"):
        Pipeline.load(art)
    assert any("120 tokens" in problem for problem, _ in diagnose(art))
