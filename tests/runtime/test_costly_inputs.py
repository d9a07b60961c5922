"""Inputs bounded by what they can cost before it is paid (issue 52): a prompt in characters before tokens, a chat
template's output by what the context could hold, its time by the CPU it uses; and a template that fails on the
client's tools is the client's fault."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from specdeploy import Pipeline
from specdeploy.runtime.chat import ChatTemplate, ChatTemplateError, renderer
from specdeploy.runtime.config import ConfigError

USER = [{"role": "user", "content": "w5 w6"}]


class CountingTokenizer:
    """The pipeline's tokenizer, noting the length of every text it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text, **options):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def counted(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    pipeline.codec.tokenizer = CountingTokenizer(pipeline.tokenizer)
    return pipeline


def test_one_enormous_word_is_refused_having_tokenized_no_more_than_the_context_could_hold(counted):
    """The first 64 characters a slot tokenize to one unknown word; the whole 2 MB used to be tokenized after them."""
    bound = 64 * counted.target.spec.capacity
    with pytest.raises(ConfigError, match=rf"prompt: 2,000,003 characters; expected at most {bound:,} \(64 a token"):
        counted.encode("w5 " + "x" * 2_000_000)
    assert max(counted.tokenizer.lengths) <= bound
    assert len(counted.encode("w5 w6 w7")) == 3  # and the pipeline goes on


def test_a_chat_templates_output_is_bounded_by_the_context_not_16_mib(counted):
    bound = 64 * counted.target.spec.capacity
    counted.codec.template = ChatTemplate({"chat_template": "{% for i in range(5000) %}{{ messages[0]['content'] }} "
                                                           "{% endfor %}"}, source="art/tokenizer_config.json")
    with pytest.raises(ChatTemplateError, match=f"OutputLimit: its output passed {bound:,} characters"):
        counted.chat_prompt(USER)
    with pytest.raises(ConfigError, match=rf"messages: 7,004 characters, more than the {bound:,}"):
        counted.chat_prompt([{"role": "user", "content": "w5 w6 w7" * 875}])  # the client's own text is over: refused first
    assert counted.tokenizer.lengths == []  # nothing was tokenized


def test_the_time_limit_counts_the_templates_cpu_time_not_a_busy_machines_wait():
    """A worker kept off the CPU (stopped, as by a machine busy with other work) for longer than the limit is not
    blamed: the limit is the CPU time the render uses. A render that does use it is still stopped."""
    chat = ChatTemplate({"chat_template": "{% for i in range(20000) %}{% endfor %}{{ messages[0]['content'] }}"},
                        time_limit=1.0)
    assert chat.render(USER) == "w5 w6"  # warm: a worker is idle now, and is the one the next render takes
    worker = renderer()._idle[-1]
    result = {}
    thread = threading.Thread(target=lambda: result.update(text=chat.render(USER)))
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        thread.start()
        time.sleep(2.5)  # the contention: 2.5 s of wall time in which the render gets no CPU
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    thread.join(60)
    assert result == {"text": "w5 w6"}
    busy = ChatTemplate({"chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"},
                        time_limit=0.3)
    with pytest.raises(ChatTemplateError, match=r"took longer than 0.3 s of CPU time"):
        busy.render(USER)


TOOLS_TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}"
                  "{% for name, p in t['function']['parameters']['properties'].items() %} {{ name }}{% endfor %}"
                  "{% endfor %}{% for m in messages %} {{ m['content'] }}{% endfor %}")


def test_a_template_failing_on_the_clients_tools_is_the_clients_fault():
    chat = ChatTemplate({"chat_template": TOOLS_TEMPLATE})
    good = [{"type": "function", "function": {"name": "look", "parameters": {"properties": {"x": {}}}}}]
    assert chat.render(USER, tools=good) == "look x w5 w6"
    bad = [{"type": "function", "function": {"name": "look", "parameters": {"properties": "x"}}}]
    with pytest.raises(ConfigError, match=r"tools: the chat template fails on them \(UndefinedError"):
        chat.render(USER, tools=bad)
    broken = ChatTemplate({"chat_template": "{{ 1 // 0 }}"})  # fails on any conversation, tools or none: its own fault
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        broken.render(USER, tools=good)
