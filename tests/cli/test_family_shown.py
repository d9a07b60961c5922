"""inspect and doctor name a model's family and what sets it apart from Llama, which the manifest records."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.contract import ContractError, Manifest

GEMMA2 = ("target: family gemma2; norms before_attention/after_attention/before_mlp/after_mlp, norm weight + 1, "
          "gelu_pytorch_tanh, embedding scale 5.65685, attention scale 0.204124, attention soft-cap 3, logits soft-cap 4, "
          "sliding window 4 on 1 of 2 layers, tied embeddings")


@pytest.fixture(scope="module")
def gemma2(exported_architecture):
    _, directory = exported_architecture("gemma2", "fused")
    return directory


def test_the_manifest_records_the_family_and_its_features(gemma2):
    spec = Manifest.read(gemma2).target
    assert spec.family == "gemma2" and spec.architecture == "gemma2"
    assert "sliding window 4 on 1 of 2 layers" in spec.features and "logits soft-cap 4" in spec.features


def test_inspect_and_doctor_name_the_family_and_its_features(gemma2, exported_architecture):
    runner = CliRunner()
    shown = runner.invoke(main, ["inspect", str(gemma2)], env={"COLUMNS": "400"})
    assert shown.exit_code == 0 and GEMMA2 in shown.output.replace("\n", " ")
    checked = runner.invoke(main, ["doctor", str(gemma2)], env={"COLUMNS": "400"})
    assert checked.exit_code == 0 and GEMMA2 in checked.output.replace("\n", " ")
    before = runner.invoke(main, ["doctor", "--target", str(exported_architecture.checkpoint("gemma2"))], env={"COLUMNS": "400"})
    assert before.exit_code == 0 and GEMMA2 in before.output.replace("\n", " "), before.output


def test_a_manifest_from_before_families_reads_and_bad_features_are_refused(gemma2, tmp_path):
    for features, works in ((None, True), (["a", "b"], True), ("a", False), ([1], False)):
        copy = tmp_path / f"art-{features!r}"
        shutil.copytree(gemma2, copy)
        data = json.loads((copy / "manifest.json").read_text())
        if features is None:
            del data["models"]["target"]["features"], data["models"]["target"]["family"]
        else:
            data["models"]["target"]["features"] = features
        (copy / "manifest.json").write_text(json.dumps(data))
        if works:
            assert Manifest.read(copy).target.features == tuple(features or ())
        else:
            with pytest.raises(ContractError, match="features must be a list of at most 64 strings"):
                Manifest.read(copy)
