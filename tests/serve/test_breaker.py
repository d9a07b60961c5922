"""serve/breaker.py: a chat template that keeps running past its limit costs the server a bounded time: after 3
timeouts in the window its renders are refused at once (503) for the cool-off, then one trial decides."""

from __future__ import annotations

import json

import pytest

from specdeploy import Pipeline
from specdeploy.runtime.chat import ChatTemplate
from specdeploy.serve.breaker import Breaker, TemplateBroken

from .conftest import serving
from .test_limits import HOSTILE_TEMPLATE, _chat, _error, _post, _serves_normally


@pytest.fixture()
def hostile_pipeline(pair_dir):
    loaded = Pipeline.load(pair_dir)
    loaded.codec.template = ChatTemplate({"chat_template": HOSTILE_TEMPLATE})
    return loaded


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_timeouts_in_the_window_and_one_trial_decides():
    clock = Clock()
    breaker = Breaker(failures=3, window=60.0, cool_off=30.0, clock=clock)
    for at in (0.0, 10.0, 75.0, 80.0):  # the first two are outside the window by the fourth
        clock.now = at
        assert breaker.check() is False
        breaker.settle(True)
    assert not breaker.open
    breaker.settle(False)  # a render that finished counts for nothing
    clock.now = 85.0
    breaker.settle(True)  # 75, 80, 85: three within 60 s
    assert breaker.open
    with pytest.raises(TemplateBroken, match="refused for 30 s") as caught:
        breaker.check()
    assert caught.value.retry_after == pytest.approx(30.0)
    clock.now = 116.0
    assert breaker.check() is True  # the trial
    with pytest.raises(TemplateBroken):
        breaker.check()  # one trial at a time
    breaker.settle(True, trial=True)  # it ran past the limit again: another cool-off
    with pytest.raises(TemplateBroken):
        breaker.check()
    clock.now = 147.0
    assert breaker.check() is True
    breaker.settle(None, trial=True)  # its request went away: the next caller is the trial
    assert breaker.check() is True
    breaker.settle(False, trial=True)  # it finished: closed
    assert not breaker.open and breaker.check() is False


def test_a_template_that_always_runs_past_its_limit_is_refused_at_once_after_three_timeouts(hostile_pipeline):
    """16 chats on a looping template held every worker for minutes: now the fourth is a 503 without a render, naming
    the template and when to retry, and completions are served meanwhile."""
    template, renders = hostile_pipeline.chat_template, []
    render = template.render
    template.render = lambda *args, **kwargs: renders.append(args) or render(*args, **kwargs)
    with serving(hostile_pipeline, template_seconds=0.3) as (url, _):
        for _ in range(3):
            error = _error(*_post(url, _chat("w99"), "/v1/chat/completions"), 500)
            assert "did not finish within 0.3 s" in error["message"]
        rendered = len(renders)
        status, body = _post(url, _chat("w99"), "/v1/chat/completions")
        error = _error(status, body, 503)
        assert error["code"] == "chat_template_unavailable" and "ran past its time limit 3 times" in error["message"]
        assert len(renders) == rendered  # refused at once: no render ran (each of the three took 0.3 s of CPU time)
        status, body = _post(url, _chat("w5 w6"), "/v1/chat/completions")
        assert status == 503 and json.loads(body)["error"]["code"] == "chat_template_unavailable"  # every chat
        _serves_normally(url, hostile_pipeline)
