"""The prefix cache: a later prompt that starts like an earlier request's text reuses its K/V, in its own scope only,
and decodes what it would have decoded without it."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.config import ConfigError
from specdeploy.runtime.prefix_cache import PrefixCache
from specdeploy.runtime.suffix import SuffixIndex
from specdeploy.runtime.suffix_store import SuffixStore

PROMPT = "w5 w6 w7 w8 w9 w10 w11 w12"
GREEDY = GenerationConfig(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def cold(pair_dir):
    """The same artifact with nothing kept: what each prompt decodes from a full prefill."""
    return Pipeline.load(pair_dir, prefix_cache_bytes=0)


@pytest.mark.parametrize("drafter", ["hybrid", "model", "none"])
def test_a_repeated_prompt_reuses_all_but_its_last_token_and_decodes_the_same(pair_dir, cold, drafter):
    pipeline = Pipeline.load(pair_dir)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True, drafter=drafter)
    first, again = (pipeline.generate([PROMPT], config)[0] for _ in range(2))
    assert first.stats["cached_prompt_tokens"] == 0
    assert again.stats["cached_prompt_tokens"] == len(pipeline.encode(PROMPT)) - 1
    assert again.token_ids == first.token_ids == cold.generate([PROMPT], config)[0].token_ids


@pytest.mark.parametrize("drafter", ["hybrid", "model"])
def test_a_conversations_next_turn_prefills_only_what_is_new(pair_dir, cold, drafter):
    """Turn 2 sends turn 1's prompt and answer again: the K/V the target (and the draft) computed for them is reused,
    and the answer is the one a cold pipeline gives."""
    pipeline = Pipeline.load(pair_dir)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True, drafter=drafter)
    turn_1 = pipeline.generate([PROMPT], config)[0]
    conversation = [*pipeline.encode(PROMPT).tolist(), *turn_1.token_ids, *pipeline.encode("w3 w4 w5").tolist()]
    turn_2 = pipeline.generate([conversation], config)[0]
    assert turn_2.stats["cached_prompt_tokens"] == len(pipeline.encode(PROMPT)) + len(turn_1.token_ids) - 1
    assert turn_2.token_ids == cold.generate([conversation], config)[0].token_ids
    assert len(pipeline.prefix_cache) == 1  # turn 2's text holds turn 1's: one is kept


def test_seeded_sampling_draws_the_same_tokens_with_a_reused_prefix(pair_dir, cold):
    pipeline = Pipeline.load(pair_dir)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=7)
    pipeline.generate([PROMPT], config)
    reused = pipeline.generate([PROMPT + " w13"], config)[0]
    assert reused.stats["cached_prompt_tokens"] > 0
    assert reused.token_ids == cold.generate([PROMPT + " w13"], config)[0].token_ids


def test_a_batch_reuses_per_row(pair_dir, cold):
    pipeline = Pipeline.load(pair_dir)
    pipeline.generate([PROMPT], GREEDY)
    prompts = ["w9 w8 w7 w6 w5", PROMPT + " w20 w21"]
    results = pipeline.generate(prompts, GREEDY)
    assert [r.stats["cached_prompt_tokens"] for r in results] == [0, len(pipeline.encode(PROMPT))]
    assert [r.token_ids for r in results] == [r.token_ids for r in cold.generate(prompts, GREEDY)]


def test_a_scope_never_reuses_another_scopes_text(pair_dir):
    """Two API keys are two scopes: the second key's identical prompt prefills from nothing; no scope (scope=None)
    keeps and reuses nothing. The index a request drafts from never names its scope: one of its own still reuses its
    scope's K/V."""
    pipeline = Pipeline.load(pair_dir)
    pipeline.generate([PROMPT], GREEDY, scope="key:mine")
    assert pipeline.generate([PROMPT], GREEDY, scope="key:theirs")[0].stats["cached_prompt_tokens"] == 0
    assert pipeline.generate([PROMPT], GREEDY, suffix_index=None, scope=None)[0].stats["cached_prompt_tokens"] == 0
    assert pipeline.generate([PROMPT], GREEDY, suffix_index=SuffixIndex(), scope="key:mine")[0].stats[
        "cached_prompt_tokens"] > 0
    assert pipeline.generate([PROMPT], GREEDY, suffix_index=SuffixIndex())[0].stats["cached_prompt_tokens"] == 0
    assert pipeline.generate([PROMPT], GREEDY)[0].stats["cached_prompt_tokens"] > 0  # the pipeline's scope, kept above
    assert pipeline.prefix_cache.scopes() == {"key:mine", "key:theirs", "default"}


