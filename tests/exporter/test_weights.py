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
    """Numbers, not only top-1 agreement: rows of different content in one call (2 x 7 tokens)."""
    ids = np.random.default_rng(2).integers(0, tiny.VOCAB, (2, 7))
    reference = _logits(tiny.export_cli(tmp_path / "fp32", checkpoint), ids)
    int8 = _logits(tiny.export_cli(tmp_path / "int8", checkpoint, None, "--weights", "int8"), ids)
    error = np.linalg.norm(int8 - reference, axis=-1) / np.linalg.norm(reference, axis=-1)  # [batch, tokens]
    print(f"int8 relative logits error: max {error.max():.4f}, mean {error.mean():.4f}")
    assert error.max() < 0.05
