"""Imported graphs driven by specdeploy: greedy output equal to their own tool's, speculation equal to plain decoding
(batch 1 and a ragged batch 2), a conversation's next turn through the prefix cache equal to a cold run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdeploy import GenerationConfig, Pipeline
from tests.foreign import NEW_TOKENS, PROMPTS

PLAIN = GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none", k=0)


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """The tokens before the first EOS (one tool returns the EOS it stopped at, the other may not)."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


@pytest.mark.parametrize("name", ["genai-llama", "genai-llama-int4", "genai-qwen3", "genai-qwen3-int4", "genai-gpt_oss",
                                  "genai-gpt_oss-int4", "optimum-llama", "optimum-qwen3"])
def test_greedy_output_equals_the_source_tools_own(foreign, name):
    with Pipeline.load(foreign["artifacts"][name], prefix_cache_bytes=0) as pipeline:
        eos = pipeline.manifest.target.eos_token_ids
        ours = [r.token_ids for r in pipeline.generate(PROMPTS, PLAIN, batch_size=1)]
    theirs = foreign["references"][name]
    assert [_until_eos(t, eos) for t in ours] == [_until_eos(t, eos) for t in theirs]
    assert sum(len(_until_eos(t, eos)) for t in theirs) >= NEW_TOKENS  # the comparison covers real tokens


SPECULATIVE = {
    "suffix": GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="suffix", k=4, policy="fixed", ignore_eos=True),
    "model": GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="model", k=3, policy="fixed", ignore_eos=True),
    "default": GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True),
}


# the llama artifacts carry a draft model imported from a folder of the same kind; the qwen3 and gpt-oss ones (a
# mixture of experts, MoE / QMoE ops) draft by lookup
CASES = [(name, drafter) for name in ("genai-llama", "optimum-llama") for drafter in SPECULATIVE] + [
    (name, drafter) for name in ("genai-qwen3-int4", "optimum-qwen3", "genai-gpt_oss", "genai-gpt_oss-int4")
    for drafter in ("suffix", "default")]


@pytest.mark.parametrize(("name", "drafter"), CASES)
def test_speculative_greedy_equals_plain_at_batch_1_and_a_ragged_batch_2(foreign, name, drafter):
    config = SPECULATIVE[drafter]
    with Pipeline.load(foreign["artifacts"][name], prefix_cache_bytes=0) as pipeline:
        plain = [r.token_ids for r in pipeline.generate(PROMPTS[:2], replace(PLAIN, ignore_eos=True), batch_size=1)]
        alone = [r.token_ids for r in pipeline.generate(PROMPTS[:2], config, batch_size=1)]
        together = pipeline.generate(PROMPTS[:2], config)  # prompts of 8 and 4 tokens: rows ragged from the start
    assert alone == plain
    assert [r.token_ids for r in together] == plain
    assert sum(sum(rec.accepted for rec in r.records) for r in together) > 0  # drafts were accepted: speculation ran


@pytest.mark.parametrize("name", ["genai-llama", "optimum-llama"])
def test_every_policy_keeps_greedy_output_and_a_seeded_requests_text_does_not_depend_on_its_drafter(foreign, name):
    with Pipeline.load(foreign["artifacts"][name], prefix_cache_bytes=0) as pipeline:
        plain = pipeline.generate(PROMPTS[:2], replace(PLAIN, ignore_eos=True), batch_size=1)
        for policy in ("fixed", "cost", "confidence", "heuristic"):
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, policy=policy, drafter="hybrid", k=4)
            assert [r.token_ids for r in pipeline.generate(PROMPTS[:2], config)] == [r.token_ids for r in plain], policy
        sampled = {drafter: [r.token_ids for r in pipeline.generate(PROMPTS[:2], GenerationConfig(
            max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, seed=11, drafter=drafter, k=3,
            policy="fixed" if drafter != "none" else "cost"))] for drafter in ("none", "model", "suffix")}
    assert sampled["model"] == sampled["none"] == sampled["suffix"]
    assert sampled["none"] != [r.token_ids for r in plain]  # sampled, not greedy
