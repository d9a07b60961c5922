"""Large models keep their weights as ONNX external data; the artifact stays self-contained."""

from __future__ import annotations

import numpy as np
import onnx

from specdeploy import Pipeline
from specdeploy.exporter import ExportOptions, export_artifact, onnx_graph
from tests import tiny


def test_external_data_export_loads_and_matches(checkpoints, pair_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_graph, "EXTERNAL_DATA_BYTES", 1)  # treat every model as "large"
    out = tmp_path / "external"
    manifest = export_artifact(checkpoints["target"], out, options=ExportOptions(capacity=96))
    assert set(manifest.files) == {"target.onnx", "target.onnx.data", "tokenizer.json"}
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False)
    external = [t for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(e.value == "target.onnx.data" for t in external for e in t.external_data if e.key == "location")
    ids = np.array([[5, 6, 7, 8]])
    outside, inline = Pipeline.load(out).target, Pipeline.load(pair_dir).target
    got = outside.infer(ids, np.zeros(1, np.int64), outside.allocate_cache(1, 8)).logits
    want = inline.infer(ids, np.zeros(1, np.int64), inline.allocate_cache(1, 8)).logits
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert tiny.read_json(out / "manifest.json")["files"]["target.onnx.data"]


def test_isolated_export_in_a_child_process_matches(checkpoints, pair_dir, tmp_path):
    """Large checkpoints are traced in a child process; the artifact is the same, errors still clear."""
    import pytest

    from specdeploy.exporter import ExportError

    messages = []
    manifest = export_artifact(checkpoints["target"], tmp_path / "child", options=ExportOptions(capacity=96, isolate=True),
                               progress=messages.append)
    assert any("exporting to ONNX" in m for m in messages)  # progress relayed from the child
    assert manifest.target.parameters > 0 and manifest.target.architecture == "llama"
    ids = np.array([[5, 6, 7]])
    got, want = Pipeline.load(tmp_path / "child").target, Pipeline.load(pair_dir).target
    np.testing.assert_allclose(got.infer(ids, np.zeros(1, np.int64), got.allocate_cache(1, 4)).logits,
                               want.infer(ids, np.zeros(1, np.int64), want.allocate_cache(1, 4)).logits, atol=1e-6)
    with pytest.raises(ExportError, match="capacity 5000 exceeds the model's max_position_embeddings 256"):
        export_artifact(checkpoints["target"], tmp_path / "bad", options=ExportOptions(capacity=5000, isolate=True))
    assert not (tmp_path / "bad").exists()
