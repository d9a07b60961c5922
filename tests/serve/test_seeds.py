"""A seeded request gives one text, whatever the server's policy decides, the draft lengths and the batch mates."""

from __future__ import annotations

import threading

from specdeploy import GenerationConfig

from .conftest import serving

SEEDED = dict(model="tiny", prompt="w30 w31 w30 w31", temperature=1.0, seed=42, max_tokens=24,
              extra_body={"ignore_eos": True})


def test_the_same_seeded_request_gives_one_text_in_turn_and_at_once_under_the_default_policy(pipeline):
    """The default speculation (the cost policy over the hybrid drafter) chooses each cycle's drafts by measured
    costs, so two runs of one request draft differently: keyed sampling makes that not change the text. Asked 10
    times in turn, 8 at once beside 4 unseeded requests, and with speculation off for the request, one text."""
    from openai import OpenAI

    with serving(pipeline, config=GenerationConfig(k=4), max_batch=16) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        in_turn = {client.completions.create(**SEEDED).choices[0].text for _ in range(10)}
        at_once, others, errors = [], [], []

        def ask(answers, **settings):
            try:
                answers.append(client.completions.create(**{**SEEDED, **settings}).choices[0].text)
            except Exception as exc:  # reported below: a thread's assertion would be lost
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(at_once,)) for _ in range(8)]
        threads += [threading.Thread(target=ask, args=(others,), kwargs=dict(seed=None, prompt=f"w{5 + i} w9"))
                    for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        plain = client.completions.create(**{**SEEDED, "extra_body": {"ignore_eos": True, "num_speculative_tokens": 0}})
    assert not errors and len(others) == 4
    (text,) = in_turn  # one text in 10 runs
    assert text and at_once == [text] * 8 and plain.choices[0].text == text


def test_an_exact_server_answers_what_exact_plain_decoding_gives(fused_dirs):
    """``serve --exact``: every request's rows run in exact mode, so a greedy answer, drafted, is exact-mode plain
    decoding's."""
    from openai import OpenAI

    from specdeploy import Pipeline

    pipeline = Pipeline.load(fused_dirs["close"])
    prompts = ["w30 w31 w30 w31", "w5 w6 w7 w8 w9", "w40"]
    plain = [r.text for r in pipeline.generate(prompts, GenerationConfig(drafter="none", max_new_tokens=20,
                                                                         ignore_eos=True, exact=True), batch_size=1)]
    config = GenerationConfig(k=3, policy="fixed", drafter="model", exact=True)
    with serving(pipeline, config=config, max_batch=4) as (url, scheduler):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        answers = [client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for prompt in prompts]
        assert scheduler.config.exact
    assert answers == plain
