"""The requests clients send, through the official openai client and plain HTTP: content-part arrays, the developer
and tool roles, tools passed to the chat template, null for optional fields, n > 1 and lists of prompts, logprobs
of the target's distribution, max_tokens left out; OpenAI's fields this server cannot honour refused by name; and
the request and response models checked against the openai package's own types."""

from __future__ import annotations

import json
import typing
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from openai import OpenAI

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.chat import ChatTemplate
from specdeploy.serve.protocol import ChatRequest, CompletionRequest, ToolCall

from .conftest import serving

# each role, each tool and the assistant's turn as a word of the tiny vocabulary, so the prompt shows what the
# template was given
ROLES_TEMPLATE = ("{% set word = {'system': 'w10', 'user': 'w11', 'assistant': 'w12', 'tool': 'w13'} %}"
                  "{% for m in messages %}{{ word[m['role']] }} {{ m['content'] }} "
                  "{% if m['tool_calls'] %}w{{ 20 + m['tool_calls'][0]['function']['arguments']['x'] }} {% endif %}"
                  "{% endfor %}{% for t in tools or [] %}w14 {% endfor %}{% if add_generation_prompt %}w15 {% endif %}")
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def roles_pipeline(pair_dir):
    loaded = Pipeline.load(pair_dir)
    loaded.codec.template = ChatTemplate({"chat_template": ROLES_TEMPLATE})
    return loaded


@pytest.fixture(scope="module")
def roles_server(roles_pipeline):
    with serving(roles_pipeline, max_batch=8, default_max_tokens=None) as (url, scheduler):
        yield url, scheduler


@pytest.fixture(scope="module")
def roles_client(roles_server):
    return OpenAI(base_url=f"{roles_server[0]}/v1", api_key="none", max_retries=0, timeout=60)


def _alone(pipeline, prompt, **settings) -> str:
    settings = {"max_new_tokens": 12, "ignore_eos": True, **settings}
    return pipeline.generate([prompt], GenerationConfig(k=3, **settings))[0].text


