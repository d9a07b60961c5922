"""Model folders as onnxruntime-genai's builder and optimum's exporter write them, built from tiny random checkpoints
once per run (``build``, which the ``foreign`` fixture of tests/conftest.py calls under a file lock shared by the xdist
workers), each tool's own greedy output for PROMPTS, and the artifacts ``specdeploy import`` makes of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiny

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(__file__).parent / "importer" / "peers.py"
# optimum-onnx needs transformers < 5: its own venv, which `make test` makes (Makefile, OPTIMUM_VENV)
OPTIMUM_PYTHON = Path(os.environ.get("SPECDEPLOY_OPTIMUM_PYTHON", ROOT / "build" / "optimum-venv" / "bin" / "python"))
NEW_TOKENS = 24
CAPACITY = 96
PROMPTS = [[1, 5, 9, 33, 17, 8, 90, 4], [1, 40, 41, 42], [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 11, 12]]
# name -> (checkpoint, tool, precision): the folders the tests import
FOLDERS = {
    "genai-llama": ("llama", "genai", "fp32"), "genai-llama-int4": ("llama", "genai", "int4"),
    "genai-llama-draft": ("llama-draft", "genai", "fp32"), "genai-qwen3": ("qwen3", "genai", "fp32"),
    "genai-qwen3-int4": ("qwen3", "genai", "int4"), "genai-gpt_oss": ("gpt_oss", "genai", "fp32"),
    "genai-gpt_oss-int4": ("gpt_oss", "genai", "int4"),
    "optimum-llama": ("llama", "optimum", "fp32"), "optimum-llama-draft": ("llama-draft", "optimum", "fp32"),
    "optimum-qwen3": ("qwen3", "optimum", "fp32"),
}
# artifact -> (target folder, draft folder or None)
ARTIFACTS = {
    "genai-llama": ("genai-llama", "genai-llama-draft"), "genai-llama-int4": ("genai-llama-int4", None),
    "genai-qwen3": ("genai-qwen3", None), "genai-qwen3-int4": ("genai-qwen3-int4", None),
    "genai-gpt_oss": ("genai-gpt_oss", None), "genai-gpt_oss-int4": ("genai-gpt_oss-int4", None),
    "optimum-llama": ("optimum-llama", "optimum-llama-draft"), "optimum-qwen3": ("optimum-qwen3", None),
}


def _checkpoints(root: Path) -> dict[str, Path]:
    """Tiny llama (a target and a perturbed copy as its draft) and qwen3 (q/k norms: a family the exporter does not
    take) checkpoints; head_dim 16, the least GroupQueryAttention rotates, and hidden_size / heads (optimum's generate
    makes its first, empty past from that quotient, whatever head_dim says). A gpt-oss mixture of experts with its
    experts in MXFP4, as gpt-oss checkpoints store them (onnxruntime-genai's int4 build reads them), head_dim 64 and
    its own YaRN (the builder's YaRN asserts corrections a smaller head or a shorter context does not meet)."""
    from transformers import Qwen3Config

    target = tiny.build_model(tiny.llama_config(hidden_size=64), seed=0)
    draft = tiny.build_model(tiny.llama_config(hidden_size=64), seed=1, perturb_from=target, noise=0.05)
    qwen3 = tiny.build_model(Qwen3Config(vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                         max_position_embeddings=256, eos_token_id=tiny.EOS, bos_token_id=1,
                                         tie_word_embeddings=False), seed=3)
    gpt_oss = tiny.build_model(tiny.llama_config("gpt_oss", hidden_size=64, head_dim=64, num_local_experts=4,
                                                 num_experts_per_tok=2, intermediate_size=64, sliding_window=4,
                                                 max_position_embeddings=131072), seed=3)
    saved = {name: tiny.save_checkpoint(model, root / f"{name}-hf")
             for name, model in (("llama", target), ("llama-draft", draft), ("qwen3", qwen3))}
    return saved | {"gpt_oss": tiny.save_mxfp4_checkpoint(gpt_oss, root / "gpt_oss-hf")}


def _start_peer(tool: str, python: Path, job: dict, root: Path) -> subprocess.Popen:
    """The tool's peers.py run on ``job``, its output to files (a pipe left unread would stall it)."""
    job_path = root / f"{tool}-job.json"
    job_path.write_text(json.dumps(job))
    with open(root / f"{tool}.log", "w") as log:
        return subprocess.Popen([str(python), str(PEERS), tool, str(job_path), str(root / f"{tool}-out.json")],
                                stdout=log, stderr=subprocess.STDOUT)


def _finish_peer(tool: str, process: subprocess.Popen, root: Path) -> dict:
    process.wait()
    assert process.returncode == 0, f"{tool} peer failed:\n{(root / f'{tool}.log').read_text()[-3000:]}"
    return json.loads((root / f"{tool}-out.json").read_text())["generated"]


def build(root: Path) -> dict:
    """Build every folder of FOLDERS under ``root``, import ARTIFACTS under ``root / "artifacts"``; return the tools'
    own greedy outputs, folder name -> one list of token ids per prompt."""
    for leftover in root.iterdir():  # an earlier run's that failed half-way
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    checkpoints = _checkpoints(root)
    if not OPTIMUM_PYTHON.is_file():
        pytest.fail(f"{OPTIMUM_PYTHON}: no optimum venv; `make optimum-venv` makes it (or set SPECDEPLOY_OPTIMUM_PYTHON)")
    # both tools at once: the worker that builds this holds the others that need it (a file lock), so the build's
    # wall time is theirs too; each tool's process is one core's work
    started = {}
    for tool, python in (("genai", Path(sys.executable)), ("optimum", OPTIMUM_PYTHON)):
        folders = {name: spec for name, spec in FOLDERS.items() if spec[1] == tool}
        job = {"builds": [[str(checkpoints[ckpt]), str(root / name), precision] for name, (ckpt, _, precision)
                          in folders.items()],
               "generate": [[str(root / name), PROMPTS, NEW_TOKENS] for name in folders if not name.endswith("draft")]}
        started[tool] = _start_peer(tool, python, job, root)
    references = {}
    try:
        for tool, process in started.items():
            generated = _finish_peer(tool, process, root)
            references |= {Path(folder).name: outputs for folder, outputs in generated.items()}
    finally:
        for process in started.values():  # the other tool's, where one failed
            if process.poll() is None:
                process.kill()
                process.wait()
    for name, (target, draft) in ARTIFACTS.items():
        import_cli(root / "artifacts" / name, root / target, None if draft is None else root / draft)
    return references


def import_cli(out: Path, source: Path, draft: Path | None = None, *extra: str):
    """``specdeploy import`` through the CLI, as a user runs it; the click result."""
    from click.testing import CliRunner

    from specdeploy.cli import main

    args = ["import", str(source), "--out", str(out), "--capacity", str(CAPACITY), *extra]
    if draft is not None:
        args += ["--draft", str(draft)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result
