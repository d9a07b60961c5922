"""What an operator puts in front of users: the API key, readiness apart from liveness, cancellation of a client
that gives up, request ids and the access log, and vLLM-named metrics that agree with the responses."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from specdeploy import GenerationConfig
from specdeploy.runtime.telemetry import FinishReason

from .conftest import metrics, serving, slowed

GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


def _get(url: str, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error), dict(error.headers)


def test_an_api_key_guards_every_route_but_the_probes_and_metrics(pipeline):
    with serving(pipeline, api_key="sekret-key") as (url, _):
        with pytest.raises(openai.AuthenticationError, match="a wrong key") as refused:
            OpenAI(base_url=f"{url}/v1", api_key="definitely-wrong", max_retries=0).completions.create(model="tiny", prompt="w5")
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        status, body, _ = _get(f"{url}/v1/models")
        assert status == 401 and "no Authorization header" in body["error"]["message"]
        status, body, headers = _get(f"{url}/v1/models", {"Authorization": "Basic sekret-key"})
        assert status == 401 and body["error"]["type"] == "authentication_error" and headers["www-authenticate"] == "Bearer"
        assert _get(f"{url}/v1/no-such-route")[0] == 401  # nothing about the routes is told without the key
        for path in ("/health", "/health/live", "/health/ready"):
            assert _get(f"{url}{path}")[0] == 200
        with urllib.request.urlopen(f"{url}/metrics") as response:
            assert b"vllm:num_requests_running" in response.read()
        client = OpenAI(base_url=f"{url}/v1", api_key="sekret-key", max_retries=0)
        assert client.completions.create(model="tiny", prompt="w5 w6", **GREEDY).usage.completion_tokens == 24


class _Cold:
    """A pipeline whose warm-up waits for ``gate``: a server still loading."""

    def __init__(self, pipeline, gate: threading.Event):
        self._pipeline, self._gate = pipeline, gate

    def __getattr__(self, name):
        return getattr(self._pipeline, name)

    def warm_up(self, *args):
        self._gate.wait(60)
        return self._pipeline.warm_up(*args)


def test_readiness_is_503_until_the_engines_are_warm_and_liveness_apart(pipeline):
    gate = threading.Event()
    with serving(_Cold(pipeline, gate), ready=False) as (url, scheduler):
        status, body, _ = _get(f"{url}/health")
        assert (status, body["status"]) == (503, "warming_up") and _get(f"{url}/health/ready")[0] == 503
        live = _get(f"{url}/health/live")
        # which server and machine answered: behind a load balancer, which of several
        assert live[:2] == (200, {"status": "alive", "server": body["server"], "node": socket.gethostname()})
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        early = []
        thread = threading.Thread(target=lambda: early.append(client.completions.create(model="tiny", prompt="w5 w6",
                                                                                          **GREEDY)))
        thread.start()  # a request before readiness waits in the queue; it is not refused
        deadline = time.monotonic() + 10
        while not scheduler.queue and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(scheduler.queue) == 1 and _get(f"{url}/health")[0] == 503
        gate.set()
        deadline = time.monotonic() + 30
        while _get(f"{url}/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _get(f"{url}/health")[1]["status"] == "ok" and scheduler.warm_up_seconds > 0
        thread.join()
    expected = pipeline.generate(["w5 w6"], GenerationConfig(k=3, max_new_tokens=24, ignore_eos=True))[0].text
    assert early[0].choices[0].text == expected


def test_a_client_that_times_out_is_cancelled_within_one_cycle_and_counted(pipeline):
    """The openai client gives up on a non-streaming request (its timeout): the row is freed on the scheduler's
    next turn, counted cancelled (vLLM: abort), not run to its max_tokens."""
    with serving(pipeline) as (url, scheduler):
        cancelled_at, finished = [], []
        cancel, on_finish = scheduler.intake.cancel, scheduler.on_finish

        def cancelling(tickets):
            cancelled_at.append(scheduler.running.cycle if scheduler.running else 0)
            cancel(tickets)

        def finishing(ticket, row):
            finished.append((row, scheduler.running.cycle if scheduler.running else 0))
            on_finish(ticket, row)

        scheduler.intake.cancel, scheduler.on_finish = cancelling, finishing
        impatient = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=0.5)
        with slowed(pipeline, 0.02), pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="tiny", prompt="w5 w6", temperature=0, max_tokens=80,
                                         extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 30
        while (scheduler.tickets or not finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        values = metrics(url)
    (row, cycle), = finished
    assert row.finish_reason == FinishReason.CANCELLED and len(row.token_ids) < 80
    assert cancelled_at and cycle - cancelled_at[0] <= 1  # the row left at the first turn after the disconnect
    assert values['specdeploy_requests_total{finish_reason="cancelled"}'] == 1
    assert values['vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'] == 1


def test_each_request_gets_an_id_echoed_and_one_access_log_line(client, server, caplog):
    url = server[0]
    with caplog.at_level(logging.INFO, logger="specdeploy.serve.access"):
        request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
            {"model": "tiny", "prompt": "w5", "max_tokens": 2}).encode(), headers={"Content-Type": "application/json",
                                                                                  "X-Request-Id": "trace-42.a"})
        with urllib.request.urlopen(request) as response:
            assert response.headers["x-request-id"] == "trace-42.a" and json.load(response)["id"] == "cmpl-trace-42.a"
        mine = client.completions.with_raw_response.create(model="tiny", prompt="w5", max_tokens=2)
        generated = mine.headers["x-request-id"]
        status, _, headers = _get(f"{url}/v1/nowhere", {"X-Request-Id": "bad id with spaces"})
    lines = [r.getMessage() for r in caplog.records if r.name == "specdeploy.serve.access"]
    assert sum("request_id=trace-42.a" in line and '"POST /v1/completions HTTP/1.1" 200' in line for line in lines) == 1
    assert sum(f"request_id={generated}" in line for line in lines) == 1 and len(generated) == 32
    assert status == 404 and headers["x-request-id"] != "bad id with spaces"  # not echoed: not an id
    assert sum(f"request_id={headers['x-request-id']}" in line and " 404 " in line for line in lines) == 1


def test_vllm_metrics_give_the_mean_accepted_length_the_responses_give(client, server):
    """vLLM's query, 1 + rate(accepted) / rate(drafts), over the counters' increase across some requests equals
    what the requests' own ``speculative`` blocks say; finish reasons and HTTP codes sit in separate labels."""
    url = server[0]
    before = metrics(url)
    blocks = [client.completions.create(model="tiny", prompt=p, **GREEDY).model_extra["speculative"]
              for p in ("w5 w6 w7", "w30 w31", "w12 w40 w7 w9")]
    with pytest.raises(openai.BadRequestError):  # a 400: an HTTP code, not a finish reason
        client.completions.create(model="tiny", prompt="w5", max_tokens=10**6)
    after = metrics(url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    labels = 'engine="0",model_name="tiny"'
    drafts, accepted = grew(f"vllm:spec_decode_num_drafts_total{{{labels}}}"), grew(
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}}")
    assert drafts == sum(b["drafts"] for b in blocks) > 0
    assert accepted == sum(b["accepted_tokens"] for b in blocks)
    assert grew(f"vllm:spec_decode_num_draft_tokens_total{{{labels}}}") == sum(b["drafted_tokens"] for b in blocks)
    assert 1 + accepted / drafts == pytest.approx(1 + sum(b["accepted_tokens"] for b in blocks) / sum(b["drafts"] for b in blocks))
    for block in blocks:  # each block's own figure is vLLM's definition over its drafts
        assert block["mean_accepted_length"] == pytest.approx(1 + block["accepted_tokens"] / block["drafts"], abs=1e-6)
    for position in range(3):  # 0-based, as vLLM labels them; a block whose drafts never reached a position has none
        assert grew(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",position="{position}"}}') \
            == sum(b["accepted_by_position"][position] for b in blocks if position < len(b["accepted_by_position"]))
    assert grew('specdeploy_requests_total{finish_reason="length"}') == 3
    assert grew('specdeploy_http_responses_total{route="/v1/completions",status="200"}') == 3
    assert grew('specdeploy_http_responses_total{route="/v1/completions",status="400"}') == 1
    assert not any("400" in name for name in after if name.startswith("specdeploy_requests_total"))
    assert grew(f"vllm:generation_tokens_total{{{labels}}}") == 72
    assert grew(f"vllm:time_to_first_token_seconds_count{{{labels}}}") == 3
    assert grew(f"vllm:e2e_request_latency_seconds_count{{{labels}}}") == 3
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "inter_token_latency_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert grew(f"vllm:{name}_count{{{labels}}}") >= 3, name
    assert 0.0 <= after[f"vllm:kv_cache_usage_perc{{{labels}}}"] <= 1.0


def test_the_kv_cache_usage_gauge_counts_the_rows_held(pipeline):
    with serving(pipeline, max_batch=2) as (url, scheduler), slowed(pipeline, 0.02):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        thread = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt="w5 w6", temperature=0,
                                                                           max_tokens=60, extra_body={"ignore_eos": True}))
        thread.start()
        deadline, seen = time.monotonic() + 30, 0.0
        while thread.is_alive() and time.monotonic() < deadline:
            seen = max(seen, metrics(url)['vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}'])
        thread.join()
        assert 0 < seen <= (2 + 60) / (2 * 96)  # one row of at most its prompt and tokens, of 2 rows x 96 slots
        assert metrics(url)['vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}'] == 0


def test_a_server_seed_makes_a_sequence_of_unseeded_requests_reproducible(pipeline):
    texts = []
    for _ in range(2):
        with serving(pipeline, seed=7) as (url, _):
            client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            texts.append([client.completions.create(model="tiny", prompt="w40 w41", temperature=1.0, max_tokens=16,
                                                    extra_body={"ignore_eos": True}).choices[0].text for _ in range(3)])
    assert texts[0] == texts[1] and len(set(texts[0])) > 1  # the same sequence, and not one text repeated