def test_content_parts_developer_and_tool_roles_and_tools_reach_the_template(roles_client, roles_pipeline):
    messages = [{"role": "developer", "content": "w5"},
                {"role": "user", "content": [{"type": "text", "text": "w6"}, {"type": "text", "text": "w7"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"x": 4}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "w8"}]}]
    tools = [{"type": "function", "function": {"name": "look", "description": "w9",
                                               "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
    answer = roles_client.chat.completions.create(model="tiny", messages=messages, tools=tools, **GREEDY)
    # developer as system; parts joined; the call's JSON arguments as an object; one w14 per tool; the turn opened
    prompt = "w10 w5 w11 w6 w7 w12 w24 w13 w8 w14 w15"
    assert answer.usage.prompt_tokens == len(prompt.split())
    assert answer.choices[0].message.content == _alone(roles_pipeline, prompt)
    unasked = roles_client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="none", **GREEDY)
    assert unasked.usage.prompt_tokens == len(prompt.split()) - 1  # no tools rendered when none may be called


def test_null_fields_mean_the_defaults(roles_client, roles_server, roles_pipeline):
    nulls = dict(max_tokens=None, top_p=None, stop=None, seed=None, n=None, stream_options=None, user=None,
                 presence_penalty=None, frequency_penalty=None, logit_bias=None, logprobs=None)
    answer = roles_client.completions.create(model="tiny", prompt="w5 w6", temperature=0, **nulls,
                                             extra_body={"ignore_eos": True, "top_k": None, "num_speculative_tokens": None})
    assert len(answer.choices) == 1 and answer.usage.completion_tokens == 96 - 2 - 4  # max_tokens: the room left
    chat = roles_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5", "name": None}],
                                                temperature=0, max_tokens=5, tools=None, tool_choice=None,
                                                response_format=None, top_logprobs=None, max_completion_tokens=None)
    assert chat.choices[0].message.content == _alone(roles_pipeline, "w11 w5 w15", max_new_tokens=5, ignore_eos=False)


def test_max_tokens_left_out_is_the_room_left_and_a_400_only_when_the_prompt_does_not_fit(roles_client, roles_pipeline):
    short = roles_client.completions.create(model="tiny", prompt="w5 w6 w7", temperature=0, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 96 - 3 - 4 and short.choices[0].finish_reason == "length"
    assert short.choices[0].text == _alone(roles_pipeline, "w5 w6 w7", max_new_tokens=89)
    tight = roles_client.completions.create(model="tiny", prompt=[5] * 91, temperature=0, extra_body={"ignore_eos": True})
    assert tight.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="no room for a new token") as refused:
        roles_client.completions.create(model="tiny", prompt=[5] * 92)
    assert refused.value.body["param"] == "prompt" and refused.value.body["code"] == "context_length_exceeded"


def test_n_choices_and_lists_of_prompts(roles_client, roles_pipeline):
    greedy = roles_client.completions.create(model="tiny", prompt="w5 w6", n=2, **GREEDY)
    expected = _alone(roles_pipeline, "w5 w6")
    assert [(c.index, c.text) for c in greedy.choices] == [(0, expected), (1, expected)]
    assert greedy.usage.prompt_tokens == 2 and greedy.usage.completion_tokens == 24  # the prompt counts once
    sampled = dict(model="tiny", messages=[{"role": "user", "content": "w40 w41"}], temperature=1.0, seed=11, max_tokens=16,
                   extra_body={"ignore_eos": True})
    two = roles_client.chat.completions.create(n=2, **sampled)
    one = roles_client.chat.completions.create(**sampled)
    texts = [c.message.content for c in two.choices]
    assert texts[0] == one.choices[0].message.content and texts[0] != texts[1]  # choice 0 is the seed's own
    streamed = {0: "", 1: ""}
    for chunk in roles_client.chat.completions.create(n=2, stream=True, **sampled):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == texts
    listed = roles_client.completions.create(model="tiny", prompt=["w5 w6", "w30 w31 w32"], **GREEDY)
    assert [c.text for c in listed.choices] == [expected, _alone(roles_pipeline, "w30 w31 w32")]
    assert listed.usage.prompt_tokens == 5
    ids = roles_client.completions.create(model="tiny", prompt=[[5, 6], [30, 31, 32]], **GREEDY)
    assert [c.text for c in ids.choices] == [c.text for c in listed.choices]



def test_a_list_of_prompts_on_a_fused_pair_drafted_by_the_model_is_each_prompts_own_answer(fused_dirs):
    """One request of three prompts, one of them a single token, on a fused pair (whose rows are prefilled one by one)
    with the draft model drafting: the draft's prefill of the staged rows once fed the one-token row, brought to
    0 tokens, an empty slice ("draft: input tensor input_ids | received empty shape (1, 0)"). Each answer is what
    plain decoding of its prompt alone gives."""
    pipeline = Pipeline.load(fused_dirs["close"])
    prompts = ["w30 w31 w30 w31", "w5 w6 w7 w8 w9", "w40"]
    assert [len(pipeline.encode(p)) for p in prompts] == [4, 5, 1]
    plain = GenerationConfig(drafter="none", max_new_tokens=12, ignore_eos=True)
    alone = [pipeline.generate([prompt], plain)[0].text for prompt in prompts]
    with serving(pipeline, max_batch=4) as (url, _):  # the model drafts at a fixed K of 3
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        listed = client.completions.create(model="tiny", prompt=prompts, **GREEDY)
    assert [c.text for c in listed.choices] == alone and listed.usage.prompt_tokens == 10


def _reference_logprobs(pipeline, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Each token's logprob from one plain prefill of prompt + tokens through the target."""
    ids = np.array([prompt + tokens[:-1]], np.int64)
    cache = pipeline.target.allocate_cache(1, ids.shape[1] + 1)
    logits = pipeline.target.infer(ids, np.array([0], np.int64), cache).logits[0, len(prompt) - 1:].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return logprobs[np.arange(len(tokens)), tokens]


def test_logprobs_are_the_targets_and_stream_as_they_come(roles_client, roles_pipeline):
    answer = roles_client.completions.create(model="tiny", prompt="w5 w6 w7", logprobs=3, **GREEDY)
    logprobs = answer.choices[0].logprobs
    tokens = roles_pipeline.generate(["w5 w6 w7"], GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert len(logprobs.tokens) == 12 and logprobs.tokens == [roles_pipeline.tokenizer.decode([t]) for t in tokens]
    assert np.allclose(logprobs.token_logprobs, _reference_logprobs(roles_pipeline, [5, 6, 7], tokens), atol=1e-4)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):  # greedy: the chosen token is the likeliest
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen)  # (token texts may coincide)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    messages = [{"role": "user", "content": "w5"}]
    chat = roles_client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    ids = roles_pipeline.generate([[11, 5, 15]], GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert np.allclose([item.logprob for item in content], _reference_logprobs(roles_pipeline, [11, 5, 15], ids), atol=1e-4)
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob for item in content)
    assert all(item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob for item in content)
    assert all(item.bytes == list(item.token.encode()) for item in content)
    streamed = [item for chunk in roles_client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=2, stream=True, **GREEDY)
        if chunk.choices and chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]  # the same text; each verification's arithmetic
    assert np.allclose([i.logprob for i in streamed], [i.logprob for i in content], atol=1e-4)  # differs in the last bits
    plain = roles_client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


