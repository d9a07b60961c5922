"""Folders that are not what they claim are refused in one line naming what is wrong, before ONNX Runtime reads a
byte of them."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from specdeploy.cli import main
from tests import tiny


def _copy(foreign, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(foreign["folders"][name], folder)
    return folder


def _refusal(tmp_path, source, *extra) -> str:
    """The one line ``specdeploy import`` refuses ``source`` with; nothing is written."""
    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["import", str(source), "--out", str(out), *extra])
    assert result.exit_code == 1, result.output
    assert not out.exists()
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def _edit_graph(folder, edit) -> None:
    """Rewrite ``folder/model.onnx``'s proto (weights stay in their external file) with ``edit(model)``."""
    path = folder / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    edit(model)
    onnx.save_model(model, str(path))


def test_a_folder_without_a_config_is_refused(foreign, tmp_path):
    folder = _copy(foreign, "genai-llama", tmp_path)
    (folder / "genai_config.json").unlink()
    assert "neither genai_config.json" in _refusal(tmp_path, folder)


def test_a_genai_config_naming_an_input_we_do_not_drive_is_refused(foreign, tmp_path):
    folder = _copy(foreign, "genai-llama", tmp_path)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"]["position_ids"] = "position_ids"
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert "['position_ids'] are not ones we drive" in _refusal(tmp_path, folder)


def test_a_graph_with_an_unknown_input_is_refused(foreign, tmp_path):
    folder = _copy(foreign, "optimum-llama", tmp_path)
    _edit_graph(folder, lambda model: model.graph.input.append(
        helper.make_tensor_value_info("token_type_ids", onnx.TensorProto.INT64, ["batch", "tokens"])))
    assert "inputs ['token_type_ids'] are not ones we drive" in _refusal(tmp_path, folder)


def test_a_graph_whose_cache_names_do_not_pair_up_is_refused(foreign, tmp_path):
    folder = _copy(foreign, "genai-llama", tmp_path)

    def rename(model):
        output = next(o for o in model.graph.output if o.name == "present.1.key")
        output.name = "present.5.key"
    _edit_graph(folder, rename)
    line = _refusal(tmp_path, folder)
    assert "present.%d.key exists for layers [0, 5]" in line and "past and present paired" in line


def test_external_data_outside_the_folder_is_refused(foreign, tmp_path):
    folder = _copy(foreign, "genai-llama", tmp_path)
    shutil.copyfile(folder / "model.onnx.data", tmp_path / "outside.data")

    def point_outside(model):
        for tensor in model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "../outside.data"
    _edit_graph(folder, point_outside)
    line = _refusal(tmp_path, folder)
    assert "points its external data at '../outside.data'" in line and "expected a plain file in" in line


def test_external_data_read_past_its_files_end_is_refused(foreign, tmp_path):
    folder = _copy(foreign, "genai-llama", tmp_path)
    data = folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    assert "model.onnx.data up to byte" in _refusal(tmp_path, folder)


def test_custom_ops_and_model_local_functions_are_refused(foreign, tmp_path):
    folder = _copy(foreign, "genai-llama", tmp_path)
    _edit_graph(folder, lambda model: model.graph.node.append(
        helper.make_node("Steal", ["input_ids"], ["stolen"], domain="com.example.custom")))
    assert "operators of domain 'com.example.custom' (custom ops)" in _refusal(tmp_path, folder)

    folder = _copy(foreign, "optimum-llama", tmp_path / "functions")
    _edit_graph(folder, lambda model: model.functions.append(
        helper.make_function("local", "f", ["x"], ["y"], [helper.make_node("Identity", ["x"], ["y"])],
                             [helper.make_opsetid("", 18)])))
    assert "1 model-local functions" in _refusal(tmp_path, folder)


def test_a_draft_with_another_tokenizer_is_refused(foreign, tmp_path):
    draft = _copy(foreign, "genai-llama-draft", tmp_path)
    tiny.make_tokenizer(shift=1000).save(str(draft / "tokenizer.json"))
    line = _refusal(tmp_path, foreign["folders"]["genai-llama"], "--draft", str(draft))
    assert "the draft's tokenizer differs from the target's" in line


@pytest.mark.parametrize(("change", "message"), [
    ({"vocab_size": 64}, "outside the models' vocabulary [0, 64)"),
    ({"decoder": {"num_key_value_heads": 3}}, "num_heads 4 is not a multiple of kv_heads 3"),
])
def test_a_genai_config_that_does_not_make_a_valid_manifest_is_refused(foreign, tmp_path, change, message):
    folder = _copy(foreign, "genai-llama", tmp_path)
    config = json.loads((folder / "genai_config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            config["model"][key].update(value)
        else:
            config["model"][key] = value
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert message in _refusal(tmp_path, folder)
