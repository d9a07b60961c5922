"""tools/bench_exactness.py: the same positions computed one token a call and several, compared as the tool reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from tools import bench_exactness

ROOT = Path(__file__).resolve().parents[2]


def test_the_comparison_reports_the_logit_change_the_margins_move_and_the_top_tokens_changed():
    one = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.9], [5.0, 0.0, 4.0]])
    other = one.copy()
    other[1, 2] += 0.3  # position 1: the margin 0.1 moves by 0.3, and the top token changes
    other[2, 1] -= 0.5  # position 2: a logit off the top two moves; the margin does not
    found = bench_exactness.compare(one, other)
    assert found == {"positions": 3, "max_logit_change": pytest.approx(0.5), "margin_move_max": pytest.approx(0.3),
                     "margin_move_median": pytest.approx(0.0), "top_token_changed": 1}


def test_an_fp32_targets_verification_gives_plain_decodings_logits(fused_dirs):
    """The tiny fused fp32 target: a call of 5 tokens computes each position as calls of one do (to float rounding),
    so no top token changes; the positions are the text's after the prompt."""
    pipeline = Pipeline.load(fused_dirs["close"])
    ids = pipeline.encode("w5 w6 w7 w8 w9").tolist()
    sequence = ids + pipeline.generate([ids], GenerationConfig(drafter="none", max_new_tokens=12))[0].token_ids
    one = bench_exactness.logits_by_call(pipeline.target, sequence, len(ids) - 1, 1, len(sequence) + 8)
    five = bench_exactness.logits_by_call(pipeline.target, sequence, len(ids) - 1, 5, len(sequence) + 8)
    assert one.shape == (len(sequence) - len(ids), pipeline.target.spec.vocab_size)
    assert one.argmax(axis=1).tolist() == sequence[len(ids):]  # the positions are plain decoding's, token for token
    found = bench_exactness.compare(one, five)
    assert found["top_token_changed"] == 0 and found["max_logit_change"] < 1e-3


@pytest.mark.parametrize("artifact, args, message", [
    ("close", ["--sizes", "1,5"], "expected a comma list of sizes >= 2"),
    ("close", ["--sizes", "five"], "expected a comma list of sizes >= 2"),
    ("close", ["--specbench", "81"], "each group has 80"),
    ("none", [], "no manifest"),
])
def test_bad_options_and_artifacts_are_refused_in_one_line(fused_dirs, tmp_path, artifact, args, message):
    directory = fused_dirs[artifact] if artifact in fused_dirs else tmp_path
    done = subprocess.run([sys.executable, "-m", "tools.bench_exactness", "--artifact", str(directory), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
