"""What is particular to mixtures of experts beyond parity (test_parity), greedy decoding and speculation (test_families)
and the weight formats (test_family_formats): a malformed mixture config refused in one line naming its field, gpt-oss's
MXFP4 checkpoints read exactly, routers kept in full precision by every weight format, and the fused form's experts in
standard ops where ONNX Runtime's QMoE kernel cannot take them, said in the manifest and equal to the explicit form."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from tests import tiny
from tests.exporter.cases import PARITY_CASES

IDS = np.array([list(range(5, 19))])


def _logits(directory, ids=IDS) -> np.ndarray:
    engine = load_engine(directory, Manifest.read(directory), "target")
    return engine.infer(ids, np.zeros(len(ids), np.int64), engine.allocate_cache(len(ids), ids.shape[1])).logits


def _export_refused(tmp_path, checkpoint, *options) -> list[str]:
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["export", "--target", str(checkpoint), "--out", str(tmp_path / "art"), *options])
    assert result.exit_code != 0 and not (tmp_path / "art").exists(), result.output
    return [line for line in result.output.splitlines() if line.strip()]


@pytest.mark.parametrize("case,edit,refusal", [
    ("qwen3_moe", {"num_local_experts": 0}, "config.json: num_local_experts: got 0; expected an integer >= 1"),
    ("olmoe", {"num_experts": 0}, "config.json: num_experts: got 0; expected an integer >= 1"),
    ("mixtral", {"num_experts_per_tok": 5},
     "config.json: num_experts_per_tok: got 5; expected an integer >= 1, at most num_local_experts (4)"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "config.json: moe_intermediate_size: got 0; expected an integer >= 1"),
    ("qwen3_moe", {"mlp_only_layers": [3]},
     "config.json: mlp_only_layers: got [3]; expected a list of layer indices, each in [0, num_hidden_layers = 3)"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "config.json: decoder_sparse_step: got 0; expected an integer >= 1"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1},
     "config.json: shared_expert_intermediate_size: got -1; expected an integer >= 1, or 0 (no shared expert)"),
    ("qwen2_moe", {"norm_topk_prob": "yes"}, "config.json: norm_topk_prob: got 'yes'; expected one of true or false"),
    ("gpt_oss", {"swiglu_limit": 0}, "config.json: swiglu_limit: got 0; expected a finite number > 0"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 40},
     "model.layers.1.mlp.shared_expert.gate_proj.weight holds [48, 64], and the config's shared_expert_intermediate_size 40"),
    ("olmoe", {"num_experts": 6}, "model.layers.0.mlp.gate.weight holds [4, 64], and the config's num_experts 6"),
])
def test_a_malformed_mixture_config_is_refused_in_one_line_naming_the_field(tmp_path, case, edit, refusal):
    """A checkpoint whose config.json says no experts, more chosen experts than there are, or sizes its weights do not
    have is refused before anything is written, in one line that names the field, what it got and what it expects."""
    checkpoint = tiny.save_checkpoint(tiny.build_model(PARITY_CASES[case](), seed=3), tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | edit))
    for form in ("explicit", "fused"):
        lines = _export_refused(tmp_path, checkpoint, "--graph", form)
        assert [line for line in lines if refusal in line] == [lines[-1]], lines


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """The gpt_oss parity case with its experts stored as its checkpoints store them, MXFP4 blocks and scales (the model
    holding the values they decode to), and the same model stored in float: (model, mxfp4 checkpoint, float one)."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model = tiny.build_model(PARITY_CASES["gpt_oss"](), seed=3)
    mxfp4 = tiny.save_mxfp4_checkpoint(model, root / "mxfp4")
    return model, mxfp4, tiny.save_checkpoint(model, root / "float")


def test_gpt_oss_mxfp4_experts_are_read_exactly(gpt_oss_mxfp4, tmp_path):
    """Its checkpoints' MXFP4 experts decode (transformers' own decoder) to the values the float checkpoint holds: both
    export to the same graph's logits, transformers' own within parity's tolerance; as int4 both round the same values.
    The decoding is the checkpoint's, before either form is built (each form's gpt_oss graph is held to transformers in
    test_parity): the fused form alone, without the explicit form's two traces (half a minute)."""
    model, mxfp4, plain = gpt_oss_mxfp4
    with torch.no_grad():
        expected = model(torch.tensor(IDS)).logits.numpy()
    for fmt in ([], ["--weights", "int4", "--block-size", "16"]):
        exported = {name: tiny.export_cli(tmp_path / f"{name}-{len(fmt)}", source, None, "--graph", "fused", *fmt)
                    for name, source in (("mxfp4", mxfp4), ("float", plain))}
        logits = {name: _logits(directory) for name, directory in exported.items()}
        np.testing.assert_array_equal(logits["mxfp4"], logits["float"])
        if not fmt:
            assert np.abs(logits["mxfp4"] - expected).max() <= 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("form", ["explicit", "fused"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_routers_stay_in_full_precision_in_every_weight_format(exported_architecture, tmp_path, form, fmt):
    """A router's MatMul reads a float weight in an int8 or int4 graph (as llama.cpp keeps ffn_gate_inp in F32): which
    experts a token reaches is not moved by the format's rounding. The shared expert's gate too."""
    directory = tiny.export_cli(tmp_path / "art", exported_architecture.checkpoint("qwen2_moe"), None, "--graph", form,
                                "--weights", fmt, "--block-size", "16")
    graph = onnx.load(str(directory / "target.onnx"), load_external_data=False).graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    routers = [node.input[1] for node in graph.node if node.op_type == "MatMul" and node.input[1].endswith("router")]
    assert len(routers) == 2  # the one sparse layer's router and its shared expert's gate
    assert all(initializers[name].data_type == onnx.TensorProto.FLOAT for name in routers)
    assert not any(node.op_type == "MatMul" and node.input[1] in initializers
                   and not node.input[1].endswith("router") for node in graph.node)  # every other weight quantized


def test_fused_experts_fall_back_to_standard_ops_where_qmoe_cannot_take_them(exported_architecture, tmp_path):
    """int4 blocks of 64 do not divide the experts' width (32), which ONNX Runtime's QMoE needs: the fused graph writes
    its experts in standard ops, says so in the manifest, and computes what the explicit form computes."""
    checkpoint = exported_architecture.checkpoint("mixtral")
    exported = {form: tiny.export_cli(tmp_path / form, checkpoint, None, "--graph", form, "--weights", "int4",
                                      "--block-size", "64") for form in ("explicit", "fused")}
    features = Manifest.read(exported["fused"]).target.features
    assert "experts in standard ops: int4 blocks of 64 must divide hidden 64 and expert width 48 (ONNX Runtime's QMoE)" \
        in features, features
    ops = {node.op_type for node in onnx.load(str(exported["fused"] / "target.onnx"), load_external_data=False).graph.node}
    assert "QMoE" not in ops and "MoE" not in ops and "GroupQueryAttention" in ops
    logits = {form: _logits(directory) for form, directory in exported.items()}
    assert np.abs(logits["fused"] - logits["explicit"]).max() <= 1e-4 * np.abs(logits["explicit"]).max()
