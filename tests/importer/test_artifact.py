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
