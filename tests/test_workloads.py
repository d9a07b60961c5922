"""Prompt sets: text, JSONL, chat prompts, Spec-Bench and HumanEval, with errors that name the line; the shipped
workloads (Spec-Bench, the conversations and structured prompts, the generator that rebuilds the last two)."""

from __future__ import annotations

import ast
import difflib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from specdeploy import workloads
from specdeploy.workloads import Prompt, PromptFileError, humaneval, load_prompts, spec_bench, workload

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
    ((0, 0, 0, 9), "conversation workload: asked for 9 conversations; it has 8"),
    ((0, 0, 0, 0, 9), "structured workload: asked for 9 prompts; it has 8"),
    ((0, 0, 0, -1), "conversation_count: got -1"),
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
        shipped = {name: archive.read(f"specdeploy/data/{name}")
                   for name in ("spec_bench_question.jsonl", "conversation.jsonl", "structured.jsonl")}
        notice = archive.read("specdeploy/data/README.md").decode()
    assert shipped == {name: (ROOT / "specdeploy" / "data" / name).read_bytes() for name in shipped}
    assert "Apache License" in notice and "hemingkx/Spec-Bench" in notice
    assert "openai/human-eval" in notice and "Copyright (c) OpenAI" in notice and "The MIT License" in notice


def test_humaneval_prompts():
    prompts = humaneval()
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0" and prompts[0].text.startswith("from typing")


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "ok"}\n{broken\n', r"b.jsonl:2: not valid JSON"),
    ('{"prompt": "ok"}\n[1, 2]\n', r"b.jsonl:2: expected a JSON object"),
    ('{"text": "no prompt field"}\n', r"b.jsonl:1: expected a string 'prompt' field"),
    ('{"turns": []}\n', r"b.jsonl:1: 'turns' must be a non-empty list"),
    ('{"prompt": ""}\n', r"b.jsonl:1: empty prompt"),
    ('{"messages": []}\n', r"b.jsonl:1: 'messages': got list; expected a non-empty list of messages"),
    ('{"messages": "hi"}\n', r"b.jsonl:1: 'messages': got str"),
    ('{"messages": [{"role": "user"}]}\n', r"b.jsonl:1: messages\[0\]: got .*expected \{'role': str, 'content': str\}"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
     r"b.jsonl:1: the last message's role is 'assistant'; expected 'user'"),
    ("\n\n", r"b.jsonl: contains no prompt"),
])
def test_bad_files_name_the_line(tmp_path, content, match):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(PromptFileError, match=match):
        load_prompts(tmp_path / "b.jsonl")


def test_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        load_prompts(tmp_path / "nope.txt")


def test_chat_prompts_load_with_their_messages(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "c1", "category": "chat", "messages": messages}) + "\n")
    (prompt,) = load_prompts(tmp_path / "c.jsonl")
    assert (prompt.id, prompt.text, prompt.category, prompt.messages) == ("c1", "Hi", "chat", tuple(messages))


class _Renderer:
    """A pipeline's chat_prompt, recorded."""

    def __init__(self):
        self.rendered = []

    def chat_prompt(self, messages):
        self.rendered.append(messages)
        return [7, len(messages)]


def test_a_pipeline_takes_a_chat_prompt_rendered_and_a_text_prompt_as_it_is():
    pipeline = _Renderer()
    messages = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"})
    assert Prompt("p", "c", messages=messages).for_pipeline(pipeline) == [7, 3]
    assert pipeline.rendered == [list(messages)]
    assert Prompt("q", "plain text").for_pipeline(pipeline) == "plain text" and len(pipeline.rendered) == 1


def _code(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def test_the_conversations_run_turn_after_turn_each_copying_the_earlier_answers():
    prompts = workloads.conversations()
    assert len(prompts) == workloads.CONVERSATIONS * workloads.CONVERSATION_TURNS
    assert {p.source for p in prompts} == {"conversation"}
    tasks = {r["task_id"]: r for r in workloads.humaneval_records()}
    for first in range(0, len(prompts), workloads.CONVERSATION_TURNS):
        turns = prompts[first : first + workloads.CONVERSATION_TURNS]
        task = turns[0].id.rsplit("/turn-", 1)[0]
        assert [p.id for p in turns] == [f"{task}/turn-{t}" for t in (1, 2, 3)]  # in order, one after the other
        assert [p.category for p in turns] == ["turn_1", "later_turns", "later_turns"]
        # turn 1 gives the complete HumanEval function: its prompt and canonical solution
        (given,) = _code(turns[0].messages[0]["content"])
        record = tasks[task]
        assert given.split() == (record["prompt"] + record["canonical_solution"]).split()
        for turn, prompt in enumerate(turns, 1):
            roles = [m["role"] for m in prompt.messages]
            assert roles == ["user", "assistant"] * (turn - 1) + ["user"] and prompt.text == prompt.messages[-1]["content"]
            if turn > 1:  # the conversation so far: the turn before, its answer, the new request
                assert prompt.messages[: 2 * turn - 3] == turns[turn - 2].messages
        # each answer is the whole code again, edited (valid Python): mostly a copy of the code before it
        codes = [given] + [_code(m["content"])[0] for m in turns[-1].messages[1::2]]
        for before, after in zip(codes, codes[1:]):
            ast.parse(after)
            assert before != after and difflib.SequenceMatcher(None, before, after).ratio() > 0.6, (task, after)


def test_the_structured_prompts_ask_for_json_records():
    prompts = workloads.structured()
    assert len(prompts) == workloads.STRUCTURED_PROMPTS and {p.source for p in prompts} == {"structured"}
    assert len({p.category for p in prompts}) == len(prompts)  # a different kind of data each
    for prompt in prompts:
        (message,) = prompt.messages
        assert message["role"] == "user" and "JSON" in message["content"] and "keys" in message["content"]
        assert len(message["content"].splitlines()) >= 8  # the data: rows to turn into records


def test_a_workload_runs_each_conversation_in_order_after_the_other_sets():
    chosen = workload(1, 0, conversation_count=2, structured_count=1)
    assert [g for g, _ in chosen] == ["humaneval"] + ["conversation/turn_1"] + ["conversation/later_turns"] * 2 \
        + ["conversation/turn_1"] + ["conversation/later_turns"] * 2 + ["structured"]
    assert [p.id for _, p in chosen[1:4]] == ["HumanEval/0/turn-1", "HumanEval/0/turn-2", "HumanEval/0/turn-3"]
    assert chosen[-1][1].id == "structured-1" and all(p.messages for _, p in chosen[1:])


def test_the_generator_rebuilds_the_shipped_files_byte_for_byte(tmp_path):
    from tools import make_workloads

    written = make_workloads.write(tmp_path)
    assert [p.name for p in written] == ["conversation.jsonl", "structured.jsonl"]
    for path in written:
        assert path.read_bytes() == (ROOT / "specdeploy" / "data" / path.name).read_bytes(), path.name
