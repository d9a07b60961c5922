"""The tools refuse bad arguments in one line (tools/arguments.py): a missing artifact, a missing, corrupt, misshapen
or directory file, a count that is not one, an unknown mode; exit status 2, the argument named, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _files(tmp: Path) -> dict[str, Path]:
    corrupt, misshapen, prompts = tmp / "corrupt.json", tmp / "misshapen.json", tmp / "bad.jsonl"
    corrupt.write_text("{ half a file")
    misshapen.write_text(json.dumps({"traces": [{"output": "not a trace"}], "models": {}, "costs": {}}))
    prompts.write_text('{"prompt": "w5"}\nnot json\n')
    deep = tmp / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    return {"missing": tmp / "absent.json", "corrupt": corrupt, "misshapen": misshapen, "directory": tmp,
            "prompts": prompts, "deep": deep}


CASES = [
    ("tools.replay", ["run", "--traces", "{missing}"], "argument --traces: {missing}: missing"),
    ("tools.replay", ["run", "--traces", "{corrupt}"], "argument --traces: {corrupt}: not JSON (JSONDecodeError"),
    ("tools.replay", ["run", "--traces", "{deep}"], "argument --traces: {deep}: not JSON (RecursionError"),
    ("tools.replay", ["run", "--traces", "{directory}"], "argument --traces: {directory}: a directory; expected a "
                                                          "traces file"),
    ("tools.replay", ["run", "--traces", "{misshapen}"], "argument --traces: {misshapen}: not the shape record writes"),
    ("tools.replay", ["run", "--lengths", "abc", "--traces", "{missing}"],
     "argument --lengths: got abc; expected a comma list of integers >= 1 each"),
    ("tools.replay", ["run", "--ks", "0", "--traces", "{missing}"], "argument --ks: got 0; expected a comma list"),
    ("tools.replay", ["record", "--artifact", "{missing}", "--out", "{missing}"],
     "argument --artifact: {missing}: no such directory; expected an artifact directory"),
    ("tools.replay", ["record", "--artifact", "{directory}", "--out", "{missing}"],
     "argument --artifact: {directory}: no manifest.json"),
    ("tools.load_test", ["--artifact", "{missing}"], "{missing}/manifest.json: no manifest"),
    ("tools.load_test", ["--concurrency", "abc", "--artifact", "{missing}"],
     "argument --concurrency: got abc; expected a comma list of integers >= 1 each"),
    ("tools.load_test", ["--concurrency", "0", "--artifact", "{missing}"], "argument --concurrency: got 0;"),
    ("tools.load_test", ["--modes", "bogus", "--artifact", "{missing}"],
     "argument --modes: got bogus; expected a comma list of plain, fixed, cost, hybrid"),
    ("tools.load_test", ["--prompt-file", "{missing}", "--artifact", "{missing}"], "argument --prompt-file: "),
    ("tools.load_test", ["--prompt-file", "{prompts}", "--artifact", "{missing}"],
     "argument --prompt-file: {prompts}:2: not valid JSON"),
    ("tools.load_test", ["--max-tokens", "-1", "--artifact", "{missing}"],
     "argument --max-tokens: got -1; expected an integer >= 1"),
    ("tools.load_test", ["--timeout", "nan", "--artifact", "{missing}"], "argument --timeout: got nan; expected a finite"),
    ("tools.bench_peer", ["--max-tokens", "-1"], "argument --max-tokens: got -1; expected an integer >= 1"),
    ("tools.bench_peer", ["--accuracy-level", "7"], "argument --accuracy-level: got 7; expected an integer in [0, 4]"),
    ("tools.bench_exactness", ["--tokens", "1", "--artifact", "{missing}"],
     "argument --tokens: got 1; expected an integer >= 2"),
    ("tools.ceiling", ["--past", "abc", "--costs", "{missing}"], "argument --past: got abc; expected an integer >= 0"),
]


@pytest.mark.parametrize("tool, args, message", CASES, ids=[f"{c[0]} {' '.join(c[1][:2])}" for c in CASES])
def test_bad_arguments_are_refused_in_one_line(tmp_path, tool, args, message):
    files = {name: str(path) for name, path in _files(tmp_path).items()}
    done = subprocess.run([sys.executable, "-m", tool, *[a.format(**files) for a in args]], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and message.format(**files) in done.stderr, done.stderr


def test_a_context_the_artifact_cannot_hold_is_refused_in_one_line_before_any_server(pair_dir):
    """load_test --context 1: one line naming --context before a server starts (a traceback from inside the first)."""
    done = subprocess.run([sys.executable, "-m", "tools.load_test", "--artifact", str(pair_dir), "--context", "1",
                           "--modes", "plain"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "--max-model-len/--context: got 1; expected at least" in done.stderr


def test_the_shared_types_name_what_they_expect():
    """The helper's types on their own: what each takes, and each refusal's got versus expected."""
    import argparse

    from tools import arguments

    assert arguments.integer(1)("3") == 3 and arguments.integers(2)("2,5") == [2, 5]
    assert arguments.names(["a", "b"])("b,a") == ["b", "a"] and arguments.number(0)("0.5") == 0.5
    for parse, text, expected in [(arguments.integer(1), "1.5", "got 1.5; expected an integer >= 1"),
                                  (arguments.integer(0, 4), "", "got ''; expected an integer in [0, 4]"),
                                  (arguments.integers(1), "1,,2", "got 1,,2; expected a comma list of integers >= 1"),
                                  (arguments.names(["a"]), "", "got ''; expected a comma list of a"),
                                  (arguments.number(0), "inf", "got inf; expected a finite number >= 0")]:
        with pytest.raises(argparse.ArgumentTypeError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            parse(text)
