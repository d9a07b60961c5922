"""CLI: specdeploy generate --chat prints the exchange by role, never the answer glued to the user's message."""

from __future__ import annotations

from click.testing import CliRunner

from specdeploy import GenerationConfig, Pipeline
from specdeploy.cli import main


def _answer(artifact, messages, tokens):
    pipeline = Pipeline.load(artifact)
    return pipeline.generate([pipeline.chat_prompt(messages)], GenerationConfig(max_new_tokens=tokens, drafter="none"))[0]


def test_chat_prints_the_users_message_and_the_answer_apart(chat_target_dir):
    """On a single-model export the answer read "...reverses a string.Here is a Python function...": the user's message
    and the answer, glued, where each now stands on its own line after its role."""
    prompt = "w5 w6 w7"
    result = CliRunner().invoke(main, ["generate", str(chat_target_dir), "--chat", "--prompt", prompt,
                                       "--max-new-tokens", "6", "--drafter", "none"])
    assert result.exit_code == 0, result.output
    answer = _answer(chat_target_dir, [{"role": "user", "content": prompt}], 6)
    assert answer.text and f"user: {prompt}\nassistant: {answer.text}\n" in result.stdout
    assert prompt + answer.text not in result.stdout


def test_a_system_message_is_shown_before_the_exchange_and_batches_print_alike(chat_target_dir):
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6"}]
    answer = _answer(chat_target_dir, messages, 5)
    for batch in ("1", "2"):
        result = CliRunner().invoke(main, ["generate", str(chat_target_dir), "--chat", "--system", "w9 w10", "--prompt",
                                           "w5 w6", "--prompt", "w5 w6", "--max-new-tokens", "5", "--drafter", "none",
                                           "--batch-size", batch])
        assert result.exit_code == 0, result.output
        assert result.stdout.count(f"system: w9 w10\nuser: w5 w6\nassistant: {answer.text}\n") == 2, batch


def test_without_chat_the_completion_continues_the_prompt(pair_dir):
    result = CliRunner().invoke(main, ["generate", str(pair_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    text = Pipeline.load(pair_dir).generate("w5 w6 w7", GenerationConfig(max_new_tokens=6))[0].text
    assert f"w5 w6 w7{text}\n" in result.stdout and "user:" not in result.stdout
