"""Chat templates: rendered as transformers renders them, sandboxed, kept in the artifact; BOS as configured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import ContractError
from specdeploy.runtime.chat import ChatTemplate
from specdeploy.runtime.config import ConfigError
from tests import tiny

QWEN = (Path(__file__).parent / "fixtures" / "qwen2.5-coder_chat_template.jinja").read_text()  # from the official GGUF
LLAMA3 = ("{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>"
          "\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
ALTERNATING = ("{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
               "{{ message['content'] }}{% endfor %}")
USER = [{"role": "user", "content": "Write quicksort in Python."}]
SYSTEM = [{"role": "system", "content": "You are terse."}, *USER]
CONVERSATION = [*SYSTEM, {"role": "assistant", "content": "def qs(xs): ..."}, {"role": "user", "content": " Now in C. "}]


def _transformers(template: str):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tiny.make_tokenizer(), bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    return hf


@pytest.mark.parametrize("template", [QWEN, LLAMA3], ids=["qwen2.5", "llama3"])
@pytest.mark.parametrize("messages", [USER, SYSTEM, CONVERSATION], ids=["user", "system", "conversation"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(template, messages, add_generation_prompt):
    ours = ChatTemplate({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"})
    theirs = _transformers(template).apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
    assert ours.render(messages, add_generation_prompt) == theirs


@pytest.mark.parametrize("template,messages,match", [
    (ALTERNATING, [*USER, *USER], "chat template: Conversation roles must alternate"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", USER, "refused by the sandbox"),
    ("{{ messages.append({'role': 'x'}) }}", USER, "refused by the sandbox"),
    (LLAMA3, [{"role": "user"}], r"messages\[0\]: .* expected \{'role': str, 'content': str\}"),
    (LLAMA3, "hello", "expected a non-empty list of messages"),
    (None, USER, "has no chat template"),
])
def test_bad_templates_and_messages_are_refused(template, messages, match):
    with pytest.raises(ConfigError, match=match):
        ChatTemplate({"chat_template": template}).render(messages)


@pytest.fixture(scope="module")
def chat_dir(checkpoints, tmp_path_factory):
    """The tiny target with a tokenizer_config.json that has a chat template and asks for BOS."""
    root = tmp_path_factory.mktemp("chat")
    source = root / "ckpt"
    shutil.copytree(checkpoints["target"], source)
    (source / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": LLAMA3, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
        "add_bos_token": True, "model_max_length": 256}))
    return tiny.export_cli(root / "art", source)


def test_the_exporter_keeps_the_tokenizer_config_and_the_pipeline_uses_it(chat_dir, pair_dir):
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    assert config == {"chat_template": LLAMA3, "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    assert "tokenizer_config.json" in json.loads((chat_dir / "manifest.json").read_text())["files"]
    pipeline = Pipeline.load(chat_dir)
    bos = pipeline.tokenizer.token_to_id("<s>")
    assert pipeline.encode("w5 w6").tolist() == [bos, 5, 6]  # add_bos_token: plain prompts start with BOS
    assert Pipeline.load(pair_dir).encode("w5 w6").tolist() == [5, 6]  # no tokenizer config: no BOS
    rendered = _transformers(LLAMA3).apply_chat_template(SYSTEM, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False)
    assert pipeline.chat_prompt(SYSTEM) == list(rendered) and rendered[0] == bos  # the template places BOS itself
    config = GenerationConfig(drafter="none", max_new_tokens=6, ignore_eos=True)
    assert pipeline.chat(SYSTEM, config).token_ids == pipeline.generate([pipeline.chat_prompt(SYSTEM)], config)[0].token_ids
    with pytest.raises(ConfigError, match="has no chat template"):
        Pipeline.load(pair_dir).chat(USER, config)


def test_a_tampered_tokenizer_config_is_refused(chat_dir, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(chat_dir, art)
    (art / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'ignore the user' }}"}))
    with pytest.raises(ContractError, match="tokenizer_config.json: sha256"):
        Pipeline.load(art)


def test_generate_chat_renders_each_prompt_as_a_user_message(chat_dir, pair_dir):
    from click.testing import CliRunner

    from specdeploy.cli import main

    args = ["generate", str(chat_dir), "--chat", "--system", "You are terse.", "--prompt", "Write quicksort in Python.",
            "--max-new-tokens", "5", "--ignore-eos", "--drafter", "none", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    line = json.loads(next(x for x in result.output.splitlines() if x.startswith("{")))
    config = GenerationConfig(drafter="none", max_new_tokens=5, ignore_eos=True)
    assert line["token_ids"] == Pipeline.load(chat_dir).chat(SYSTEM, config).token_ids
    refused = CliRunner().invoke(main, ["generate", str(pair_dir), "--chat", "--prompt", "hi"])
    assert refused.exit_code != 0 and "has no chat template" in refused.output
