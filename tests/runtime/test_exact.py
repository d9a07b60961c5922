"""Exact mode (``GenerationConfig.exact``): greedy speculative output is exact-mode plain output bit for bit, for every
drafter, k and batch, with the prefix cache on; not only the tokens, the logits each token was chosen from.

The tiny int4 and int8 targets are compressed as the real ones are: in the default mode their logits at a position
move by a few ulp between a one-token call and a verification (docs/results/exactness/), which is what exact mode
removes. Both graph forms give it; an explicit graph from before slot attention (``ModelSpec.slot_attention``)
cannot, and is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.config import ConfigError
from tests import tiny

# ragged: other lengths, and prompts that start like earlier ones' texts (the prefix cache reuses their K/V)
PROMPTS = [[5, 17, 33, 9, 40, 41, 12, 88, 7, 3, 60, 61], [7, 8], [100, 3, 4, 5, 6, 7, 8, 22, 1], [50] * 20,
           [5, 17, 33, 9, 40, 41, 12], [7, 8, 9, 10, 11]]
TOKENS = 24


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """(weights, graph) -> a tiny target and its perturbed draft, exported with those weights in that form."""
    root = tmp_path_factory.mktemp("exact")
    config = tiny.llama_config(head_dim=16, hidden_size=64, intermediate_size=128)  # head_dim 16: the fused form's least
    target = tiny.build_model(config, seed=0, conditioned=True)
    draft = tiny.build_model(config, seed=1, perturb_from=target, noise=0.05)
    saved = tiny.save_checkpoint(target, root / "t"), tiny.save_checkpoint(draft, root / "d")
    made = {}

    def get(weights: str, graph: str = "fused"):
        if (weights, graph) not in made:
            made[weights, graph] = tiny.export_cli(root / f"{weights}-{graph}", *saved, "--weights", weights,
                                                   "--graph", graph, "--capacity", "128")
        return made[weights, graph]

    return get


def decode(artifact, config: GenerationConfig, batch_size: int) -> list[tuple[list[int], np.ndarray]]:
    """Each prompt's tokens and the logits each was chosen from ([tokens, vocab]), on a fresh pipeline (prefix cache
    on: a later batch reuses the K/V of earlier ones' texts), ``batch_size`` prompts at a time."""
    pipeline = Pipeline.load(artifact)
    out = []
    for first in range(0, len(PROMPTS), batch_size):
        chosen: dict[int, list[np.ndarray]] = {}

        def heard(logits, committed, chosen=chosen):
            for b, (index, new) in enumerate(committed):  # token j of row b came from logits[b, j]
                chosen.setdefault(index, []).extend(logits[b, : len(new)].copy())

        run = pipeline.start(PROMPTS[first : first + batch_size], config, on_verified=heard)
        while not run.done:
            run.step()
        out += [(request.result.token_ids, np.stack(chosen[i])) for i, request in enumerate(run.requests)]
        assert all(request.result.finish_reason == "length" for request in run.requests)
    return out


def settings() -> list[tuple[str, int, int]]:
    """(drafter, k, batch size): every drafter at every k, each pair at one batch size, turning through 1-4 so that
    each drafter meets three batch sizes and each k all four (the fused form runs the whole product)."""
    pairs = [(drafter, k) for drafter in ("model", "suffix", "prompt-lookup", "hybrid") for k in (1, 4, 8)]
    return [(drafter, k, 1 + i % 4) for i, (drafter, k) in enumerate(pairs)]


@pytest.mark.parametrize("weights, graph", [("int4", "fused"), ("int8", "fused"), ("int4", "explicit"),
                                            ("int8", "explicit")])
def test_exact_speculation_is_exact_plain_decoding_bit_for_bit(compressed, weights, graph):
    artifact = compressed(weights, graph)
    plain = decode(artifact, GenerationConfig(drafter="none", max_new_tokens=TOKENS, ignore_eos=True, exact=True), 1)
    runs = settings() if graph == "explicit" else [
        (drafter, k, batch_size) for batch_size in (1, 2, 3, 4) for drafter in ("model", "suffix", "prompt-lookup",
                                                                                "hybrid") for k in (1, 4, 8)]
    for drafter, k, batch_size in runs:
        config = GenerationConfig(drafter=drafter, k=k, policy="fixed", max_new_tokens=TOKENS, ignore_eos=True,
                                  exact=True)
        for i, ((tokens, logits), (plain_tokens, plain_logits)) in enumerate(
                zip(decode(artifact, config, batch_size), plain)):
            where = f"{weights} {graph}, batch {batch_size}, {drafter}, k={k}, prompt {i}"
            assert tokens == plain_tokens, where
            assert np.array_equal(logits, plain_logits), f"{where}: logits differ by up to " \
                                                         f"{np.abs(logits - plain_logits).max():.2e}"


