"""The lean int8 writer makes, weight for weight and logit for logit, what ONNX Runtime's quantizer and the
per-row rewrite made (tests/exporter/int8_reference.py), while holding one float weight at a time."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from specdeploy.exporter.int8 import Int8Error, to_int8_per_row
from tests import tiny

from .int8_reference import to_int8_dynamic


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A tiny llama target exported with float weights: the graph both int8 paths start from."""
    root = tmp_path_factory.mktemp("int8")
    checkpoint = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(), seed=0), root / "ckpt")
    return tiny.export_cli(root / "art", checkpoint) / "target.onnx"


@pytest.mark.parametrize("external", [False, True])
def test_the_lean_writer_equals_ort_quantizer_and_the_per_row_rewrite(traced, tmp_path, external):
    ours, theirs = tmp_path / "ours" / "target.onnx", tmp_path / "theirs" / "target.onnx"
    for path in (ours, theirs):
        path.parent.mkdir()
        shutil.copy(traced, path)
    to_int8_per_row(ours, external_data_bytes=0 if external else 1 << 30)
    to_int8_dynamic(theirs)
    assert (ours.parent / "target.onnx.data").is_file() == external
    a, b = onnx.load(str(ours)), onnx.load(str(theirs))
    mine = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    reference = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert set(mine) == set(reference)
    for name, array in reference.items():
        assert mine[name].dtype == array.dtype and np.array_equal(mine[name], array), name
    assert sorted(n.op_type for n in a.graph.node) == sorted(n.op_type for n in b.graph.node)
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]
    feeds = _feeds(b)
    for x, y in zip(_run(ours, feeds), _run(theirs, feeds)):
        np.testing.assert_array_equal(x, y)


def test_int8_weights_stay_in_the_range_mlas_cannot_saturate_on_any_cpu(traced, tmp_path):
    """Without VNNI, MLAS's uint8 x int8 GEMM adds pairs of products in saturating int16: activations up to
    255 times weights up to 127, twice, overflow it (garbage logits on AVX2 EPYCs); weights within
    [-64, 64] cannot, whatever the CPU running the test has."""
    path = tmp_path / "target.onnx"
    shutil.copy(traced, path)
    to_int8_per_row(path, external_data_bytes=1 << 30)
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer if t.name.endswith("_quantized")]
    assert weights and all(w.dtype == np.int8 for w in weights)
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) * 255 * 2 < 2**15
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) == 64  # the range is used, not shrunk further


def test_a_graph_traced_with_external_data_and_written_inline_keeps_every_tensor(traced, tmp_path):
    """A model between the tiny ones and the external-data line (Qwen2.5-Coder 0.5B) is traced with external
    data and written inline: the tensors the rewrite leaves as they are (the embedding) must come along, not
    point at the data file the writer then deletes."""
    ours, theirs = tmp_path / "ours" / "target.onnx", tmp_path / "theirs" / "target.onnx"
    for path in (ours, theirs):
        path.parent.mkdir()
        onnx.save(onnx.load(str(traced)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="target.onnx.data", size_threshold=0)
    to_int8_per_row(ours, external_data_bytes=1 << 30)
    to_int8_dynamic(theirs)
    assert not (ours.parent / "target.onnx.data").exists()
    graph = onnx.load(str(ours), load_external_data=False)
    assert not [t.name for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    feeds = _feeds(onnx.load(str(theirs)))
    for x, y in zip(_run(ours, feeds), _run(theirs, feeds)):
        np.testing.assert_array_equal(x, y)


def test_a_graph_without_constant_matmuls_is_refused(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "y"], ["z"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "xy"],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2])])
    onnx.save(helper.make_model(graph), tmp_path / "g.onnx")
    with pytest.raises(Int8Error, match="no constant MatMul weights"):
        to_int8_per_row(tmp_path / "g.onnx", external_data_bytes=1 << 30)


def _feeds(model):
    """Inputs for a verify call: 3 tokens at past_len 2, random caches."""
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value or {"batch": 2, "tokens": 3}.get(d.dim_param, 16) for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[value.name] = (np.full(dims, 2, np.int64) if "past" in value.name
                                 else rng.integers(0, 100, dims).astype(np.int64))
        else:
            feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _run(path, feeds):
    return tiny.ort_session(Path(path)).run(None, feeds)
