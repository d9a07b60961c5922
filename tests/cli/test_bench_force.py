"""``bench --out DIR --force``: replaces what bench (and report) wrote, recognised by what it is, not by names alone."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdeploy.cli import main


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("w5 w6\n")
    return path


def bench(pair_dir, prompts, out, *extra):
    return CliRunner().invoke(main, ["bench", str(pair_dir), "--prompts", str(prompts), "--k", "0,1",
                                     "--max-new-tokens", "3", "--out", str(out), *extra])


def test_files_with_bench_names_that_bench_did_not_write_are_kept(pair_dir, prompts, tmp_path):
    """A user's records.jsonl and report.md used to be deleted because of their names."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "records.jsonl").write_text('{"patient": 1, "visit": "2024-01-02"}\n')
    (mine / "report.md").write_text("# my report")
    result = bench(pair_dir, prompts, mine, "--force")
    assert result.exit_code == 1 and "not a bench output directory" in result.output
    assert (mine / "report.md").read_text() == "# my report" and "patient" in (mine / "records.jsonl").read_text()


def test_a_bench_directory_is_replaced_through_a_symlink_and_in_place(pair_dir, prompts, tmp_path, monkeypatch):
    real = tmp_path / "runs" / "bench-1"
    assert bench(pair_dir, prompts, real).exit_code == 0
    first = json.loads((real / "records.jsonl").read_text().splitlines()[0])
    assert first["type"] in ("cycle", "run")
    link = tmp_path / "latest"
    link.symlink_to(real)
    result = bench(pair_dir, prompts, link, "--force")  # rmtree refused the link: a traceback, and nothing replaced
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and sorted(p.name for p in real.iterdir()) == ["records.jsonl", "summary.json"]
    monkeypatch.chdir(real)
    result = bench(pair_dir, prompts, ".", "--force")  # the directory one stands in: its files replaced, it stays
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in real.iterdir()) == ["records.jsonl", "summary.json"]
    (real / "notes.txt").write_text("mine")
    result = bench(pair_dir, prompts, ".", "--force")
    assert result.exit_code == 1 and "not a bench output directory" in result.output and (real / "notes.txt").exists()
