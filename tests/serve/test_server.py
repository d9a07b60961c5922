"""specdeploy serve, through the official openai client: completions and chat, streamed and not,
continuous batching, cancellation, backpressure, and every bad request answered with a clear 4xx."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai  # the official client, from the dev extra
import pytest

from specdeploy import GenerationConfig, Pipeline

from ..runtime.stubs import Judge
from .conftest import metrics, serving

GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


def _alone(pipeline, prompt, **settings):
    config = GenerationConfig(k=3, policy="fixed", drafter="model", **settings)  # the test server's speculation
    return pipeline.generate([prompt], config)[0]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(f"{server[0]}/health") as response:
        assert json.load(response)["status"] == "ok"


def test_completion_equals_the_pipelines_greedy_output(client, pipeline, server):
    response = client.completions.create(model="tiny", prompt="w5 w6 w7", **GREEDY)
    assert server[1].warm_up_seconds > 0  # the engines warmed up before the first request was served
    alone = _alone(pipeline, "w5 w6 w7", max_new_tokens=24, ignore_eos=True)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (alone.text, "length")
    assert response.usage.completion_tokens == 24 and response.usage.prompt_tokens == len(pipeline.encode("w5 w6 w7"))
    speculative = response.model_extra["speculative"]
    assert speculative["drafted_tokens"] > 0 and 0 <= speculative["accepted_tokens"] <= speculative["drafted_tokens"]
    assert speculative["accepted_by_position"][0] >= speculative["accepted_by_position"][-1]
    assert speculative["cycles"] == len(alone.records)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_whole_text_and_never_shows_a_partial_stop_string(client, pipeline, chat):
    prompt = "w12 w40 w7 w9"
    messages = [{"role": "user", "content": prompt}]
    plain = GenerationConfig(k=3, max_new_tokens=24, ignore_eos=True)
    words = (pipeline.chat(messages, plain) if chat else pipeline.generate([prompt], plain)[0]).text.split()
    # two words it reaches mid-way, and not before: a stop string spanning tokens
    stop = next(" ".join(words[i : i + 2]) for i in range(4, len(words) - 1)
                if " ".join(words[i : i + 2]) not in " ".join(words[: i + 1]))
    kwargs = dict(model="tiny", stop=[stop], **GREEDY)
    if chat:
        whole = client.chat.completions.create(messages=messages, **kwargs)
        text, reason = whole.choices[0].message.content, whole.choices[0].finish_reason
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(messages=messages, stream=True,
                                                                                            **kwargs) if c.choices]
        assert text == pipeline.chat(messages, GenerationConfig(k=3, max_new_tokens=24, ignore_eos=True, stop=(stop,))).text
    else:
        whole = client.completions.create(prompt=prompt, **kwargs)
        text, reason = whole.choices[0].text, whole.choices[0].finish_reason
        chunks = [c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kwargs)]
    assert reason == "stop" and stop not in text and text
    assert "".join(chunks) == text
    shown = ""
    for chunk in chunks:  # at every point, what was streamed is a prefix of the final text
        shown += chunk
        assert text.startswith(shown)
    assert len([c for c in chunks if c]) > 1


def test_stream_reports_usage_when_asked(client):
    chunks = list(client.completions.create(model="tiny", prompt="w5 w6", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length" and "speculative" in chunks[-2].model_extra


def test_a_request_among_seven_running_decodes_as_alone(client, pipeline, server):
    prompts = [f"w{10 + i} w{20 + i} w{10 + i}" for i in range(7)]
    results, errors = {}, []

    def run(prompt):
        try:
            stream = client.completions.create(model="tiny", prompt=prompt, stream=True, temperature=0, max_tokens=60,
                                               extra_body={"ignore_eos": True})
            results[prompt] = "".join(c.choices[0].text for c in stream)
        except Exception as exc:  # reported below: a thread's assertion would be lost
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while server[1].row_count < 7 and time.monotonic() < deadline:  # the seven are decoding
        time.sleep(0.001)
    late = client.completions.create(model="tiny", prompt="w5 w6 w7", **GREEDY)
    sampled = client.completions.create(model="tiny", prompt="w40 w41", temperature=1.0, seed=3, max_tokens=20,
                                        extra_body={"ignore_eos": True})
    for thread in threads:
        thread.join()
    assert not errors
    assert late.choices[0].text == _alone(pipeline, "w5 w6 w7", max_new_tokens=24, ignore_eos=True).text
    assert sampled.choices[0].text == _alone(pipeline, "w40 w41", max_new_tokens=20, ignore_eos=True, temperature=1.0,
                                             seed=3).text
    for prompt in prompts:
        assert results[prompt] == _alone(pipeline, prompt, max_new_tokens=60, ignore_eos=True).text


def test_a_client_that_disconnects_mid_stream_frees_its_row(client, server):
    url, scheduler = server
    request = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": "w5", "stream": True, "temperature": 0,
                                                      "max_tokens": 90, "ignore_eos": True}).encode())
    response = urllib.request.urlopen(request)
    assert response.readline().startswith(b"data: ")  # it is decoding
    response.close()  # gone, 90 tokens early
    deadline = time.monotonic() + 10
    while scheduler.row_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.row_count == 0 and not scheduler.tickets
    assert metrics(url)['specdeploy_requests_total{finish_reason="cancelled"}'] == 1  # it left; it did not finish
    for _ in range(3):  # and the server goes on
        assert client.completions.create(model="tiny", prompt="w8 w9", **GREEDY).choices[0].finish_reason == "length"


def test_a_full_queue_answers_429_with_a_retry_hint(pipeline):
    with serving(pipeline, start_scheduler=False, max_batch=1, max_queue=2) as (url, scheduler):
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=2)
        waiting = []
        for _ in range(2):  # the scheduler is held: these two wait in the queue
            thread = threading.Thread(target=lambda: waiting.append(_swallow(client, "w5")))
            thread.start()
        deadline = time.monotonic() + 10
        while len(scheduler.queue) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="w6", max_tokens=4)
        assert refused.value.status_code == 429 and int(refused.value.response.headers["retry-after"]) >= 1
        assert "--max-queue 2" in refused.value.message


def _swallow(client, prompt):
    try:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    except openai.APITimeoutError as exc:
        return exc


def _post(url: str, body: bytes, content_type: str = "application/json"):
    request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.mark.parametrize("body,status,param,words", [
    (b'{"model": "tiny", "prompt": "w5",', 400, None, "not valid JSON"),
    (json.dumps({"model": "tiny", "prompt": "w5", "max_tokens": "5"}).encode(), 400, "max_tokens", "valid integer"),
    (json.dumps({"model": "tiny", "prompt": "w5", "max_tokens": -3}).encode(), 400, "max_tokens", "greater than or equal to 1"),
    (json.dumps({"model": "tiny", "prompt": "w5", "temperature": "hot"}).encode(), 400, "temperature", "valid number"),
    (json.dumps({"model": "tiny", "prompt": "w5", "n": 17}).encode(), 400, "n", "less than or equal to 16"),
    (json.dumps({"model": "tiny", "prompt": "w5", "best_of": 3}).encode(), 400, "best_of", "every choice"),
    (json.dumps({"model": "tiny", "prompt": "w5", "best_Of": 3}).encode(), 400, "best_Of", "Extra inputs"),
    (json.dumps({"model": "tiny", "prompt": "w5", "num_speculative_tokens": 9}).encode(), 400, "num_speculative_tokens",
     "at most 3"),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "prompt", "empty"),
    (json.dumps({"model": "tiny", "prompt": [5, 10**6]}).encode(), 400, "prompt", "outside the vocabulary"),
    (json.dumps({"model": "tiny", "prompt": "w5 " * 80, "max_tokens": 40}).encode(), 400, "max_tokens", "context"),
    (json.dumps({"model": "gpt-4", "prompt": "w5"}).encode(), 404, "model", "serves 'tiny'"),
    (json.dumps({"prompt": "w5"}).encode(), 400, "model", "Field required"),
    (b"[1, 2]", 400, None, "expected a JSON object"),
    (json.dumps({"model": "tiny", "prompt": "w5 " * 3_500_000}).encode(), 413, None, "takes bodies of at most"),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server, client, body, status, param, words):
    got, answer = _post(server[0], body)
    assert got == status, answer
    error = answer["error"]
    assert words in error["message"] and error["param"] == param and error["type"]
    assert client.completions.create(model="tiny", prompt="w5 w6", **GREEDY).usage.completion_tokens == 24


def test_bad_chat_requests(server, client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "w5"}])


def test_metrics_count_requests_and_speculation(server, client):
    client.completions.create(model="tiny", prompt="w5 w6 w7", **GREEDY)
    values = metrics(server[0])
    assert values['specdeploy_requests_total{finish_reason="length"}'] >= 1
    assert values["specdeploy_drafted_tokens_total"] >= values['specdeploy_accepted_tokens_total{position="1"}'] > 0
    assert "specdeploy_running_rows" in values and "specdeploy_queued_requests" in values


@pytest.mark.parametrize("pays", [False, True])
def test_joining_requests_prefill_the_draft_only_when_the_policy_finds_it_pays(pair_dir, pays):
    """Under load the draft's prefill of joining requests can cost more than speculation saves: the scheduler
    asks the policy, skips it when it does not pay (those requests decode plainly), and the text is the same."""
    pipeline = Pipeline.load(pair_dir, prefix_cache_bytes=0)  # prompts new to both models, whatever ran before
    prompts = ["w5 w6 w7 w8", "w10 w11 w12 w13", "w20 w21 w22 w23"]  # each behind by more than a cycle leaves
    with serving(pipeline, max_batch=4, prefill_chunk=2) as (url, scheduler):
        scheduler.policy = judge = Judge(pays)
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        results = {}
        threads = [threading.Thread(target=lambda p=p: results.update({p: client.completions.create(
            model="tiny", prompt=p, **GREEDY)})) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert {p: r.choices[0].text for p, r in results.items()} == {
        p: _alone(pipeline, p, max_new_tokens=24, ignore_eos=True).text for p in prompts}
    drafted = [r.model_extra["speculative"]["drafted_tokens"] for r in results.values()]
    assert judge.asked and all(batch >= 1 and behind > 0 for batch, behind, _ in judge.asked)
    assert all(n > 0 for n in drafted) if pays else drafted == [0, 0, 0]
    assert (sum(judge.fed) > 0) == pays  # the draft prefilled the prompts only when it paid


def test_the_drafts_prefill_is_judged_after_the_targets_with_the_requests_queued_meanwhile(pipeline):
    """The clients of a burst arrive a few ms apart: the first request is admitted alone, and the others queue
    while the target prefills it. Judged at admission, alone, the draft prefilled it for a batch that then
    decoded plainly; the scheduler asks after the target's chunk, counting the queued requests' rows, prompts
    and tokens to come, and so does the running batch's cycle before they join."""
    import asyncio

    from specdeploy.serve.scheduler import Scheduler

    scheduler = Scheduler(pipeline, GenerationConfig(k=3), 96, max_batch=3, prefill_chunk=64)
    scheduler.policy = judge = Judge(False)
    loop = asyncio.new_event_loop()
    prompts = [pipeline.encode(p) for p in ("w5 w6 w7 w8", "w10 w11 w12", "w20 w21", "w30")]
    config = GenerationConfig(max_new_tokens=10)
    scheduler.intake.submit(prompts[0], config, loop)
    infer_impl = pipeline.target.infer_impl

    def arriving(*args):  # three more requests arrive while the target prefills the first
        pipeline.target.infer_impl = infer_impl
        for prompt in prompts[1:]:
            scheduler.intake.submit(prompt, config, loop)
        return infer_impl(*args)

    pipeline.target.infer_impl = arriving
    try:
        scheduler._turn(scheduler._admit())
    finally:
        pipeline.target.infer_impl = infer_impl
        loop.close()
    behind = sum(len(p) - 2 for p in prompts[:3])  # the staged row's prompt, and the 2 queued ones that fit
    assert judge.asked[0] == (3, behind, 30) and not judge.fed  # a batch of 3: the draft did not prefill the first
    # then the first row's cycle, alone until the others are prefilled: its catch-up is judged for the same batch
    assert judge.asked[1] == (3, behind, 30) and len(judge.asked) == 2 and len(scheduler.queue) == 3


