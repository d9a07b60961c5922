"""tools/bench_verify_cost.py: one call timed per token count on an artifact's models, and the re-quantized variants
of an fp32 target it times are graphs of the kind named that compute the contract's logits."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from specdeploy.contract import Manifest
from specdeploy.engines import OrtEngine
from tools import bench_verify_cost

ROOT = Path(__file__).resolve().parents[2]


def test_one_call_is_timed_per_token_count_after_half_the_capacity(pair_dir):
    spec = Manifest.read(pair_dir).target
    engine = OrtEngine(pair_dir / spec.file, spec, threads=1)
    calls = []
    infer = engine.infer
    engine.infer = lambda ids, past, cache: calls.append((ids.shape, int(past[0]))) or infer(ids, past, cache)
    medians = bench_verify_cost.measure(engine, 64, [1, 5, 9], repeats=3)
    assert list(medians) == [1, 5, 9] and all(m > 0 for m in medians.values())
    # one warm-up call per count, then the counts interleaved each repeat, all after a past of 32
    assert calls == [((1, t), 32) for t in (1, 5, 9)] * 4


@pytest.mark.parametrize("variant, op", [("int4-b32-a4", "MatMulNBits"), ("int8-b32-a0", "MatMulNBits"),
                                         ("dyn8", "MatMulInteger")])
def test_a_variant_of_the_fp32_target_is_that_quantization_and_runs(pair_dir, tmp_path, variant, op):
    spec = Manifest.read(pair_dir).target
    path = bench_verify_cost.quantized_variant(pair_dir / spec.file, variant, tmp_path)
    ops = {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}
    assert op in ops
    engine = OrtEngine(path, dataclasses.replace(spec, weights="int4"), threads=1)
    cache = engine.allocate_cache(1, 16)
    out = engine.infer(np.array([[5, 6, 7]], np.int64), np.array([0], np.int64), cache)
    assert out.logits.shape == (1, 3, spec.vocab_size) and np.isfinite(out.logits).all()


def test_the_tool_times_both_models_of_an_artifact(pair_dir):
    done = subprocess.run([sys.executable, "-m", "tools.bench_verify_cost", "--artifact", str(pair_dir), "--capacity", "64",
                           "--repeats", "2", "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    timed = sorted(line.split()[0] for line in done.stdout.splitlines()[1:])
    assert timed == ["draft", "target"]


def test_a_ragged_verification_is_timed_padded_and_at_each_rows_width(fused_dirs):
    spec = Manifest.read(fused_dirs["close"]).target
    engine = OrtEngine(fused_dirs["close"] / spec.file, spec, threads=1)
    shapes, run = [], engine.infer_impl
    engine.infer_impl = lambda ids, *args: shapes.append(ids.shape) or run(ids, *args)
    medians = bench_verify_cost.measure_ragged(engine, 64, 5, repeats=2)
    assert list(medians) == ["one token a row", "5 tokens a row", "rows of 5 and 1, padded", "rows of 5 and 1, widths"]
    assert all(m > 0 for m in medians.values())
    # per round: one batched call of a token a row; the fused form's rows alone, padded twice, then 5 and 1
    assert shapes == [(2, 1), (1, 5), (1, 5), (1, 5), (1, 5), (1, 5), (1, 1)] * 3


def test_ragged_needs_an_artifact():
    done = subprocess.run([sys.executable, "-m", "tools.bench_verify_cost", "--ragged"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--ragged: times an artifact's target; give --artifact" in done.stderr
