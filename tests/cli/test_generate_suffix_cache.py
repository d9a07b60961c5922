"""CLI: specdeploy generate --suffix-cache keeps the texts a later run drafts from, and survives a broken file."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.runtime.suffix_store import FORMAT


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_run_keeps_its_texts_and_the_next_one_drafts_from_them(pair_dir, tmp_path):
    cache = tmp_path / "suffix.json"
    options = ["--max-new-tokens", "12", "--drafter", "suffix", "--policy", "fixed", "--k", "4", "--ignore-eos", "--json"]
    first = run("generate", pair_dir, "--prompt", "w70 w71 w72", *options, "--suffix-cache", cache)
    assert first.exit_code == 0, first.output
    saved = json.loads(cache.read_text())
    assert saved["format"] == FORMAT and sum(map(len, saved["scopes"].values())) == 1
    second = run("generate", pair_dir, "--prompt", "w70 w71 w72", *options, "--suffix-cache", cache)
    assert second.exit_code == 0, second.output
    a, b = (json.loads(r.output.splitlines()[-1]) for r in (first, second))
    assert a["token_ids"] == b["token_ids"]
    assert b["stats"]["cycles"] < a["stats"]["cycles"]  # the first run's answer drafted the second's
    assert sum(map(len, json.loads(cache.read_text())["scopes"].values())) == 2


def test_a_corrupt_cache_is_one_warning_and_the_run_goes_on(pair_dir, tmp_path):
    cache = tmp_path / "suffix.json"
    cache.write_text('{"format": "specdeploy.suffix-index", "version": 1, "tokenizer": "someone else\'s"}')
    result = run("generate", pair_dir, "--prompt", "w5 w6", "--max-new-tokens", "4", "--json", "--suffix-cache", cache)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "another tokenizer" in warnings[0] and str(cache) in warnings[0]
    assert json.loads(cache.read_text())["tokenizer"] != "someone else's"  # replaced by this run's, atomically
