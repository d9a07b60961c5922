"""Large models keep their weights as ONNX external data; the artifact stays self-contained."""

from __future__ import annotations

import numpy as np
import onnx

from specdeploy import Pipeline
from specdeploy.exporter import export_artifact, onnx_graph
from tests import tiny


def test_external_data_export_loads_and_matches(checkpoints, pair_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_graph, "EXTERNAL_DATA_BYTES", 1)  # treat every model as "large"
    out = tmp_path / "external"
    manifest = export_artifact(checkpoints["target"], out, capacity=96)
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
