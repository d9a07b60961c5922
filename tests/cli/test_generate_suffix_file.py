"""CLI: specdeploy generate --suffix-file keeps the texts a later run drafts from, and survives a broken file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.runtime.suffix_store import FORMAT


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_run_keeps_its_texts_and_the_next_one_drafts_from_them(pair_dir, tmp_path):
    path = tmp_path / "suffix.json"
    options = ["--max-new-tokens", "12", "--drafter", "suffix", "--policy", "fixed", "--k", "4", "--ignore-eos", "--json"]
    first = run("generate", pair_dir, "--prompt", "w70 w71 w72", *options, "--suffix-file", path)
    assert first.exit_code == 0, first.output
    saved = json.loads(path.read_text())
    assert saved["format"] == FORMAT and sum(map(len, saved["scopes"].values())) == 1
    second = run("generate", pair_dir, "--prompt", "w70 w71 w72", *options, "--suffix-file", path)
    assert second.exit_code == 0, second.output
    a, b = (json.loads(r.output.splitlines()[-1]) for r in (first, second))
    assert a["token_ids"] == b["token_ids"]
    assert b["stats"]["cycles"] < a["stats"]["cycles"]  # the first run's answer drafted the second's
    assert sum(map(len, json.loads(path.read_text())["scopes"].values())) == 2


def test_a_corrupt_file_is_one_warning_and_the_run_goes_on(pair_dir, tmp_path):
    path = tmp_path / "suffix.json"
    path.write_text('{"format": "specdeploy.suffix-index", "version": 1, "tokenizer": "someone else\'s"}')
    result = run("generate", pair_dir, "--prompt", "w5 w6", "--max-new-tokens", "4", "--json", "--suffix-file", path)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "another tokenizer" in warnings[0] and str(path) in warnings[0]
    assert "will not be saved" in warnings[0]
    assert json.loads(path.read_text())["tokenizer"] == "someone else's"  # the user's file, left as it was


def _index(scopes, tokenizer="fp", vocab=100):
    return json.dumps({"format": FORMAT, "version": 1, "tokenizer": tokenizer, "vocab_size": vocab, "scopes": scopes})


@pytest.mark.parametrize("kind", ["prompts", "another artifact's", "oversized", "nested"])
def test_a_refused_file_is_left_as_it_was_and_the_run_says_its_index_will_not_be_saved(pair_dir, tmp_path, kind):
    """A prompts file named by mistake, another artifact's index, one larger than this run's bound (written under a
    larger one, or pretty-printed), one nested 2,000,000 deep: each is refused in one line and never overwritten at
    exit (they were replaced by this run's index)."""
    path = tmp_path / "suffix.json"
    content = {"prompts": '{"prompt": "w5 w6"}\n{"prompt": "w7 w8"}\n',
               "another artifact's": _index({"default": [[1, 2, 3]]}),
               "oversized": _index({"default": [[1] * 20]}).replace(",", ",  " * 10) + " " * (9 * 2**20),
               "nested": _index({})[:-3] + "{\"s\": " + "[" * 2_000_000 + "]" * 2_000_000 + "}}"}[kind]
    path.write_text(content)
    result = run("generate", pair_dir, "--prompt", "w5 w6", "--max-new-tokens", "4", "--json", "--suffix-file", path)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert path.read_text() == content and not list(tmp_path.glob(".*"))
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(path) in warnings[0] and "will not be saved" in warnings[0], result.output


def test_a_symlinked_file_is_written_through_and_stays_a_link(pair_dir, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    target, link = shared / "suffix.json", tmp_path / "suffix.json"
    link.symlink_to(target)
    options = ["--prompt", "w70 w71 w72", "--max-new-tokens", "6", "--drafter", "suffix", "--json"]
    for texts in (1, 2):
        result = run("generate", pair_dir, *options, "--suffix-file", link)
        assert result.exit_code == 0, result.output
        assert link.is_symlink() and sum(map(len, json.loads(target.read_text())["scopes"].values())) == texts