def test_the_cache_keeps_its_bound_and_lets_the_least_recently_used_go(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    plain = GenerationConfig(max_new_tokens=20, ignore_eos=True, drafter="none")  # the target's K/V alone: one size
    prompts = ["w5 w6 w7 w8", "w9 w10 w11 w12", "w13 w14 w15 w16"]
    pipeline.generate([prompts[0]], plain)
    one = pipeline.prefix_cache.bytes
    pipeline.prefix_cache = PrefixCache(int(2.5 * one))  # room for two such texts
    for prompt in prompts:
        pipeline.generate([prompt], plain)
        assert pipeline.prefix_cache.bytes <= pipeline.prefix_cache.max_bytes
    assert len(pipeline.prefix_cache) == 2
    assert pipeline.generate([prompts[0]], plain)[0].stats["cached_prompt_tokens"] == 0  # the oldest went
    assert pipeline.generate([prompts[2]], plain)[0].stats["cached_prompt_tokens"] == 3
    nothing = PrefixCache(0)
    pipeline.prefix_cache = nothing
    pipeline.generate([prompts[2]], plain)
    assert len(nothing) == 0 and nothing.bytes == 0


def test_keep_and_reuse_copy_what_each_cache_saw(pair_dir):
    """On the caches alone: a kept row's slots are a copy (the batch's buffer may be reused), and a reuse fills the
    target's and the draft's rows up to what each saw, committing their lengths."""
    pipeline = Pipeline.load(pair_dir)
    target, draft = pipeline.target.allocate_cache(2, 32), pipeline.draft.allocate_cache(2, 32)
    target.stacked[:, 1] = np.random.default_rng(0).standard_normal(target.stacked[:, 1].shape)
    draft.stacked[:, 1] = 1.0
    target.commit([0, 10])
    draft.commit([0, 6])
    tokens = np.arange(32)
    scope, cache = object(), PrefixCache()
    cache.keep(scope, tokens, target, 1, draft)
    expected = target.stacked[:, 1, :, :9].copy()
    target.stacked[:, 1] = 0.0  # the batch moves on
    fresh_target, fresh_draft = pipeline.target.allocate_cache(1, 32), pipeline.draft.allocate_cache(1, 32)
    assert cache.reuse(scope, np.array([*range(9), 99, 98]), fresh_target, 0, fresh_draft) == 9
    assert fresh_target.past_len.tolist() == [9] and fresh_draft.past_len.tolist() == [6]
    np.testing.assert_array_equal(fresh_target.stacked[:, 0, :, :9], expected)
    assert (fresh_draft.stacked[:, 0, :, :6] == 1.0).all() and (fresh_draft.stacked[:, 0, :, 6:] == 0.0).all()
    assert cache.reuse(object(), np.arange(12), pipeline.target.allocate_cache(1, 32), 0) == 0  # another scope


@pytest.mark.parametrize("value", [-1, 1.5, "1GB", True])
def test_a_bad_prefix_cache_size_is_refused_in_one_line(pair_dir, value):
    with pytest.raises(ConfigError, match=r"^prefix_cache_bytes: got .*; expected an integer >= 0 \(0: none\)$"):
        Pipeline.load(pair_dir, prefix_cache_bytes=value)


def test_a_request_without_a_suffix_index_still_reuses_a_kept_prefix_of_its_scope(pair_dir):
    """suffix_index=None drafts from the request's own text alone; its K/V scope is still the pipeline's (or the one
    named), and only scope=None turns reuse off."""
    pipeline = Pipeline.load(pair_dir)
    pipeline.generate([PROMPT], GREEDY)
    prompt = len(pipeline.encode(PROMPT))
    assert pipeline.generate([PROMPT], GREEDY, suffix_index=None)[0].stats["cached_prompt_tokens"] == prompt - 1
    pipeline.generate([PROMPT], GREEDY, scope="key:a")
    assert pipeline.generate([PROMPT], GREEDY, suffix_index=None, scope="key:a")[0].stats["cached_prompt_tokens"] > 0
    assert pipeline.generate([PROMPT], GREEDY, suffix_index=None, scope=None)[0].stats["cached_prompt_tokens"] == 0


def test_scopes_cycled_through_a_small_store_leave_nothing_of_the_evicted_alive(pair_dir):
    """40 scopes through a store of 4: at most 4 suffix indexes stay alive (nothing else holds an evicted one, the
    prefix cache least of all), and no K/V is kept for a scope the store let go."""
    pipeline = Pipeline.load(pair_dir, suffix_store=SuffixStore(max_scopes=4))
    alive = []
    for i in range(40):
        assert pipeline.generate([f"w{i} w{i + 1} w{i + 2}"], GREEDY, scope=f"key:{i}")[0].token_ids
        alive.append(weakref.ref(pipeline.suffix_store.index(f"key:{i}")))
    gc.collect()
    live = {f"key:{i}" for i, ref in enumerate(alive) if ref() is not None}
    assert len(live) <= 4 and live == {f"key:{i}" for i in range(36, 40)}
    assert pipeline.prefix_cache.scopes() == live and len(pipeline.prefix_cache) == 4


def test_a_store_tells_its_listeners_which_scopes_it_evicted():
    store, gone = SuffixStore(max_scopes=2), []
    store.on_evict(gone.append)
    for name in ("a", "b", "a", "c", "d"):
        store.index(name)
    assert gone == ["b", "a"]  # "a" was used again after "b": "b" went first


def test_a_closed_pipeline_is_let_go_by_the_store_it_shared(pair_dir):
    """A store outlives the pipelines given it (a replay makes one per process it plays): one closed is no longer told
    of evictions, so the store does not keep it, its engines and its kept K/V alive."""
    store = SuffixStore(max_scopes=2)
    pipeline = Pipeline.load(pair_dir, suffix_store=store)
    pipeline.generate([PROMPT], GREEDY)
    kept = weakref.ref(pipeline.prefix_cache)
    pipeline.close()
    del pipeline
    gc.collect()
    assert kept() is None
    for name in ("a", "b", "c"):  # evictions tell no one
        store.index(name)
