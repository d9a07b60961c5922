"""What an import writes: the graph's own contract in the manifest, its files hashed, its rewrites recorded; inspect
and doctor read it as they read an export."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from click.testing import CliRunner

from specdeploy import Pipeline
from specdeploy.cli import main
from specdeploy.contract import ContractError, Manifest


def test_the_manifest_records_the_contract_and_a_changed_weight_file_is_caught(foreign, tmp_path):
    artifact = tmp_path / "art"
    shutil.copytree(foreign["artifacts"]["genai-llama-int4"], artifact)
    spec = Manifest.read(artifact).target
    assert (spec.imported.source, spec.imported.cache, spec.graph, spec.weights) == (
        "onnxruntime-genai", "shared", "fused", "int4")
    assert spec.imported.rewrites == ("external data model.onnx.data renamed target.model.onnx.data",
                                      "metadata specdeploy.role = target")
    # the graph as written names its renamed weights, and they are the source folder's bytes
    model = onnx.load(str(artifact / "target.onnx"), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"target.model.onnx.data"}
    source = foreign["folders"]["genai-llama-int4"] / "model.onnx.data"
    assert (artifact / "target.model.onnx.data").read_bytes() == source.read_bytes()
    weights = artifact / "target.model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.unlink()  # a new file: the hard link into the source folder stays as it was
    weights.write_bytes(bytes(data))
    with pytest.raises(ContractError, match="target.model.onnx.data: sha256 .* does not match the manifest's"):
        Pipeline.load(artifact)


def test_inspect_and_doctor_read_an_imported_artifact(foreign):
    artifact = foreign["artifacts"]["optimum-llama"]
    shown = CliRunner().invoke(main, ["inspect", "--json", str(artifact)])
    assert shown.exit_code == 0, shown.output
    target = json.loads(shown.output)["models"]["target"]
    assert target["inputs"][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert target["outputs"][:2] == ["logits", "present.0.key"]
    assert (target["imported"]["source"], target["imported"]["cache"], target["graph"]) == (
        "optimum", "concatenated", "explicit")
    checked = CliRunner().invoke(main, ["doctor", str(artifact)])
    assert checked.exit_code == 0 and "no problem found" in checked.output, checked.output


def test_an_fp16_build_s_logits_are_cast_to_float32_and_it_decodes_as_the_fp32_build(foreign, tmp_path):
    """onnxruntime-genai's fp16 (CUDA) build gives float16 logits; the engines bind float32 (an fp16 build was refused
    at load: "logits: the graph declares float16"). The import appends a Cast, recorded; the CPU EP runs the graph, and
    its logits are the fp32 build's of the same weights, up to fp16's rounding."""
    import numpy as np
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    from specdeploy import GenerationConfig
    from tests.foreign import import_cli

    checkpoint = foreign["folders"]["genai-llama"].parent / "llama-hf"
    args = ("", str(checkpoint), str(tmp_path / "fp16"), "fp16", "cuda", str(tmp_path / "cache"))
    create_model(*args, **parse_extra_options(*args, []))
    import_cli(tmp_path / "art", tmp_path / "fp16")
    spec = Manifest.read(tmp_path / "art").target
    assert spec.dtype == "float16" and "logits cast from float16 to float32 (a Cast node after the graph's own)" in (
        spec.imported.rewrites)
    graph = onnx.load(str(tmp_path / "art" / "target.onnx"), load_external_data=False).graph
    assert [o.type.tensor_type.elem_type for o in graph.output if o.name == "logits"] == [onnx.TensorProto.FLOAT]
    assert graph.node[-1].op_type == "Cast" and list(graph.node[-1].output) == ["logits"]
    ids = np.array([[1, 5, 9, 33, 17, 8]], np.int64)
    logits = []
    for artifact in (tmp_path / "art", foreign["artifacts"]["genai-llama"]):
        with Pipeline.load(artifact, prefix_cache_bytes=0) as pipeline:
            cache = pipeline.target.allocate_cache(1, 16)
            logits.append(pipeline.target.infer(ids, np.zeros(1, np.int64), cache).logits.copy())
            if artifact == tmp_path / "art":
                plain, drafted = (pipeline.generate([ids[0].tolist()] * 2, GenerationConfig(
                    max_new_tokens=12, ignore_eos=True, **settings)) for settings in (
                    {"drafter": "none"}, {"drafter": "suffix", "k": 4, "policy": "fixed"}))
                assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert logits[0].dtype == np.float32 and np.abs(logits[0]).max() > 1
    np.testing.assert_allclose(logits[0], logits[1], atol=0.05, rtol=0.01)
