"""``export --out DIR --force``: replaces only what specdeploy wrote, in one step, and leaves nothing behind."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from specdeploy import output
from specdeploy.cli import main
from tests import tiny


def export(ckpt, out, *extra):
    """At the capacity conftest's pairs have: the same trace (tests/traces.py); a replacement differs in its weights."""
    return CliRunner().invoke(main, ["export", "--target", str(ckpt), "--out", str(out), "--capacity", "96", *extra])


@pytest.fixture(scope="module")
def ckpt(checkpoints):
    return checkpoints["target"]


def _tree(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_a_web_apps_manifest_is_not_an_artifact(ckpt, tmp_path):
    """A folder holding a file named manifest.json used to count as an artifact, and lose its other files."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text(json.dumps({"name": "My App", "start_url": "/", "files": {}}))
    (app / "index.html").write_text("<html></html>")
    before = _tree(tmp_path)
    result = export(ckpt, app, "--force")
    assert result.exit_code == 1 and "or not one `specdeploy export` wrote (contract 'verify-v1')" in result.output
    assert _tree(tmp_path) == before and (app / "index.html").read_text() == "<html></html>"


def test_user_files_inside_an_artifact_are_never_deleted(ckpt, tmp_path):
    art = tmp_path / "art"
    assert export(ckpt, art).exit_code == 0
    (art / "notes.txt").write_text("what I measured")
    (art / "runs").mkdir()
    result = export(ckpt, art, "--force")
    assert result.exit_code == 1 and "holds files specdeploy did not write (notes.txt, runs)" in result.output
    assert (art / "notes.txt").read_text() == "what I measured" and (art / "target.onnx").is_file()
    assert isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_an_artifact_is_replaced_and_nothing_stays_behind(ckpt, tmp_path, monkeypatch, exchange):
    art = tmp_path / "art"
    assert export(ckpt, art).exit_code == 0
    if not exchange:  # a system without renameat2: the artifact is moved aside, then removed
        monkeypatch.setattr(output, "_exchange", lambda first, second: False)
    user_old = tmp_path / ".art.old"  # a user's folder that happens to have the name older exporters used
    user_old.mkdir()
    (user_old / "keep.txt").write_text("mine")
    result = export(ckpt, art, "--force", "--weights", "int8")
    assert result.exit_code == 0, result.output
    assert tiny.read_json(art / "manifest.json")["models"]["target"]["weights"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".art.old", "art"]  # no staging, no replaced artifact
    assert (user_old / "keep.txt").read_text() == "mine"


def test_an_out_symlink_writes_through_the_link(ckpt, tmp_path):
    """The artifact the link points to is replaced; the link stays and points to the new one (no .link.old)."""
    real = tmp_path / "store" / "art-v1"
    real.parent.mkdir()
    assert export(ckpt, real).exit_code == 0
    link = tmp_path / "current"
    link.symlink_to(real)
    result = export(ckpt, link, "--force", "--weights", "int8")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert tiny.read_json(link / "manifest.json")["models"]["target"]["weights"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "store"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["art-v1"]
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    result = export(ckpt, dangling)
    assert result.exit_code == 1 and "a symlink to" in result.output and "which does not exist" in result.output


@pytest.mark.parametrize("out", [".", "..", "./"])
def test_out_as_the_current_directory_is_refused_in_one_line(ckpt, tmp_path, monkeypatch, out):
    art = tmp_path / "art"
    assert export(ckpt, art).exit_code == 0
    before = _tree(tmp_path)
    monkeypatch.chdir(art)
    result = export(ckpt, out, "--force")
    assert result.exit_code == 1 and "the current directory, or one that holds it" in result.output
    assert isinstance(result.exception, SystemExit) and _tree(tmp_path) == before


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "x").write_text("first")
    (second / "y").write_text("second")
    if not output._exchange(first, second):
        pytest.skip("this kernel or filesystem has no renameat2(RENAME_EXCHANGE)")
    assert (first / "y").read_text() == "second" and (second / "x").read_text() == "first"


def test_a_replaced_artifact_left_by_a_killed_export_is_removed_next_time(ckpt, tmp_path):
    """An export killed after swapping leaves the previous artifact at a staging name, marked with its .pid."""
    left = tmp_path / ".art.k1ll3d"
    left.mkdir()
    (left / "manifest.json").write_text("{}")
    (left / ".pid").write_text("999999999")
    assert export(ckpt, tmp_path / "art").exit_code == 0
    assert not left.exists() and os.listdir(tmp_path) == ["art"]


def _one_line(result) -> str:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert len([line for line in lines if line.startswith("Error:")]) == 1 and "Traceback" not in result.output
    return lines[-1]


def test_out_paths_the_filesystem_refuses_are_one_line_and_leave_nothing(ckpt, tmp_path, monkeypatch):
    """A symlink loop, a path under a regular file and a directory one may not write used to end in tracebacks."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "cannot be followed" in _one_line(export(ckpt, loop, "--force"))
    (tmp_path / "notes.txt").write_text("mine")
    assert "notes.txt is a file, not a directory" in _one_line(export(ckpt, tmp_path / "notes.txt" / "art"))
    monkeypatch.setattr(output.os, "access", lambda path, mode: False)  # as a user without write access sees it
    assert "cannot write in" in _one_line(export(ckpt, tmp_path / "sub" / "art"))
    monkeypatch.undo()
    real_mkdtemp = output.tempfile.mkdtemp

    def refused(*args, **kwargs):  # what no check foresees: the filesystem refuses at the moment of writing
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(output.tempfile, "mkdtemp", refused)
    assert "Permission denied (PermissionError); nothing was written" in _one_line(export(ckpt, tmp_path / "art"))
    monkeypatch.setattr(output.tempfile, "mkdtemp", real_mkdtemp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "notes.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_new_artifact_has_the_permissions_the_umask_gives(ckpt, tmp_path, umask):
    """A staging directory is made 0700, and it used to become the artifact so: a service account could not load it."""
    before = os.umask(umask)
    try:
        assert export(ckpt, tmp_path / "art").exit_code == 0
        assert export(ckpt, tmp_path / "art", "--force", "--weights", "int8").exit_code == 0
    finally:
        os.umask(before)
    assert (tmp_path / "art").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "art" / "manifest.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_replaced_artifact_that_cannot_be_removed_now_fails_nothing_and_goes_next_time(ckpt, tmp_path, monkeypatch):
    """The export succeeded, and used to report failure and leave the old artifact as a hidden directory for good."""
    art = tmp_path / "art"
    assert export(ckpt, art).exit_code == 0
    real_remove = output._remove

    def refused(directory):
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(output, "_remove", refused)
    with pytest.warns(UserWarning, match="could not be removed .*the next export to .* removes it"):
        result = export(ckpt, art, "--force", "--weights", "int8")
    assert result.exit_code == 0, result.output
    assert tiny.read_json(art / "manifest.json")["models"]["target"]["weights"] == "int8"
    left = [p.name for p in tmp_path.iterdir() if p.name != "art"]
    assert left == [f".art.replaced-{os.getpid()}"]
    monkeypatch.setattr(output, "_remove", real_remove)
    assert export(ckpt, art, "--force").exit_code == 0
    assert os.listdir(tmp_path) == ["art"]


def test_a_read_only_replaced_artifact_is_removed(tmp_path):
    old = tmp_path / "old"
    (old / "sub").mkdir(parents=True)
    (old / "sub" / "target.onnx").write_text("x")
    (old / "sub").chmod(0o555)
    old.chmod(0o555)
    output.discard(old, tmp_path / "art")
    assert os.listdir(tmp_path) == []