@pytest.mark.parametrize("field,value,words", [
    ("response_format", {"type": "json_object"}, "does not constrain its output to JSON"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "JSON"),
    ("tool_choice", "required", "cannot force a tool call"),
    ("tool_choice", {"type": "function", "function": {"name": "look"}}, "cannot force a tool call"),
    ("modalities", ["text", "audio"], "text only"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
    ("prediction", {"type": "content", "content": "w5"}, "predicted outputs"),
    ("functions", [{"name": "look"}], "deprecated functions API"),
    ("reasoning_effort", "high", "reasoning"),
    ("presence_penalty", 0.5, "repetition_penalty"),
    ("logit_bias", {"5": 10}, "logit_bias"),
    ("top_logprobs", 2, "logprobs true"),
    ("stop", ["w5"] * 17, "at most 16"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], "text parts only"),
])
def test_what_this_server_cannot_honour_is_refused_by_name(roles_server, field, value, words):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4, field: value}
    status, answer = _post(f"{roles_server[0]}/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == field and words in answer["error"]["message"], answer


def test_text_response_format_and_auto_tool_choice_are_served(roles_client):
    answer = roles_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}],
                                                  response_format={"type": "text"}, tool_choice="auto", **GREEDY)
    assert answer.usage.completion_tokens == 12


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_every_openai_request_field_is_known(roles_server):
    """Each field of the openai package's create() parameters is taken (perhaps to no effect, as ``user``) or
    refused with a 400 that names it: none is met with a generic "extra inputs" answer."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    for params, model in ((chat_create_params.CompletionCreateParamsBase, ChatRequest),
                          (completion_create_params.CompletionCreateParamsBase, CompletionRequest)):
        fields = set(typing.get_type_hints(params)) | {"stream"}
        assert fields <= set(model.model_fields), sorted(fields - set(model.model_fields))


def test_responses_are_valid_openai_objects(roles_server):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    url = roles_server[0]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 6, "logprobs": True,
            "top_logprobs": 1, "n": 2, "ignore_eos": True}  # sampled (temperature 1): EOS must not end a choice early
    status, body = _post(f"{url}/v1/chat/completions", chat)
    assert status == 200 and ChatCompletion.model_validate(body, strict=False).choices[1].index == 1
    status, body = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 6, "logprobs": 2})
    assert status == 200 and Completion.model_validate(body).choices[0].logprobs.tokens
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(
        {**chat, "stream": True, "stream_options": {"include_usage": True}}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(data)) for data in events[:-1]]
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted((f.index, f.finish_reason) for f in finals) == [(0, "length"), (1, "length")]
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_a_tool_calls_json_arguments_reach_the_template_as_an_object():
    call = ToolCall.model_validate({"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}})
    assert call.for_template() == {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}}
    text = ToolCall.model_validate({"function": {"name": "f", "arguments": "not json"}})
    assert text.for_template()["function"]["arguments"] == "not json"
