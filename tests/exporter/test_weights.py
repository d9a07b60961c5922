"""fp16 and int4 exports load, run, and mostly agree with fp32 on the top-1 token."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from tests import tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # hidden 64 so int4 blocks of 32 see more than one block per column
    config = tiny.llama_config(hidden_size=64, intermediate_size=128)
    return tiny.save_checkpoint(tiny.build_model(config, seed=5, conditioned=True), tmp_path_factory.mktemp("w") / "ckpt")


def _top1(directory, ids):
    manifest = Manifest.read(directory)
    engine = load_engine(directory, manifest, "target")
    out = engine.infer(ids, np.zeros(len(ids), np.int64), engine.allocate_cache(len(ids), ids.shape[1]))
    assert out.logits.dtype == np.float32 and np.isfinite(out.logits).all()
    return manifest, engine, out.logits.argmax(-1)


@pytest.mark.parametrize("options,dtype,weights", [
    (["--dtype", "float16"], "float16", "full"),
    (["--weights", "int4"], "float32", "int4"),
    (["--dtype", "float16", "--weights", "int4"], "float16", "int4"),
    (["--weights", "int8"], "float32", "int8"),
    (["--weights", "int4", "--block-size", "128", "--accuracy-level", "0"], "float32", "int4"),
])
def test_compressed_exports_agree_on_top1(checkpoint, tmp_path, options, dtype, weights):
    ids = np.random.default_rng(0).integers(0, tiny.VOCAB, (4, 16))
    _, _, reference = _top1(tiny.export_cli(tmp_path / "fp32", checkpoint), ids)
    manifest, engine, top1 = _top1(tiny.export_cli(tmp_path / "c", checkpoint, None, *options), ids)
    assert (manifest.target.dtype, manifest.target.weights) == (dtype, weights)
    assert set(manifest.files) == {"target.onnx", "tokenizer.json"}  # no quantizer leftovers
    assert engine.cache_dtype == np.dtype(dtype)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "c" / "target.onnx")).graph.node}
    assert ("MatMulNBits" in ops) == (weights == "int4")
    assert ("MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops) == (weights == "int8")
    rate = float((top1 == reference).mean())
    print(f"top-1 agreement with fp32, {dtype}/{weights}: {rate:.3f}")
    # int4 rounds every weight to 16 levels per block: "most positions", not all (fp16: nearly all)
    assert rate >= {"int4": 0.75, "int8": 0.9, "full": 0.95}[weights], f"{dtype}/{weights}: top-1 agreement {rate:.3f}"


def _logits(directory, ids):
    engine = load_engine(directory, Manifest.read(directory), "target")
    return engine.infer(ids, np.zeros(len(ids), np.int64), engine.allocate_cache(len(ids), ids.shape[1])).logits.copy()


def test_int8_logits_stay_close_to_fp32(checkpoint, tmp_path):
    """Numbers, not only top-1: batch x tokens (2 x 7) differs from the hidden size (64), and rows differ in scale.

    (ONNX Runtime's MatMulIntegerToFloat fusion reads an activation scale of hidden-size elements as
    per column, anything else as one scalar: a per-row scale fed to it passes when batch x tokens
    happens to equal the hidden size and is garbage otherwise.)
    """
    ids = np.random.default_rng(2).integers(0, tiny.VOCAB, (2, 7))
    reference = _logits(tiny.export_cli(tmp_path / "fp32", checkpoint), ids)
    int8 = _logits(tiny.export_cli(tmp_path / "int8", checkpoint, None, "--weights", "int8"), ids)
    error = np.linalg.norm(int8 - reference, axis=-1) / np.linalg.norm(reference, axis=-1)  # [batch, tokens]
    print(f"int8 relative logits error: max {error.max():.4f}, mean {error.mean():.4f}")
    assert error.max() < 0.05


def test_int8_per_row_scale_never_reaches_a_fused_kernel(checkpoint, tmp_path):
    """ONNX Runtime fuses MatMulInteger -> Cast -> Mul(scale) into MatMulIntegerToFloat, whose activation
    scale must be a scalar or per column. Fed the per-row scale, the fused kernel gave garbage on Qwen2.5
    1.5B (top-1 agreement with fp32 0.006 instead of 0.98; tiny models happened to pass): the graph
    ONNX Runtime actually runs, after its optimizations, must give every fused kernel a constant scale.
    """
    import onnxruntime as ort

    int8 = tiny.export_cli(tmp_path / "int8", checkpoint, None, "--weights", "int8")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    tiny.ort_session(int8 / "target.onnx", options)
    graph = onnx.load(str(tmp_path / "optimized.onnx")).graph
    constants = {t.name for t in graph.initializer}
    fused = [n for n in graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert all(n.input[2] in constants for n in fused), [n.input[2] for n in fused if n.input[2] not in constants]
    rescales = [n for n in graph.node if n.op_type == "Mul" and any("/per_row/scale" in i for i in n.input)]
    assert len(rescales) == sum(n.op_type in ("MatMulInteger", "MatMulIntegerToFloat") for n in graph.node) > 0


def _one_matmul(tmp_path, per_row: bool):
    """A [batch, tokens, 48] x [48, 40] MatMul through the exporter's int8 writer, or (the negative control)
    ONNX Runtime's dynamic quantizer as it is."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from specdeploy.exporter.int8 import to_int8_per_row

    weight = np.random.default_rng(3).standard_normal((48, 40)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", 40])],
                              [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "f.onnx")
    if per_row:
        to_int8_per_row(tmp_path / "f.onnx", external_data_bytes=1 << 30)
        return onnx.load(tmp_path / "f.onnx")
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx", weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
    return onnx.load(tmp_path / "q.onnx")


@pytest.mark.parametrize("per_row", [True, False])
def test_int8_per_row_scales_compute_each_token_as_if_alone(tmp_path, per_row):
    """Per-row scales make a token's int8 MatMul independent of the call's other tokens, bit for bit.

    ONNX Runtime's own scale spans the call, so a verified token's result depends on the drafts
    beside it (the negative control). What stays: fp32 attention sums 5 rows in another order than
    1, and int8 rounding can amplify that noise (measured on the real pair: docs/results/exactness).
    """

    session = tiny.ort_session(_one_matmul(tmp_path, per_row).SerializeToString())
    x = np.random.default_rng(4).standard_normal((1, 5, 48)).astype(np.float32)
    x[0, 2] *= 40  # one token far larger than the others, as a draft can be
    together = session.run(None, {"x": x})[0]
    alone = np.concatenate([session.run(None, {"x": x[:, i : i + 1]})[0] for i in range(5)], axis=1)
    reference = x @ np.random.default_rng(3).standard_normal((48, 40)).astype(np.float32)
    assert np.abs(together - reference).max() < 0.05 * np.abs(reference).max()
    if per_row:
        np.testing.assert_array_equal(together, alone)
    else:
        assert np.abs(together - alone).max() > 1e-3
