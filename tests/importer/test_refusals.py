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
    ({"decoder": {"num_key_value_heads": 3}}, "genai_config.json: model.decoder.num_key_value_heads: got 3; expected an "
                                               "integer >= 1 that divides model.decoder.num_attention_heads (4)"),
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


# Round five: what a folder declares is checked before it is used, and an import ends with an artifact its loader takes

def _edit_genai(folder, change) -> None:
    config = json.loads((folder / "genai_config.json").read_text())
    change(config)
    (folder / "genai_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["model"].update(type={"a": 1}), "model.type: got {'a': 1}; expected a string of 1 to 256 characters"),
    (lambda c: c["model"]["decoder"].update(num_attention_heads=0),
     "model.decoder.num_attention_heads: got 0; expected an integer >= 1"),
    (lambda c: c["model"].update(vocab_size=1), "model.eos_token_id: got 2; expected a token id or a list of at most 64, "
                                                "each in [0, model.vocab_size = 1)"),
    (lambda c: c["model"].update(context_length=True), "model.context_length: got True; expected an integer >= 1"),
], ids=["type-a-dict", "heads-0", "vocab-1", "context-true"])
def test_a_genai_config_value_that_cannot_be_used_is_refused_naming_it(foreign, tmp_path, change, message):
    """model.type a dict was written into the manifest as the architecture; the others were refused by the manifest
    check without naming genai_config.json's field, or not at all."""
    folder = _copy(foreign, "genai-llama", tmp_path)
    _edit_genai(folder, change)
    line = _refusal(tmp_path, folder)
    assert f"{folder / 'genai_config.json'}: {message}" in line, line


def test_a_layer_count_the_graph_does_not_hold_sizes_nothing(foreign, tmp_path):
    """num_hidden_layers 10^9 beside a 2-layer graph: a set of 10^9 layer indices was built before the comparison (a
    MemoryError after 2.3 GB under a 3 GB cap). It is compared with the graph's inputs by their count."""
    import tracemalloc

    folder = _copy(foreign, "genai-llama", tmp_path)
    _edit_genai(folder, lambda c: c["model"]["decoder"].update(num_hidden_layers=10**9))
    tracemalloc.start()
    try:
        line = _refusal(tmp_path, folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "exists for layers [0, 1]" in line and ("expected each of the 1000000000 layers (genai_config.json: "
                                                   "model.decoder.num_hidden_layers) once") in line, line
    assert peak < 200 * 2**20, f"{peak:,} bytes traced"


def test_an_optimum_config_whose_sizes_its_graph_does_not_have_is_refused(foreign, tmp_path):
    """A head_dim the graph's cache inputs do not have (optimum's graphs fix it) would size caches ONNX Runtime refuses
    at the first call."""
    folder = _copy(foreign, "optimum-llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["head_dim"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    line = _refusal(tmp_path, folder)
    assert "past_key_values.0.key has 16 dims a head; config.json: head_dim declares 8" in line, line


@pytest.mark.parametrize(("files", "message"), [
    ({"tokenizer_config.json": "{not json"}, "tokenizer_config.json: not a readable tokenizer config (JSONDecodeError"),
    ({"tokenizer_config.json": "{not json", "chat_template.jinja": "{{ messages }}"},
     "tokenizer_config.json: not a readable tokenizer config (JSONDecodeError"),
    ({"tokenizer_config.json": json.dumps({"add_bos_token": "false"})},
     "tokenizer_config.json: add_bos_token: got 'false' (str); expected true or false"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{% for %}"})},
     "tokenizer_config.json: chat_template: does not compile (Expected an expression, got 'end of statement block', "
     "line 1)"),
    ({"chat_template.jinja": "{% if %}"}, "chat_template.jinja: does not compile"),
    ({"chat_template.jinja": "x" * (20 * 2**20)}, "chat_template.jinja: 20,971,520 bytes; expected at most 16,777,216"),
], ids=["malformed", "malformed-beside-a-template", "string-flag", "template-syntax", "jinja-syntax", "jinja-20mb"])
def test_tokenizer_files_the_loader_would_refuse_are_refused_at_import(foreign, tmp_path, files, message):
    """Each was copied as it was (the artifact then refused at load), or ended in a JSONDecodeError traceback (a
    malformed config beside a chat_template.jinja), or was folded into a config over the loader's 16 MiB bound."""
    folder = _copy(foreign, "genai-llama", tmp_path)
    (folder / "tokenizer_config.json").unlink()
    for name, text in files.items():
        (folder / name).write_text(text)
    assert message in _refusal(tmp_path, folder)


def test_a_chat_template_file_is_folded_into_a_config_the_loader_takes(foreign, tmp_path):
    from specdeploy import Pipeline

    folder = _copy(foreign, "genai-llama", tmp_path)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["import", str(folder), "--out", str(out), "--capacity", "64"])
    assert result.exit_code == 0, result.output
    with Pipeline.load(out) as pipeline:
        assert pipeline.chat_template.template == template


def test_an_initializer_declaring_more_than_its_data_is_refused(foreign, tmp_path):
    """An initializer declaring 2^50 elements beside 32 KB of external data: ONNX Runtime refused the imported artifact
    at load; the import now refuses it, naming the tensor."""
    folder = _copy(foreign, "genai-llama", tmp_path)

    def enlarge(model):
        tensor = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
        tensor.dims[0] = 2**44
    _edit_graph(folder, enlarge)
    line = _refusal(tmp_path, folder)
    assert (f"initializer 'model.embed_tokens.weight' declares dims [{2**44}, 64] ({2**50 * 4:,} bytes); its external "
            "data is 32,768 bytes") in line, line


def test_random_genai_settings_are_refused_by_name_or_import_what_the_folder_computes(foreign, tmp_path):
    """Every setting the importer reads of genai_config.json (``declared.GENAI``), a random value each (a fixed seed):
    refused in one line naming it, or imported as an artifact the loader takes whose greedy output is the folder's own
    tool's."""
    import copy
    import random

    from specdeploy import GenerationConfig, Pipeline
    from specdeploy.declared import GENAI
    from specdeploy.importer import ImportRefused, import_artifact
    from tests.exporter.test_declared_settings import candidates
    from tests.foreign import NEW_TOKENS, PROMPTS

    source = foreign["folders"]["genai-llama"]
    base = json.loads((source / "genai_config.json").read_text())
    reference = foreign["references"]["genai-llama"][0]
    rng = random.Random(70)
    for number, field in enumerate(f for rule in GENAI for f in rule.fields):
        *parents, leaf = field.split(".")
        value = rng.choice(candidates(_dig(base, field)))
        folder = _copy(foreign, "genai-llama", tmp_path / f"case{number}")
        config = copy.deepcopy(base)
        _dig(config, ".".join(parents))[leaf] = value
        (folder / "genai_config.json").write_text(json.dumps(config))
        try:
            import_artifact(folder, tmp_path / f"art{number}", capacity=64)
        except ImportRefused as exc:
            assert leaf in str(exc) and "\n" not in str(exc), (field, value, str(exc))
            continue
        with Pipeline.load(tmp_path / f"art{number}") as pipeline:
            ours = pipeline.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none", k=0,
                                                                    ignore_eos=True))[0].token_ids
        eos = base["model"]["eos_token_id"]
        assert ours[:len(reference)] == reference or ours[:reference.index(eos)] == reference[:reference.index(eos)], (
            field, value)


def _dig(config: dict, dotted: str):
    for key in dotted.split(".") if dotted else ():
        config = config.get(key) if isinstance(config, dict) else None
    return config
