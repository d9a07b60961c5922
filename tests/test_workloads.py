"""Prompt sets: text, JSONL, Spec-Bench and HumanEval, with errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.workloads import PromptFileError, humaneval, load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "spec_bench_question.jsonl"


def test_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first\n\n second \n")
    assert [p.text for p in load_prompts(tmp_path / "a.txt")] == ["first", " second "]
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "x", "id": "q1", "category": "code"}) + "\n")
    (prompt,) = load_prompts(tmp_path / "b.jsonl")
    assert (prompt.id, prompt.text, prompt.category, prompt.source) == ("q1", "x", "code", "b")


def test_spec_bench_format(tmp_path):
    line = {"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it."]}
    (tmp_path / "q.jsonl").write_text(json.dumps(line) + "\n")
    (prompt,) = load_prompts(tmp_path / "q.jsonl")
    assert (prompt.id, prompt.text, prompt.category) == ("81", "Compose a blog post.", "writing")


@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="../shared/workloads is not beside this checkout")
def test_the_shared_spec_bench_file():
    prompts = load_prompts(SPEC_BENCH)
    assert len(prompts) == 480 and {p.category for p in prompts} >= {"translation", "rag", "coding"}


def test_humaneval_prompts():
    prompts = humaneval()
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0" and prompts[0].text.startswith("from typing")


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "ok"}\n{broken\n', r"b.jsonl:2: not valid JSON"),
    ('{"prompt": "ok"}\n[1, 2]\n', r"b.jsonl:2: expected a JSON object"),
    ('{"text": "no prompt field"}\n', r"b.jsonl:1: expected a string 'prompt' field"),
    ('{"turns": []}\n', r"b.jsonl:1: 'turns' must be a non-empty list"),
    ('{"prompt": ""}\n', r"b.jsonl:1: empty prompt"),
    ("\n\n", r"b.jsonl: contains no prompt"),
])
def test_bad_files_name_the_line(tmp_path, content, match):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(PromptFileError, match=match):
        load_prompts(tmp_path / "b.jsonl")


def test_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        load_prompts(tmp_path / "nope.txt")
