"""TensorRT plans from the verify-v1 graphs: profile logic and manifest facts.

The build test needs tensorrt_rtx (pip install tensorrt-rtx; `make test` installs it where the
wheel exists). TensorRT-RTX builds ahead of time without a GPU, which proves on a CPU-only
machine that every exported architecture parses and compiles under the project's profiles.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.contract import Manifest, verify_files
from specdeploy.engines.trt_build import BuildError, plan_profiles
from tests.exporter.cases import PARITY_CASES

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None or importlib.util.find_spec("tensorrt") is not None
needs_trt = pytest.mark.skipif(not HAS_RTX, reason="neither tensorrt nor tensorrt_rtx installs on this platform")


@pytest.fixture(scope="module")
def spec(pair_dir):
    return Manifest.read(pair_dir).target


def test_profiles_cover_verify_and_prefill(spec):
    verify, prefill = plan_profiles(spec, max_batch=4, max_draft=8, capacity=96, opt_capacity=64)
    assert (verify.batch, verify.tokens, verify.capacity) == ((1, 1, 4), (1, 9, 9), (1, 64, 96))
    assert (prefill.tokens, prefill.capacity) == ((1, 96, 96), (1, 64, 96))
    shapes = verify.shapes(spec)
    assert shapes["input_ids"] == ((1, 1), (1, 9), (4, 9))
    assert shapes["cache_value.1"] == ((1, 2, 1, 8), (1, 2, 64, 8), (4, 2, 96, 8))
    assert len(plan_profiles(spec, 1, 8, capacity=9)) == 1  # prefill fits in the verify range


def test_profile_planning_errors(spec):
    with pytest.raises(BuildError, match="--capacity 200 exceeds the exported capacity 96"):
        plan_profiles(spec, 1, 4, capacity=200)
    with pytest.raises(BuildError, match="max_batch >= 1"):
        plan_profiles(spec, 0, 4)


@needs_trt
@pytest.mark.parametrize("name", sorted(PARITY_CASES))
def test_every_architecture_builds_a_tensorrt_plan(exported_architecture, tmp_path, name):
    _, directory = exported_architecture(name)
    art = shutil.copytree(directory, tmp_path / "art")
    result = CliRunner().invoke(main, ["build", str(art), "--trt", "--max-batch", "2", "--max-draft", "4"])
    assert result.exit_code == 0, result.output
    manifest = Manifest.read(art)
    entry = manifest.engines["target"]
    assert (art / "target.plan").stat().st_size > 10_000 and (art / "timing.cache").is_file()
    assert entry["module"] in ("tensorrt", "tensorrt_rtx") and entry["tensorrt_version"]
    assert [p["name"] for p in entry["profiles"]] == ["verify", "prefill"] and entry["profiles"][0]["tokens"] == [1, 5, 5]
    assert verify_files(art, manifest) == []  # the plan and the timing cache are hashed into the manifest


@needs_trt
def test_fp16_flag_needs_an_fp16_graph_under_rtx(pair_dir, tmp_path):
    import importlib

    art = shutil.copytree(pair_dir, tmp_path / "art")
    result = CliRunner().invoke(main, ["build", str(art), "--trt", "--fp16"])
    if importlib.util.find_spec("tensorrt") is None:
        assert result.exit_code != 0 and "needs an artifact exported with --dtype float16" in result.output
    else:
        assert result.exit_code == 0, result.output


def test_a_fused_graph_is_refused_with_how_to_export_for_tensorrt(exported_architecture, tmp_path):
    _, directory = exported_architecture("llama", "fused")
    art = shutil.copytree(directory, tmp_path / "art")
    result = CliRunner().invoke(main, ["build", str(art), "--trt"])
    assert result.exit_code != 0 and "export with --graph explicit for TensorRT" in result.output
    assert not (art / "target.plan").exists()
