"""Hostile and careless requests against the HTTP server (issue 43, the server's share): each is answered in
OpenAI's shape, naming the thing, and while it is handled the server keeps answering /health (at least twice
while the hostile request is in flight, where it lasts: impossible were the event loop held) and serves a normal
greedy request correctly right after."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.chat import ChatTemplate

from .conftest import serving

SLOW = "{% for i in range(6000) %}{% for j in range(6000) %}{% if i * j == -1 %}x{% endif %}{% endfor %}{% endfor %}"
# the first message's content picks the template's misbehaviour; any other conversation renders plainly
HOSTILE_TEMPLATE = ("{% if messages[0]['content'] == 'w99' %}" + SLOW + "{% endif %}"
                    "{% if messages[0]['content'] == 'w98' %}{{ 1 // 0 }}{% endif %}"
                    "{% if messages[0]['content'] == 'w97' %}{{ raise_exception('roles must alternate user/assistant') }}"
                    "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}w15 ")


@pytest.fixture(scope="module")
def hostile_pipeline(pair_dir):
    loaded = Pipeline.load(pair_dir)
    loaded.codec.template = ChatTemplate({"chat_template": HOSTILE_TEMPLATE})
    return loaded


@pytest.fixture(scope="module")
def hostile(hostile_pipeline):
    with serving(hostile_pipeline, template_seconds=0.5) as (url, scheduler):
        yield url


def _post(url: str, body: bytes | dict, path: str = "/v1/completions", content_type: str = "application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _health_while(url: str, action):
    """Run ``action()`` in a thread and poll /health meanwhile; (its result, health answers while it was in flight)."""
    result, answered = {}, 0
    thread = threading.Thread(target=lambda: result.update(value=action()))
    thread.start()
    while thread.is_alive():
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            assert response.status == 200
        answered += thread.is_alive()
        time.sleep(0.005)
    thread.join()
    return result["value"], answered


def _serves_normally(url: str, pipeline) -> None:
    status, body = _post(url, {"model": "tiny", "prompt": "w5 w6 w7", "temperature": 0, "max_tokens": 12,
                               "ignore_eos": True})
    expected = pipeline.generate(["w5 w6 w7"], GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True))[0].text
    assert status == 200 and json.loads(body)["choices"][0]["text"] == expected


def _error(status: int, body: bytes, expected: int) -> dict:
    assert status == expected, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _chat(content: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def test_a_template_that_runs_too_long_is_the_artifacts_500_and_health_goes_on(hostile, hostile_pipeline):
    (status, body), answered = _health_while(hostile, lambda: _post(hostile, _chat("w99"), "/v1/chat/completions"))
    error = _error(status, body, 500)
    assert "chat template did not finish within 0.5 s" in error["message"] and error["type"] == "server_error"
    assert answered >= 2  # the event loop answered while the template rendered
    _serves_normally(hostile, hostile_pipeline)
    status, body = _post(hostile, _chat("w5 w6"), "/v1/chat/completions")  # other conversations render as ever
    assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == 3


def test_a_template_that_fails_is_the_artifacts_500_and_its_own_refusal_the_clients_400(hostile, hostile_pipeline):
    error = _error(*_post(hostile, _chat("w98"), "/v1/chat/completions"), 500)
    assert "failed on its own (ZeroDivisionError" in error["message"] and error["code"] == "chat_template_error"
    error = _error(*_post(hostile, _chat("w97"), "/v1/chat/completions"), 400)
    assert "roles must alternate" in error["message"] and error["param"] == "messages"
    _serves_normally(hostile, hostile_pipeline)


@pytest.mark.parametrize("stop,words", [("w5 " * 300_000, "900,000 characters"), (["w5"] * 17, "got 17 strings")])
def test_stop_strings_are_bounded_at_the_door(hostile, hostile_pipeline, stop, words):
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 16, "stop": stop, "stream": True}
    (status, answer), _ = _health_while(hostile, lambda: _post(hostile, body))
    error = _error(status, answer, 400)
    assert error["param"] == "stop" and words in error["message"]
    _serves_normally(hostile, hostile_pipeline)


def _chunked(url: str, total: int, piece: int = 2**16) -> tuple[int, bytes]:
    """POST ``total`` bytes with Transfer-Encoding: chunked, made as they are sent (the client holds none of them)."""
    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)

    def pieces():
        for _ in range(0, total, piece):
            yield b" " * piece

    connection.request("POST", "/v1/completions", body=pieces(), encode_chunked=True,
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = response.status, response.read()
    connection.close()
    return answer


def test_chunked_bodies_over_the_limit_are_refused_with_413_and_the_memory_stays_flat(hostile, hostile_pipeline):
    error = _error(*_chunked(hostile, 4_500_000), 413)
    assert "sent in chunks" in error["message"] and "--max-body-bytes" in error["message"]
    peak, sampling = [0], threading.Event()

    def sample():
        while not sampling.is_set():
            peak[0] = max(peak[0], _resident())
            time.sleep(0.005)

    before = _resident()
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answers, answered = _health_while(hostile, lambda: [_chunked(hostile, 60 * 2**20) for _ in range(4)])
    finally:
        sampling.set()
        sampler.join()
    assert [status for status, _ in answers] == [413] * 4 and answered >= 2
    assert peak[0] - before < 40 * 2**20, f"grew {(peak[0] - before) / 2**20:.0f} MiB over four 60 MiB bodies"
    _serves_normally(hostile, hostile_pipeline)


def _resident() -> int:
    """This process's resident memory in bytes (Linux: /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_expect_100_continue_over_the_limit_is_refused_before_the_body_is_sent(hostile, hostile_pipeline):
    where = urllib.parse.urlsplit(hostile)
    with socket.create_connection((where.hostname, where.port), timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 52428800\r\nExpect: 100-continue\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            answer += connection.recv(65536)  # answered though not a byte of the body was sent
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer
    assert b"Content-Length: got 52428800 bytes" in answer
    _serves_normally(hostile, hostile_pipeline)


def test_a_deep_json_body_is_a_400_in_openais_shape(hostile, hostile_pipeline):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = _error(*_post(hostile, deep), 400)
    assert "not valid JSON" in error["message"] and "recursion limit" in error["message"]
    _serves_normally(hostile, hostile_pipeline)


def test_a_huge_model_name_is_not_echoed_whole(hostile, hostile_pipeline):
    status, body = _post(hostile, {"model": "m" * 900_000, "prompt": "w5"})
    error = _error(status, body, 404)
    assert len(body) < 1000 and "900,002 characters" in error["message"] and error["param"] == "model"
    _serves_normally(hostile, hostile_pipeline)


def test_a_body_that_is_not_json_is_a_415_naming_the_content_type(hostile, hostile_pipeline):
    error = _error(*_post(hostile, b"model=tiny&prompt=w5", content_type="application/x-www-form-urlencoded"), 415)
    assert "Content-Type: got 'application/x-www-form-urlencoded'; expected application/json" in error["message"]
    for path, method, status in (("/v1/nowhere", "GET", 404), ("/v1/completions", "GET", 405)):
        request = urllib.request.Request(f"{hostile}{path}", method=method)
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        _error(answer.value.code, answer.value.read(), status)
    _serves_normally(hostile, hostile_pipeline)


def _broken_tokenizer(tokenizer):
    """The artifact's tokenizer, but mapping the word w7 to an id beyond the model's vocabulary (128)."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    data["model"]["vocab"]["w7"] = 200
    return Tokenizer.from_str(json.dumps(data))


def test_a_request_refused_at_admission_fails_alone_and_its_batch_mates_complete(pair_dir, pipeline):
    """A broken tokenizer maps a word outside the vocabulary: the request with it fails alone (a 4xx naming the
    vocabulary), the six admitted with it in one batch decode as they would alone."""
    broken = Pipeline.load(pair_dir)
    broken.codec.tokenizer = _broken_tokenizer(broken.tokenizer)
    prompts = ["w5 w7 w9", *[f"w{10 + i} w{20 + i}" for i in range(6)]]
    answers = {}
    with serving(broken, start_scheduler=False, max_batch=8) as (url, scheduler):
        threads = [threading.Thread(target=lambda p=p: answers.update({p: _post(url, {
            "model": "tiny", "prompt": p, "temperature": 0, "max_tokens": 12, "ignore_eos": True})})) for p in prompts]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(scheduler.queue) + len(answers) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
        scheduler.start()  # those queued are admitted together
        for thread in threads:
            thread.join()
    status, body = answers.pop("w5 w7 w9")
    assert 400 <= status < 500 and "vocabulary" in json.loads(body)["error"]["message"]
    config = GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True)
    for prompt, (status, body) in answers.items():
        assert status == 200 and json.loads(body)["choices"][0]["text"] == pipeline.generate([prompt], config)[0].text


def _count_allocations(pipeline, monkeypatch) -> list[str]:
    """The roles of every cache ``pipeline``'s engines allocate from now on (while the test runs)."""
    allocated = []
    for role in ("target", "draft"):
        engine = getattr(pipeline, role)
        allocate = engine.allocate_cache

        def counted(*args, role=role, allocate=allocate, **kwargs):
            allocated.append(role)
            return allocate(*args, **kwargs)

        monkeypatch.setattr(engine, "allocate_cache", counted)
    return allocated


def test_the_scheduler_starts_a_batch_without_the_request_the_runtime_refuses(pipeline, monkeypatch):
    """At the scheduler itself (ids that bypassed the server's own checks): the refused request is refused when it is
    submitted (``Pipeline.check_request``), before it is queued or any cache allocated; the others are admitted and run."""
    import asyncio

    from specdeploy.runtime.config import ConfigError
    from specdeploy.serve.scheduler import Scheduler

    scheduler = Scheduler(pipeline, GenerationConfig(k=3), 96, max_batch=4)
    allocated = _count_allocations(pipeline, monkeypatch)
    loop = asyncio.new_event_loop()
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    try:
        tickets = {}
        for ids in ([5, 6], [5, 1000], [7, 8]):
            try:
                tickets[tuple(ids)] = scheduler.intake.submit(np.array(ids, np.int64), config, loop)
            except ConfigError as exc:
                refused = exc
        assert "outside the vocabulary" in str(refused) and list(tickets) == [(5, 6), (7, 8)]
        assert len(scheduler.queue) == 2 and allocated == []  # refused before the queue, and before any cache
        scheduler._turn(scheduler._admit())
        assert scheduler.staging is None and scheduler.running.state.batch == 2
        while not scheduler.running.done:
            scheduler._turn([])
        loop.run_until_complete(asyncio.sleep(0))  # deliver what the scheduler's thread sent
        for ids, ticket in tickets.items():
            events = []
            while not ticket.events.empty():
                events.append(ticket.events.get_nowait())
            assert events[-1].kind == "done"
            assert events[-1].payload.token_ids == pipeline.generate([list(ids)], GenerationConfig(k=3, max_new_tokens=6,
                                                                                                  ignore_eos=True))[0].token_ids
    finally:
        loop.close()


def test_a_refused_request_is_a_400_before_it_is_queued_or_any_cache_is_allocated(pair_dir, monkeypatch):
    """Through the server: a prompt with an id outside the vocabulary and one whose max_tokens leave no room in this
    server's context are each a 400 naming the field; nothing was queued and no engine allocated a cache for them,
    and a good request right after is served (its batch allocating its caches)."""
    served = Pipeline.load(pair_dir)
    with serving(served, max_batch=2) as (url, scheduler):
        allocated = _count_allocations(served, monkeypatch)
        status, body = _post(url, {"model": "tiny", "prompt": [5, 6, 1000], "max_tokens": 4})
        assert status == 400 and "outside the vocabulary" in _error(status, body, 400)["message"]
        status, body = _post(url, {"model": "tiny", "prompt": "w5 " * 60, "max_tokens": 40})
        error = _error(status, body, 400)
        assert error["param"] == "max_tokens" and "this server's context is 96 tokens per request" in error["message"]
        assert allocated == [] and not scheduler.intake.busy
        status, body = _post(url, {"model": "tiny", "prompt": "w5 w6", "max_tokens": 4, "temperature": 0})
        assert status == 200 and allocated  # the check allocates nothing; starting a batch does


TOOLS_TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}"
                  "{% for name, p in t['function']['parameters']['properties'].items() %} w{{ p['n'] }}{% endfor %}"
                  "{% endfor %}{% for m in messages %} {{ m['content'] }}{% endfor %} w15")


def test_tools_a_template_fails_on_are_the_clients_400_naming_tools(pair_dir):
    loaded = Pipeline.load(pair_dir)
    loaded.codec.template = ChatTemplate({"chat_template": TOOLS_TEMPLATE})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "w9", "parameters": {"properties": {"x": {"n": 7}}}}}]}
    with serving(loaded) as (url, _):
        status, answer = _post(url, body, "/v1/chat/completions")
        assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == 4  # w9 w7 w5 w15
        body["tools"][0]["function"]["parameters"] = {"properties": "x"}  # a schema whose properties are no object
        error = _error(*_post(url, body, "/v1/chat/completions"), 400)
        assert error["param"] == "tools" and "tools: the chat template fails on them" in error["message"]
        body["tools"][0]["function"] = {"parameters": {}}  # no name: refused at the door, naming it
        error = _error(*_post(url, body, "/v1/chat/completions"), 400)
        assert error["param"] == "tools" and "tools.0.function.name" in error["message"]