def test_an_emptied_batch_lends_its_cache_memory_to_the_next_rows(pipeline):
    """Allocated afresh for each wave of requests, the real pair's caches for 8 rows took 1.4 s a merge (page
    faults and copies). The emptied running batch stays: the next rows take its memory, forget the rows that left,
    and decode as they would alone."""
    import asyncio

    from specdeploy.serve.scheduler import Scheduler

    finished = []
    scheduler = Scheduler(pipeline, GenerationConfig(k=3), 96, max_batch=4, prefill_chunk=64,
                          on_finish=lambda ticket, row: finished.append(row))
    loop = asyncio.new_event_loop()

    def serve(*prompts):
        for prompt in prompts:
            scheduler.intake.submit(pipeline.encode(prompt), GenerationConfig(max_new_tokens=12, ignore_eos=True), loop)
        while scheduler.queue or scheduler.staging or not scheduler.running.done:
            scheduler._turn(scheduler._admit())

    try:
        serve("w5 w6 w7", "w10 w11 w12")
        running, held = scheduler.running, scheduler.running.cache.held
        serve("w20 w21 w22")
    finally:
        loop.close()
    assert scheduler.running is running and running.cache.held is held and len(running.state.results) == 1
    texts = {pipeline.decode(row.prompt_ids): pipeline.decode(row.token_ids) for row in finished}
    assert texts == {p: _alone(pipeline, p, max_new_tokens=12, ignore_eos=True).text
                     for p in ("w5 w6 w7", "w10 w11 w12", "w20 w21 w22")}
