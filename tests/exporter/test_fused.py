"""The fused form's compressed weights are the explicit form's, and what it cannot take is refused clearly.

Parity against transformers (every architecture, ragged past, garbage in unused slots) is in test_parity;
greedy and sampled losslessness in tests/runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from specdeploy.exporter.fused import FusedGraph
from tests import tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny.llama_config(hidden_size=64, intermediate_size=128)  # int4 blocks of 32: two per column
    return tiny.save_checkpoint(tiny.build_model(config, seed=5, conditioned=True), tmp_path_factory.mktemp("f") / "ckpt")


def _logits(directory, ids):
    manifest = Manifest.read(directory)
    engine = load_engine(directory, manifest, "target")
    cache = engine.allocate_cache(1, ids.shape[1] + 1)
    return engine.infer(ids, np.zeros(1, np.int64), cache).logits


@pytest.mark.parametrize("options,op", [(["--weights", "int4"], "MatMulNBits"), (["--weights", "int8"], "MatMulInteger"),
                                        (["--dtype", "float16"], "MatMul")])
def test_compressed_fused_graph_computes_what_the_explicit_one_does(checkpoint, tmp_path, options, op):
    """int4 weights quantized as the fused graph is written are ONNX Runtime's quantizer's own values (and
    int8 / fp16 reuse the explicit form's rewrites), so both forms agree to rounding."""
    ids = np.random.default_rng(0).integers(0, tiny.VOCAB, (1, 12))
    explicit = _logits(tiny.export_cli(tmp_path / "explicit", checkpoint, None, *options), ids)
    fused_dir = tiny.export_cli(tmp_path / "fused", checkpoint, None, "--graph", "fused", *options)
    fused = _logits(fused_dir, ids)
    tolerance = (3e-2 if "float16" in options else 2e-3) * np.abs(explicit).max()
    assert np.abs(fused - explicit).max() <= tolerance
    ops = {node.op_type for node in onnx.load(str(fused_dir / "target.onnx")).graph.node}
    assert op in ops and "GroupQueryAttention" in ops
    if op != "MatMul":
        assert "MatMul" not in ops  # every weight compressed, lm_head included


def test_head_dim_the_fused_rotary_cannot_take_is_refused(tmp_path):
    ckpt = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(), seed=0), tmp_path / "ckpt")  # head_dim 8
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["export", "--target", str(ckpt), "--out", str(tmp_path / "art"), "--graph", "fused"])
    assert result.exit_code != 0
    assert "head_dim to be a multiple of 16" in result.output and "got 8" in result.output and "--graph explicit" in result.output
    assert not (tmp_path / "art").exists()


def test_the_fused_writer_reports_each_quarter_of_the_layers(tmp_path):
    messages = []
    graph = FusedGraph(tmp_path / "m.onnx", {"num_layers": 28, "kv_heads": 2, "head_dim": 16, "vocab_size": 10},
                       progress=messages.append)
    for layer in range(28):
        graph.layer_written(layer)
    graph.data.close()
    assert messages == [f"{n}/28 layers written" for n in (7, 14, 21, 28)]
