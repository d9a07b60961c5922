"""Hostile artifacts: every one is refused with a clear error before ONNX Runtime reads a byte of it."""

from __future__ import annotations

import json
import re
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
    with pytest.raises(ContractError, match=r"token ids up to 119 \(120 tokens\), outside the models' vocabulary \[0, 100\)"):
        Pipeline.load(art)
    assert any("token ids up to 119" in problem for problem, _ in diagnose(art))


def _unlisted(art, name="swappable.bin"):
    """``name`` in the artifact dir, kept out of the manifest's hashed files as an attacker would."""
    _rehash(art)
    manifest = json.loads((art / "manifest.json").read_text())
    del manifest["files"][name]
    (art / "manifest.json").write_text(json.dumps(manifest))


def _in_a_function(graph):
    """A model-local function whose Constant reads external data, called from the main graph."""
    constant = onnx.helper.make_node("Constant", [], ["value"], value=_external_tensor("swappable.bin"))
    graph.functions.append(onnx.helper.make_function("local", "Swappable", [], ["value"], [constant],
                                                     [onnx.helper.make_opsetid("", 18)]))
    graph.opset_import.append(onnx.helper.make_opsetid("local", 1))
    graph.graph.node.append(onnx.helper.make_node("Swappable", [], ["swappable_out"], domain="local"))


def _in_a_function_subgraph(graph):
    """The same Constant one level further down: in an If branch inside a model-local function."""
    constant = onnx.helper.make_node("Constant", [], ["value"], value=_external_tensor("swappable.bin"))
    branch = onnx.helper.make_graph([constant], "branch", [], [onnx.helper.make_tensor_value_info(
        "value", onnx.TensorProto.FLOAT, [16])])
    flag = onnx.helper.make_node("Constant", [], ["flag"], value=onnx.helper.make_tensor("f", onnx.TensorProto.BOOL,
                                                                                         [], [True]))
    choose = onnx.helper.make_node("If", ["flag"], ["value_out"], then_branch=branch, else_branch=branch)
    graph.functions.append(onnx.helper.make_function("local", "Branchy", [], ["value_out"], [flag, choose],
                                                     [onnx.helper.make_opsetid("", 18)]))
    graph.opset_import.append(onnx.helper.make_opsetid("local", 1))


def _in_a_function_default(graph):
    """A function attribute's default value: a tensor in FunctionProto.attribute_proto."""
    function = onnx.helper.make_function("local", "Defaults", [], [], [], [onnx.helper.make_opsetid("", 18)])
    function.attribute_proto.append(onnx.helper.make_attribute("table", _external_tensor("swappable.bin")))
    graph.functions.append(function)


def _in_training_info(graph):
    initialization = onnx.helper.make_graph([], "init", [], [])
    initialization.initializer.append(_external_tensor("swappable.bin"))
    graph.training_info.add().initialization.CopyFrom(initialization)


def _in_a_sparse_initializer(graph):
    values = _external_tensor("swappable.bin")
    values.name = "sparse_values"
    indices = onnx.helper.make_tensor("sparse_indices", onnx.TensorProto.INT64, [16], list(range(16)))
    graph.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, [32]))


@pytest.mark.parametrize("hide", [_in_a_function, _in_a_function_subgraph, _in_a_function_default, _in_training_info,
                                  _in_a_sparse_initializer])
def test_external_data_anywhere_in_the_model_is_vetted(self_dir, tmp_path, hide):
    """Model-local functions (their nodes, subgraphs and default attributes), training info and sparse tensors
    hold tensors ONNX Runtime may read too: a file they name that the manifest does not hash could be swapped
    after export with every hash still matching. Refused by load (with or without hash checks) and doctor."""
    from specdeploy.doctor import diagnose

    art = _copy(self_dir, tmp_path / "art")
    (art / "swappable.bin").write_bytes(b"\0" * 64)
    graph = onnx.load(str(art / "target.onnx"))
    hide(graph)
    onnx.save(graph, str(art / "target.onnx"))
    _unlisted(art)
    for verify_hashes in (True, False):
        with pytest.raises(ContractError, match="points its external data at 'swappable.bin'"):
            Pipeline.load(art, verify_hashes=verify_hashes)
    assert any("points its external data at 'swappable.bin'" in problem for problem, _ in diagnose(art))


