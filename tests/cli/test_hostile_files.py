"""What sits where an artifact's files should be: FIFOs, devices, directories, unreadable files. Every reader
answers at once, in one line; nothing blocks, nothing reads without end."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading

import pytest
from click.testing import CliRunner

from specdeploy import Pipeline
from specdeploy.cli import main
from specdeploy.contract import ContractError

WITHIN = 60  # seconds a command may take here; the hangs this guards against never end


def _within(work, seconds: float = WITHIN):
    """``work()``'s result, or a failure if it has not returned in ``seconds`` (a FIFO opened for reading blocks
    forever; the thread is a daemon, left behind)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = work()
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: it blocked or read without end"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run(*args):
    return _within(lambda: CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": "1000"}))


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _zero(path):
    path.unlink()
    path.symlink_to("/dev/zero")


def _directory(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("name", ["manifest.json", "tokenizer.json", "target.onnx"])
@pytest.mark.parametrize("replace", [_fifo, _zero, _directory], ids=["fifo", "dev-zero", "directory"])
def test_non_regular_files_get_one_line_and_never_block(pair_dir, tmp_path, name, replace):
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    replace(art / name)
    kind = {_fifo: "a FIFO", _zero: "a character device", _directory: "a directory"}[replace]
    for args in (["inspect", art], ["inspect", art, "--json"], ["doctor", art], ["generate", art, "--prompt", "w5"]):
        result = run(*args)
        # inspect lists what it finds (exit 0); the others refuse the artifact in one line (exit 1)
        if name == "manifest.json" or args[0] != "inspect":
            assert result.exit_code == 1, (args, result.output[-500:], repr(result.exception))
            assert isinstance(result.exception, SystemExit), (args, repr(result.exception))
        else:
            assert result.exit_code == 0, (args, result.output[-500:], repr(result.exception))
        if name == "manifest.json":
            assert f"{kind}; expected a regular file" in result.output, (args, result.output[-500:])
    if name != "manifest.json":
        shown = json.loads(run("inspect", art, "--json").output)
        assert shown["file_sizes"][name] is None and kind in shown["unreadable_files"][name]
    with pytest.raises(ContractError, match=f"^{re.escape(str(art / name))}: {kind}; expected a regular file$"):
        _within(lambda: Pipeline.load(art, verify_hashes=False))


def _refusing(monkeypatch, *names):
    """Every open of a file called one of ``names`` fails as for a file one may not read. chmod 000 does not stop
    root, who runs these tests; every reader of artifact files opens them through ``specdeploy.files``."""
    real_open = os.open

    def refuse(path, flags, *rest, **named):
        if os.path.basename(path) in names:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *rest, **named)

    monkeypatch.setattr(os, "open", refuse)


def test_unreadable_files_get_one_line(pair_dir, tmp_path, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    _refusing(monkeypatch, "tokenizer.json", "target.onnx")
    # inspect lists what it can read and names what it cannot (exit 0); doctor and generate refuse (exit 1, one line)
    for args, code in ((["inspect", art], 0), (["doctor", art], 1), (["generate", art, "--prompt", "w5"], 1)):
        result = run(*args)
        assert result.exit_code == code, (args, result.output[-500:], repr(result.exception))
        assert code == 0 or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert "tokenizer.json: cannot be read (PermissionError: Permission denied)" in run("doctor", art).output
    assert "tokenizer.json: cannot be read (PermissionError: Permission denied)" in run("generate", art, "--prompt", "w5").output
    _refusing(monkeypatch, "manifest.json")
    for args in (["inspect", art], ["doctor", art], ["generate", art, "--prompt", "w5"]):
        result = run(*args)
        assert result.exit_code == 1 and "manifest.json: cannot be read (PermissionError" in result.output, args
        assert isinstance(result.exception, SystemExit), (args, repr(result.exception))


def test_inspect_refuses_a_manifest_naming_files_outside_the_artifact(pair_dir, tmp_path):
    """inspect --json used to report the size of any file a manifest named (``/etc/passwd``, ``../x``)."""
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["/etc/passwd"] = "0" * 64
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run("inspect", art, "--json")
    assert result.exit_code == 1 and "files: file '/etc/passwd' must be a plain file name" in result.output
    assert "file_sizes" not in result.output


def test_a_prompt_file_may_be_a_stream(pair_dir, tmp_path):
    """``--prompt-file /dev/stdin`` used to be refused as "no such file": a stream is read to its end."""
    import subprocess
    import sys
    from pathlib import Path

    import specdeploy

    args = [sys.executable, "-m", "specdeploy.cli", "generate", str(pair_dir), "--prompt-file", "/dev/stdin",
            "--max-new-tokens", "3", "--drafter", "none", "--json"]
    done = subprocess.run(args, input="w5 w6\nw7 w8\n", capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(specdeploy.__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-500:]
    assert len([line for line in done.stdout.splitlines() if line.startswith("{")]) == 2
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("w5 w6\n"), daemon=True)
    writer.start()
    result = run("generate", pair_dir, "--prompt-file", fifo, "--max-new-tokens", "3", "--drafter", "none", "--json")
    assert result.exit_code == 0, result.output
    zero = run("generate", pair_dir, "--prompt-file", "/dev/zero", "--max-new-tokens", "3")
    assert zero.exit_code == 1 and "/dev/zero: more than 67,108,864 bytes" in zero.output


def test_inspect_summarises_a_manifest_of_many_files(pair_dir, tmp_path):
    """100,000 listed files (missing here) fill 50 rows and a count, not megabytes; --json lists them all."""
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"] |= {f"gone-{i:06d}.bin": "0" * 64 for i in range(100_000)}
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run("inspect", art)
    assert result.exit_code == 0 and "… and 99,953 more" in result.output and len(result.output) < 50_000
    assert len(json.loads(run("inspect", art, "--json").output)["file_sizes"]) == 100_003


def test_inspect_names_a_graph_it_cannot_read_and_doctor_advises_permissions_not_a_re_export(pair_dir, tmp_path,
                                                                                              monkeypatch):
    """inspect dropped an unreadable graph from its table without a word; doctor told a user who may not read a file
    to re-export the artifact."""
    art = tmp_path / "art"
    shutil.copytree(pair_dir, art)
    _refusing(monkeypatch, "draft.onnx")
    shown = run("inspect", art)
    assert "draft.onnx: cannot be read (PermissionError: Permission denied)" in shown.output
    assert "cannot read draft.onnx" in shown.output and "1 listed files cannot be read" in shown.output
    listed = json.loads(run("inspect", art, "--json").output)
    assert "PermissionError" in listed["unreadable_files"]["draft.onnx"] and "draft" not in listed["graphs"]
    doctor = run("doctor", art)
    assert doctor.exit_code == 1 and "draft.onnx: cannot be read (PermissionError" in doctor.output
    said = " ".join(doctor.output.split())
    assert "make it readable by the user running specdeploy" in said and "the file changed after export" not in said
    monkeypatch.undo()
    (art / "draft.onnx").write_bytes(b"not a graph")
    shown = run("inspect", art)
    assert shown.exit_code == 0 and "cannot read draft.onnx: not a readable ONNX graph" in " ".join(shown.output.split())
