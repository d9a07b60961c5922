"""An imported artifact behind the prefix cache and the server, as an exported one is."""

from __future__ import annotations

import pytest

from specdeploy import GenerationConfig, Pipeline
from tests.foreign import PROMPTS

from ..serve.conftest import serving

CONFIG = GenerationConfig(max_new_tokens=16, ignore_eos=True, k=3, policy="fixed", drafter="model")


@pytest.mark.parametrize("name", ["genai-llama", "optimum-llama"])
def test_a_conversations_next_turn_through_the_prefix_cache_equals_a_cold_run(foreign, name):
    artifact = foreign["artifacts"][name]
    with Pipeline.load(artifact) as warm, Pipeline.load(artifact, prefix_cache_bytes=0) as cold:
        turn_1 = warm.generate([PROMPTS[0]], CONFIG)[0]
        conversation = [*PROMPTS[0], *turn_1.token_ids, 20, 21, 22]
        turn_2 = warm.generate([conversation], CONFIG)[0]
        assert turn_2.stats["cached_prompt_tokens"] == len(PROMPTS[0]) + len(turn_1.token_ids) - 1
        assert turn_2.token_ids == cold.generate([conversation], CONFIG)[0].token_ids


@pytest.mark.parametrize("name", ["genai-llama", "optimum-llama"])
def test_the_server_answers_over_an_imported_artifact(foreign, name):
    from openai import OpenAI

    with Pipeline.load(foreign["artifacts"][name]) as pipeline:
        alone = pipeline.generate(["w5 w6 w7"], CONFIG)[0]
        with serving(pipeline, max_batch=4, config=CONFIG) as (url, _):
            client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            response = client.completions.create(model="tiny", prompt="w5 w6 w7", temperature=0, max_tokens=16,
                                                 extra_body={"ignore_eos": True})
    assert response.choices[0].text == alone.text
    assert response.model_extra["speculative"]["drafted_tokens"] > 0