def test_exact_plain_decoding_does_not_depend_on_the_batch(compressed):
    """Exact-mode plain decoding of a prompt beside others (and, at batch 1, over K/V an earlier request left in the
    prefix cache) is its decoding alone."""
    artifact = compressed("int4")
    config = GenerationConfig(drafter="none", max_new_tokens=TOKENS, ignore_eos=True, exact=True)
    alone = [(tokens, logits) for tokens, logits in decode(artifact, config, 1)]
    for batch_size in (2, 4):
        for (tokens, logits), (alone_tokens, alone_logits) in zip(decode(artifact, config, batch_size), alone):
            assert tokens == alone_tokens and np.array_equal(logits, alone_logits)


def test_the_prefix_cache_was_used(compressed):
    """The later prompts that start like earlier texts reuse their K/V (so the tests above cover K/V that decode
    steps wrote and a later prompt reads)."""
    pipeline = Pipeline.load(compressed("int4"))
    config = GenerationConfig(max_new_tokens=TOKENS, ignore_eos=True, exact=True, k=4, policy="fixed")
    cached = [result.stats["cached_prompt_tokens"] for result in pipeline.generate(PROMPTS, config, batch_size=1)]
    assert cached[4] > 0 and cached[5] > 0, cached


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_seeded_sampling_in_exact_mode_is_reproducible(compressed, weights):
    artifact = compressed(weights)
    for drafter in ("none", "model", "hybrid"):
        for batch_size in (1, 3):
            config = GenerationConfig(drafter=drafter, k=4, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=TOKENS,
                                      ignore_eos=True, exact=True)
            first, again = (decode(artifact, config, batch_size) for _ in range(2))
            for (tokens, logits), (tokens_again, logits_again) in zip(first, again):
                assert tokens == tokens_again and np.array_equal(logits, logits_again), (drafter, batch_size)


def test_the_result_says_which_mode_it_ran(compressed):
    pipeline = Pipeline.load(compressed("int8"))
    for exact in (False, True):
        config = GenerationConfig(max_new_tokens=4, exact=exact)
        assert pipeline.generate([PROMPTS[0]], config)[0].stats["exact"] is exact


def test_exact_mode_refuses_an_explicit_graph_from_before_slot_attention(compressed, tmp_path):
    """An older exporter's explicit graph scored a call's own keys apart from the cache's; its manifest lacks
    ``slot_attention`` (here: the flag taken out of a new one's)."""
    older = shutil.copytree(compressed("int8", "explicit"), tmp_path / "older")
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["models"]["target"]["slot_attention"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    pipeline = Pipeline.load(older)
    with pytest.raises(ConfigError, match="exact: the target's graph is an older exporter's explicit form, .* re-export"):
        pipeline.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=4, exact=True))
    assert pipeline.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=4))[0].token_ids  # the default still runs


def test_a_batch_takes_one_mode(compressed):
    pipeline = Pipeline.load(compressed("int4"))
    with pytest.raises(ConfigError, match="row_configs: exact=False in a batch of exact=True"):
        pipeline.start(PROMPTS[:2], GenerationConfig(exact=True), row_configs=[GenerationConfig(exact=True),
                                                                               GenerationConfig()])
    exact = pipeline.start(PROMPTS[:1], GenerationConfig(max_new_tokens=4, exact=True), capacity=64)
    default = pipeline.start(PROMPTS[1:2], GenerationConfig(max_new_tokens=4), capacity=64)
    for run in (exact, default):
        run.prefill()
    with pytest.raises(ConfigError, match="other: exact=False; expected this batch's exact=True"):
        exact.merge(default)


def test_exact_is_a_bool():
    with pytest.raises(ConfigError, match="exact: got 1; expected True or False"):
        GenerationConfig(exact=1)
