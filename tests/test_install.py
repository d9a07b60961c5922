"""The core install, as the README's pip line gives it, runs an artifact without torch or transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdeploy import GenerationConfig, Pipeline

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_core_install_runs_an_artifact(pair_dir, foreign, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(ROOT)], capture_output=True,
                               text=True, timeout=900)
    assert installed.returncode == 0, installed.stderr[-2000:]
    python = str(venv / "bin" / "python")
    absent = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('transformers'))"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert absent.stdout.strip() == "None None"  # the core stays light: the export extra brings those
    ran = subprocess.run([str(venv / "bin" / "specdeploy"), "generate", str(pair_dir), "--prompt", "w5 w6 w7",
                          "--max-new-tokens", "6", "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    line = json.loads(next(x for x in ran.stdout.splitlines() if x.startswith("{")))
    assert line["token_ids"] == Pipeline.load(pair_dir).generate("w5 w6 w7", GenerationConfig(max_new_tokens=6))[0].token_ids

    # and imports a folder onnxruntime-genai's builder wrote, and runs it: neither tool is needed
    imported = tmp_path / "imported"
    done = subprocess.run([str(venv / "bin" / "specdeploy"), "import", str(foreign["folders"]["genai-llama"]), "--out",
                           str(imported), "--capacity", "96"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ran = subprocess.run([str(venv / "bin" / "specdeploy"), "generate", str(imported), "--prompt", "w5 w6 w7",
                          "--max-new-tokens", "6", "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    line = json.loads(next(x for x in ran.stdout.splitlines() if x.startswith("{")))
    expected = Pipeline.load(imported).generate("w5 w6 w7", GenerationConfig(max_new_tokens=6))[0].token_ids
    assert line["token_ids"] == expected and len(expected) > 0
