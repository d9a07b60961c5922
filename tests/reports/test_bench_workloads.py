"""specdeploy bench --conversations / --structured: the shipped chat workloads, through the artifact's chat template,
on a tiny pair with room for a conversation's third turn."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdeploy import GenerationConfig, Pipeline
from specdeploy.cli import main
from specdeploy.reports.bench import read_records
from specdeploy.workloads import workload
from tests import tiny
from tests.conftest import LLAMA3_CHAT_TEMPLATE

CAPACITY = 640  # the tiny word-level tokenizer makes a conversation's third turn ~430 tokens


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def chat_pair_dir(tmp_path_factory):
    """A tiny target and its own int4 copy as the draft (one trace), with a chat template, positions and capacity for
    the chat workloads."""
    root = tmp_path_factory.mktemp("chat-pair")
    target = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(max_position_embeddings=CAPACITY), seed=0),
                                  root / "target")
    (target / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": LLAMA3_CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return tiny.export_cli(root / "art", target, target, "--capacity", str(CAPACITY), "--draft-weights", "int4")


def test_conversations_and_structured_prompts_run_in_order_through_the_chat_template(chat_pair_dir, tmp_path):
    out = tmp_path / "out"
    result = run("bench", chat_pair_dir, "--conversations", "1", "--structured", "1", "--k", "0,2",
                 "--drafter", "model,prompt-lookup", "--max-new-tokens", "4", "--out", out)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    # a conversation's first turn apart from its later ones (the earlier answers in the prompt)
    assert set(summary) == {"all", "conversation/turn_1", "conversation/later_turns", "structured/structured"}
    assert summary["conversation/later_turns"]["plain t=0"]["runs"] == 2
    runs = [r for r in read_records(out / "records.jsonl") if r["type"] == "run"]
    # each prompt through every configuration before the next: the turns in order, one after the other
    assert list(dict.fromkeys(r["prompt_id"] for r in runs)) == \
        ["HumanEval/0/turn-1", "HumanEval/0/turn-2", "HumanEval/0/turn-3", "structured-1"]
    assert all(entry["identical_to_baseline"] == entry["runs"] for entry in summary["all"].values())
    # what ran was the messages through the artifact's chat template, not the last message's text
    pipeline = Pipeline.load(chat_pair_dir)
    plain = {r["prompt_id"]: r["token_ids"] for r in runs if r["config"] == "plain t=0"}
    for _, prompt in workload(0, 0, conversation_count=1, structured_count=1):
        ids = pipeline.chat_prompt(list(prompt.messages))
        assert len(ids) > len(prompt.text.split())
        expected = pipeline.generate([ids], GenerationConfig(drafter="none", max_new_tokens=4, temperature=0.0))[0]
        assert plain[prompt.id] == expected.token_ids


def test_a_chat_workload_on_an_artifact_without_a_chat_template_is_refused_naming_the_prompt(pair_dir, tmp_path):
    result = run("bench", pair_dir, "--structured", "1", "--k", "0,1", "--max-new-tokens", "2", "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "prompt structured-1 (structured): messages: this artifact's tokenizer has no chat template" in result.output
