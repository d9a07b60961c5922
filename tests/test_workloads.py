"""Prompt sets: text, JSONL, Spec-Bench and HumanEval, with errors that name the line; the shipped workloads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from specdeploy import workloads
from specdeploy.workloads import PromptFileError, humaneval, load_prompts, spec_bench, workload

ROOT = Path(__file__).resolve().parents[1]


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


def test_spec_bench_ships_with_the_package():
    prompts = spec_bench()
    assert len(prompts) == 480 and {p.source for p in prompts} == {"spec_bench"}
    groups = Counter(workloads.spec_bench_group(p) for p in prompts)
    assert groups == dict.fromkeys(workloads.SPEC_BENCH_GROUPS, 80)
    assert (prompts[0].id, prompts[0].category) == ("81", "writing") and prompts[0].text.startswith("Compose an engaging")


def test_a_workload_takes_humaneval_from_a_task_then_each_spec_bench_group():
    chosen = workload(2, 2, humaneval_from=8)
    assert [(g, p.id) for g, p in chosen[:2]] == [("humaneval", "HumanEval/8"), ("humaneval", "HumanEval/9")]
    spec = chosen[2:]
    assert Counter(g for g, _ in spec) == {f"spec_bench/{g}": 2 for g in workloads.SPEC_BENCH_GROUPS}
    assert all(g == f"spec_bench/{workloads.spec_bench_group(p)}" for g, p in spec)
    # the first of each group in file order: MT-bench's first two are writing prompts
    assert [p.id for g, p in spec if g == "spec_bench/mt_bench"] == ["81", "82"]
    assert workload(0, 0) == []


@pytest.mark.parametrize("args, message", [
    ((1, 0, 164), "HumanEval: asked for tasks 164..164; it has 164"),
    ((165, 0), "it has 164"),
    ((0, 81), "asked for 81 prompts per group; each group has 80"),
    ((-1, 0), "humaneval_count: got -1; expected an integer >= 0"),
    ((0, 1, -2), "humaneval_from: got -2"),
])
def test_a_workload_the_sets_cannot_fill_is_an_error(args, message):
    with pytest.raises(PromptFileError, match=message):
        workload(*args)


def test_spec_bench_missing_from_the_install_is_an_error_not_an_empty_set(monkeypatch):
    monkeypatch.setattr(workloads, "SPEC_BENCH_FILE", "data/not-shipped.jsonl")
    with pytest.raises(PromptFileError, match="data/not-shipped.jsonl is missing from the installed specdeploy package"):
        workload(0, 1)
    assert workload(1, 0)[0][0] == "humaneval"  # HumanEval alone does not need it


def test_the_wheel_carries_spec_bench_and_its_attribution(tmp_path):
    """Package data, not a file beside the checkout: `specdeploy bench --specbench N` works from an installed package."""
    source = tmp_path / "src"  # a copy: building in the checkout would race test_install's build over build/
    shutil.copytree(ROOT / "specdeploy", source / "specdeploy", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            str(source), "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("specdeploy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("specdeploy/data/spec_bench_question.jsonl")
        notice = archive.read("specdeploy/data/README.md").decode()
    assert shipped == (ROOT / "specdeploy" / "data" / "spec_bench_question.jsonl").read_bytes()
    assert "Apache License" in notice and "hemingkx/Spec-Bench" in notice


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
