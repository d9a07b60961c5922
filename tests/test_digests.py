"""Digests remembered per file identity: a load hashes an unchanged artifact once; any change is seen."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from specdeploy import Pipeline, digests
from specdeploy.contract import ContractError, Manifest, sha256_file, verify_files


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _no_hashing(monkeypatch):
    def refuse(path, chunk=1 << 20):
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(digests, "sha256_file", refuse)


def test_an_unchanged_file_is_hashed_once(tmp_path, cache, monkeypatch):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    assert digests.remembered_sha256(path) == sha256_file(path)
    _no_hashing(monkeypatch)
    assert digests.remembered_sha256(path) == sha256_file(path)


@pytest.mark.parametrize("change", ["rewritten in place", "replaced", "mtime set back"])
def test_a_changed_file_is_hashed_again(tmp_path, cache, change):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    before = digests.remembered_sha256(path)
    stat = path.stat()
    time.sleep(0.02)  # past the file system's timestamp tick
    if change == "replaced":
        (tmp_path / "other.bin").write_bytes(b"b" * 1000)
        (tmp_path / "other.bin").replace(path)
    else:
        with open(path, "r+b") as handle:  # same size, same inode
            handle.write(b"b")
        if change == "mtime set back":  # what a tamperer can do; ctime still moves on
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = digests.remembered_sha256(path)
    assert after == sha256_file(path) != before


def test_an_unreadable_or_unwritable_record_only_means_hashing(tmp_path, cache):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 100)
    cache.mkdir()
    (cache / digests.RECORD).write_text("{not json")
    assert digests.remembered_sha256(path) == sha256_file(path)
    assert json.loads((cache / digests.RECORD).read_text())[str(path.resolve())]["sha256"] == sha256_file(path)
    (cache / digests.RECORD).unlink()
    cache.chmod(0o500)
    try:
        if os.access(cache, os.W_OK):  # root writes anyway: a file in the record's place stands in
            cache.chmod(0o700)
            (cache / digests.RECORD).mkdir()
        assert digests.remembered_sha256(path) == sha256_file(path)
    finally:
        cache.chmod(0o700)


def test_loading_trusts_the_record_and_doctor_hashes_every_byte(pair_dir, tmp_path, cache, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    Pipeline.load(art)  # hashes and remembers
    recorded = json.loads((cache / digests.RECORD).read_text())
    assert {os.path.basename(p) for p in recorded} == set(Manifest.read(art).files)
    _no_hashing(monkeypatch)
    Pipeline.load(art)  # nothing hashed again
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(cache))
    # a record that lies (as if written by someone else) is trusted by a load, never by doctor's full check
    entry = recorded[str((art / "draft.onnx").resolve())]
    entry["sha256"] = "0" * 64
    (cache / digests.RECORD).write_text(json.dumps(recorded))
    with pytest.raises(ContractError, match="draft.onnx: sha256"):
        Pipeline.load(art)
    assert verify_files(art, Manifest.read(art)) == []


def test_a_graphs_external_data_locations_are_read_once_per_identity(pair_dir, tmp_path, cache, monkeypatch):
    """Parsing a graph with its weights inline takes seconds for a real draft: its locations are remembered."""
    import onnx

    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    Pipeline.load(art)
    real_load = onnx.load

    def refuse(path, *args, **kwargs):
        raise AssertionError(f"{path} was parsed again")

    monkeypatch.setattr(onnx, "load", refuse)
    Pipeline.load(art)  # neither graph parsed again
    monkeypatch.setattr(onnx, "load", real_load)
    graph = onnx.load(str(art / "draft.onnx"))
    tensor = graph.graph.initializer[0]  # now it points outside the manifest
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../elsewhere.bin")
    tensor.ClearField("raw_data")
    onnx.save(graph, str(art / "draft.onnx"))
    from specdeploy.engines import check_external_data

    with pytest.raises(ContractError, match="elsewhere.bin"):
        check_external_data(art / "draft.onnx", Manifest.read(art))
