"""Chat templates: rendered as transformers renders them, sandboxed, kept in the artifact; BOS as configured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import ContractError
from specdeploy.runtime.chat import ChatTemplate, ChatTemplateError
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
    (LLAMA3, [{"role": "user"}], r"messages\[0\]: .* expected \{'role': str, 'content': str\}"),
    (LLAMA3, "hello", "expected a non-empty list of messages"),
    (None, USER, "has no chat template"),
])
def test_bad_templates_and_messages_are_refused(template, messages, match):
    with pytest.raises(ConfigError, match=match):
        ChatTemplate({"chat_template": template}).render(messages)


@pytest.mark.parametrize("template", ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append({'role': 'x'}) }}"])
def test_a_template_reaching_past_the_sandbox_is_the_artifacts_fault(template):
    """Sandbox refusals used to be reported as the client's ConfigError: the template tried it, not the messages."""
    with pytest.raises(ChatTemplateError, match="the chat template was refused by the sandbox"):
        ChatTemplate({"chat_template": template}).render(USER)


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


LONG = [{"role": "user", "content": "x" * 10_000}]
HOSTILE = [  # (template, messages, what the error says): each the template's own doing, never the client's
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", USER, "took longer than 1 s"),
    ("{% for a in messages[0]['content'] %}{% for b in messages[0]['content'] %}{% endfor %}{% endfor %}", LONG,
     "took longer than 1 s"),
    ("{{ 10 ** 100000000 }}", USER, r"OverflowError: 10 \*\* 100000000 has more than 65536 bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}", USER,
     "OverflowError: a product of more than 65536 bits"),
    ("{{ range(10 ** 12) | list }}", USER, "OverflowError: Range too big"),
    ("{{ 'x' * 10 ** 9 }}", USER, r"OverflowError: str of 1 repeated 1,000,000,000 times"),
    ("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}", LONG,
     "OutputLimit: its output passed 16,777,216 characters"),
    ("{{ (['x' * 16000000] * 200) | join }}", USER, "MemoryError: it took more than 2 GiB"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", USER, "RecursionError: it recursed without end"),
    ("{{ 1 / 0 }}", USER, "ZeroDivisionError: division by zero"),
    ("{{ messages[0]['content'] | int / (messages | length - 1) }}", USER, "ZeroDivisionError"),
    ("{% for %}", USER, "TemplateSyntaxError"),
]


@pytest.mark.parametrize("template,messages,match", HOSTILE, ids=[
    "nested-loops", "loops-over-content", "power", "squaring", "range", "repetition", "output", "memory", "recursion",
    "division", "division-by-messages", "syntax"])
def test_templates_that_fail_or_overrun_are_the_artifacts_fault(template, messages, match):
    """Each used to hang, eat memory or end in a traceback, or blamed the client's messages; now each is stopped and
    reported as the template's failure, naming it, and the next render works."""
    chat = ChatTemplate({"chat_template": template}, source="art/tokenizer_config.json", time_limit=1.0)
    with pytest.raises(ChatTemplateError, match=f"art/tokenizer_config.json: the chat template .*{match}"):
        chat.render(messages)
    ok = ChatTemplate({"chat_template": LLAMA3, "bos_token": "<s>"})
    assert ok.render(USER) == _transformers(LLAMA3).apply_chat_template(USER, tokenize=False, add_generation_prompt=True)


def test_messages_with_lone_surrogates_are_the_clients_fault():
    with pytest.raises(ConfigError, match=r"messages\[1\]\.content: a lone surrogate \(U\+DFFF\) at character 4"):
        ChatTemplate({"chat_template": LLAMA3}).render([*USER, {"role": "user", "content": "abcd\udfff"}])
    with pytest.raises(ConfigError, match=r"messages: not JSON data"):
        ChatTemplate({"chat_template": LLAMA3}).render([{"role": "user", "content": "hi", "when": object()}])


def test_renders_run_side_by_side(monkeypatch):
    """Threads rendering at once (a server's requests) each get their own messages' prompt."""
    import threading

    chat = ChatTemplate({"chat_template": LLAMA3, "bos_token": "<s>"})
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
    got = {}

    def work(i):
        got[i] = chat.render(conversations[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(got[i] == chat.render(conversations[i]) and f"question {i}<|eot_id|>" in got[i] for i in range(12))


TOOL_USE = "{{ 'tools: ' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("config,expected", [
    ({"chat_template": [{"name": "default", "template": LLAMA3}, {"name": "tool_use", "template": TOOL_USE}]}, "default"),
    ({"chat_template": {"tool_use": TOOL_USE, "default": LLAMA3}}, "default"),
    ({"chat_template": LLAMA3, "bos_token": {"content": "<s>", "__type": "AddedToken", "special": True}}, "bos"),
])
def test_tokenizer_configs_in_the_shapes_transformers_accepts(config, expected):
    chat = ChatTemplate(config)
    rendered = chat.render(USER)
    assert rendered == ChatTemplate({"chat_template": LLAMA3, "bos_token": chat.bos_token}).render(USER)
    assert not rendered.startswith("tools") and (expected != "bos" or rendered.startswith("<s>"))


@pytest.mark.parametrize("config,error,match", [
    ({"chat_template": LLAMA3, "add_bos_token": "false"}, ContractError,
     r"add_bos_token: got 'false' \(str\); expected true or false"),
    ({"chat_template": [{"name": "tool_use", "template": TOOL_USE}]}, ChatTemplateError,
     "has named chat templates \\(tool_use\\) and none named 'default'"),
    ({"chat_template": [{"template": LLAMA3}]}, ContractError, "chat_template: expected a string or a list of"),
    ({"chat_template": LLAMA3, "bos_token": 1}, ContractError, "bos_token: expected a string or an AddedToken"),
])
def test_tokenizer_configs_we_cannot_take_are_refused_naming_the_field(config, error, match):
    with pytest.raises(error, match=match):
        ChatTemplate(config).render(USER)


def test_an_artifact_with_named_templates_loads_and_one_with_a_string_flag_is_refused(chat_dir, tmp_path):
    from specdeploy.contract import sha256_file

    def edited(name, change):
        art = tmp_path / name
        shutil.copytree(chat_dir, art)
        config = json.loads((art / "tokenizer_config.json").read_text())
        change(config)
        (art / "tokenizer_config.json").write_text(json.dumps(config))
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["files"]["tokenizer_config.json"] = sha256_file(art / "tokenizer_config.json")
        (art / "manifest.json").write_text(json.dumps(manifest))
        return art

    named = edited("named", lambda c: c.update(chat_template=[{"name": "default", "template": LLAMA3},
                                                              {"name": "tool_use", "template": TOOL_USE}]))
    assert Pipeline.load(named).chat_prompt(USER) == Pipeline.load(chat_dir).chat_prompt(USER)
    flagged = edited("flagged", lambda c: c.update(add_bos_token="false"))
    with pytest.raises(ContractError, match="add_bos_token: got 'false'"):
        Pipeline.load(flagged)
    from specdeploy.doctor import diagnose

    assert any("add_bos_token: got 'false'" in problem for problem, _ in diagnose(flagged))
    broken = edited("broken", lambda c: c.update(chat_template="{{ 1 / 0 }}"))
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["generate", str(broken), "--chat", "--prompt", "hi"])
    assert result.exit_code == 1 and "the chat template failed on its own (ZeroDivisionError" in result.output
    assert isinstance(result.exception, SystemExit)