def test_a_function_reading_an_unlisted_file_would_change_the_output(self_dir, tmp_path):
    """Why it matters: a model-local function's Constant, added into the logits, is read by ONNX Runtime from the
    file it names at every load, so the output follows that file (checked here with the vetting bypassed)."""
    import numpy as np

    from specdeploy.contract import Manifest
    from specdeploy.engines.ort import OrtEngine

    art = _copy(self_dir, tmp_path / "art")
    graph = onnx.load(str(art / "target.onnx"))
    shift = onnx.helper.make_tensor("shift", onnx.TensorProto.FLOAT, [128], [0.0] * 128)
    shift.ClearField("float_data")
    shift.data_location = onnx.TensorProto.EXTERNAL
    shift.external_data.add(key="location", value="swappable.bin")
    constant = onnx.helper.make_node("Constant", [], ["shift"], value=shift)
    graph.functions.append(onnx.helper.make_function("local", "Shift", [], ["shift"], [constant],
                                                     [onnx.helper.make_opsetid("", 18)]))
    graph.opset_import.append(onnx.helper.make_opsetid("local", 1))
    logits = graph.graph.output[0].name
    for node in graph.graph.node:  # the logits now come out of an Add of the function's constant
        node.output[:] = [f"{name}_unshifted" if name == logits else name for name in node.output]
    graph.graph.node.extend([onnx.helper.make_node("Shift", [], ["shift_out"], domain="local"),
                             onnx.helper.make_node("Add", [f"{logits}_unshifted", "shift_out"], [logits])])
    onnx.save(graph, str(art / "target.onnx"))
    outputs = []
    for value in (0.0, 1000.0):
        (art / "swappable.bin").write_bytes(np.full(128, value, np.float32).tobytes())
        manifest = Manifest.read(art)
        engine = OrtEngine(art / "target.onnx", manifest.target)
        cache = engine.allocate_cache(1, 8)
        outputs.append(engine.infer(np.array([[5]], np.int64), np.array([0], np.int64), cache).logits)
    assert np.allclose(outputs[1] - outputs[0], 1000.0)  # the unlisted file decides the logits
    _unlisted(art)
    with pytest.raises(ContractError, match="function 'Shift' .* points its external data at 'swappable.bin'"):
        Pipeline.load(art)


def test_a_precompiled_engine_node_is_refused(self_dir, tmp_path):
    """An EPContext node names a precompiled engine that an execution provider loads from a file: none of ours has one."""
    art = _copy(self_dir, tmp_path / "art")
    graph = onnx.load(str(art / "target.onnx"))
    graph.graph.node.append(onnx.helper.make_node("EPContext", [], ["engine_out"], domain="com.microsoft",
                                                  embed_mode=0, ep_cache_context="/tmp/engine.bin"))
    onnx.save(graph, str(art / "target.onnx"))
    _rehash(art)
    with pytest.raises(ContractError, match="EPContext node .* expected none"):
        Pipeline.load(art)


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.bin", "manifest.json"])
def test_manifest_file_names_must_be_plain_names_of_the_artifact(self_dir, tmp_path, name):
    """Absolute or climbing names in ``files`` are refused when the manifest is read (inspect used to report the
    size of any file they named)."""
    art = _copy(self_dir, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"][name] = "0" * 64
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match=r"files: file .* must be a plain file name inside the artifact dir"):
        Pipeline.load(art)


def test_a_manifest_with_many_missing_files_is_summarised(self_dir, tmp_path):
    art = _copy(self_dir, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"] |= {f"gone-{i}.bin": "0" * 64 for i in range(100_000)}
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError) as refused:
        Pipeline.load(art)
    message = str(refused.value)
    assert "gone-0.bin: missing or not a regular file" in message and "… and 99,990 more (100,000 in all)" in message
    assert len(message) < 2_000
    manifest["files"] |= {f"gone-{i}.bin": "0" * 64 for i in range(200_000)}  # 17 MB: no manifest of ours
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match=r"manifest.json: 17,\d{3},\d{3} bytes; expected at most 16,777,216"):
        Pipeline.load(art)


def _manifest_change(art, **fields):
    manifest = json.loads((art / "manifest.json").read_text())
    for role in manifest["models"]:
        manifest["models"][role].update(fields)
    (art / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fields,match", [
    ({"capacity": 200}, r"capacity 200 in the manifest, but its position table 'cos_cache' covers 96 positions"),
    ({"num_heads": 8}, r"attention nodes declare \(num_heads, kv_heads\) \[\(4, 2\)\]; the manifest says \(8, 2\)"),
])
def test_a_fused_manifest_disagreeing_with_its_attention_is_refused(fused_dirs, tmp_path, fields, match):
    """A capacity beyond the rotary cache used to fail at the first position past it, inside ONNX Runtime; heads
    unlike the graph's went unnoticed. Refused by load and doctor."""
    from specdeploy.doctor import diagnose

    art = _copy(fused_dirs["self"], tmp_path / "art")
    _manifest_change(art, **fields)
    with pytest.raises(ContractError, match=match):
        Pipeline.load(art)
    assert any(re.search(match, problem) for problem, _ in diagnose(art))


def test_a_capacity_beyond_learned_positions_is_refused(exported_architecture, tmp_path):
    """GPT-2 learns 256 position embeddings: a manifest claiming more capacity is refused at load."""
    _, exported = exported_architecture("gpt2")
    art = _copy(exported, tmp_path / "art")
    _manifest_change(art, capacity=300)
    with pytest.raises(ContractError, match="capacity 300 in the manifest, but its position table 'wpe' covers 256 positions"):
        Pipeline.load(art)


def test_target_and_draft_swapped_are_refused_even_where_their_graphs_agree(self_dir, tmp_path):
    """The manifest carries no hash of itself, and this pair's graphs have the same shapes: the role each graph was
    exported as (in its metadata) tells the swap."""
    from specdeploy.doctor import diagnose

    art = _copy(self_dir, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    models = manifest["models"]
    models["target"]["file"], models["draft"]["file"] = models["draft"]["file"], models["target"]["file"]
    (art / "manifest.json").write_text(json.dumps(manifest))
    match = "it was exported as the draft model, and the manifest lists it as the target's file"
    with pytest.raises(ContractError, match=match):
        Pipeline.load(art)
    assert any(match in problem for problem, _ in diagnose(art))


@pytest.mark.parametrize("fields,match", [
    ({"num_heads": 8}, r"it reshapes its projections into heads of \[2, 4\]; the manifest says num_heads 8, kv_heads 2"),
    ({"num_heads": 2}, r"heads of \[2, 4\]; the manifest says num_heads 2, kv_heads 2"),
])
def test_an_explicit_manifest_disagreeing_with_its_head_count_is_refused(pair_dir, tmp_path, fields, match):
    """Heads unlike the explicit graph's were accepted: its cache shapes show kv_heads only."""
    from specdeploy.doctor import diagnose

    art = _copy(pair_dir, tmp_path / "art")
    _manifest_change(art, **fields)
    with pytest.raises(ContractError, match=match):
        Pipeline.load(art)
    assert any(re.search(match, problem) for problem, _ in diagnose(art))
    assert Pipeline.load(pair_dir).manifest.target.num_heads == 4  # the graph as exported is taken
