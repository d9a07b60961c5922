"""After any sequence of cycles, the committed cache prefix equals a fresh prefill of the committed tokens."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.engines.base import KVCache
from specdeploy.runtime.cache import CapacityError, plan_capacity
from specdeploy.runtime.policies import Policy


class RandomK(Policy):
    """A policy that drafts a random number of tokens each cycle (0 included), by each source."""

    def __init__(self, most, seed):
        self.most, self.rng = most, np.random.default_rng(seed)

    def next_k(self, batch, lookup=False):
        return int(self.rng.integers(0, self.most + 1))


def _fresh_prefill(engine, tokens):
    out = engine.infer(tokens[None], np.zeros(1, np.int64), engine.allocate_cache(1, len(tokens)))
    return out.new_kv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_committed_prefix_equals_fresh_prefill(pair_dir, seed, temperature):
    pipeline = Pipeline.load(pair_dir)
    prompts = ["w5 w6 w7", "w10 w11 w12 w13 w14 w15", "w20", "w30 w31 w30 w31"]
    config = GenerationConfig(k=6, max_new_tokens=40, temperature=temperature, seed=seed, ignore_eos=True)
    run = pipeline.start(prompts, config)
    run.policy = RandomK(6, seed)
    rng = np.random.default_rng(seed)
    for _ in range(int(rng.integers(3, 9))):
        run.step()
    # the target has seen every committed token but the last; the draft at most all of them
    np.testing.assert_array_equal(run.cache.past_len, run.lengths - 1)
    for cache, engine in ((run.cache, pipeline.target), (run.draft_cache, pipeline.draft)):
        for b in range(len(run.active)):
            n = int(cache.past_len[b])
            assert n <= run.lengths[b]
            fresh = _fresh_prefill(engine, run.tokens[b, :n])
            for buf, ref in zip(cache.buffers, fresh):
                np.testing.assert_allclose(buf[b, :, :n], ref[0], atol=1e-4, rtol=1e-4)


def test_rows_never_read_another_rows_slots(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    engine = pipeline.target
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    alone = engine.infer(ids[:1], np.array([3]), engine.allocate_cache(1, 16))
    cache = engine.allocate_cache(2, 16)
    for buf in cache:
        buf[1] = np.nan  # poison every slot of the other row
        buf[0, :, 3:] = 1e4  # and row 0's own slots beyond its past_len
    together = engine.infer(ids, np.array([3, 0]), cache)
    assert np.isfinite(together.logits[0]).all()
    np.testing.assert_allclose(together.logits[0], alone.logits[0], atol=1e-5)


def test_stage_writes_each_row_at_its_own_offset():
    cache = KVCache(np.zeros((1, 2, 1, 8, 2), np.float32))
    new = [np.arange(2 * 1 * 3 * 2, dtype=np.float32).reshape(2, 1, 3, 2) + 1]
    cache.stage(new, np.array([1, 4]))
    np.testing.assert_array_equal(cache.buffers[0][0, :, 1:4], new[0][0])
    np.testing.assert_array_equal(cache.buffers[0][1, :, 4:7], new[0][1])
    assert cache.buffers[0][0, :, 4:].sum() == 0 and cache.buffers[0][1, :, :4].sum() == 0


def test_capacity_is_planned_and_refused_with_the_numbers():
    assert plan_capacity([5, 9], max_new_tokens=10, k=4, limit=100) == 9 + 10 + 4 + 1
    with pytest.raises(CapacityError, match=r"9 tokens.*max_new_tokens \(90\).*k \(4\).*104.*capacity 100"):
        plan_capacity([5, 9], max_new_tokens=90, k=4, limit=100)


def test_a_fused_graph_feeds_each_row_its_own_tokens(fused_dirs):
    """The fused form runs a batch's multi-token calls row by row: prefill and the draft's catch-up feed each row
    only what it lacks (padded to the longest row, a catch-up of one joining row computed its prompt once per row
    of the batch), with the cache and logits of feeding each row alone."""
    from specdeploy.engines.base import feed, prefill

    engine = Pipeline.load(fused_dirs["close"]).target
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 0, 0, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35, 0, 0, 0]])
    cache = engine.allocate_cache(3, 16)
    calls = []
    infer_impl = engine.infer_impl
    engine.infer_impl = lambda ids, past, c, kept: calls.append((ids.shape, past.tolist(), kept)) or infer_impl(
        ids, past, c, kept)
    try:
        # every call asks for its last position's logits alone, and this graph computes no more (trims_logits)
        prefill(engine, cache, tokens, [8, 2, 5])
        assert calls == [((1, 8), [0], 1), ((1, 2), [0], 1), ((1, 5), [0], 1)] and cache.past_len.tolist() == [8, 2, 5]
        calls.clear()
        logits, width = feed(engine, cache, tokens, [9, 3, 5])  # row 2 has nothing new: its last token again
        assert width == 1 and calls == [((3, 1), [8, 2, 4], 1)]  # one token each: one batched call, as before
        calls.clear()
        cache.commit([7, 2, 5])
        logits, width = feed(engine, cache, tokens, [9, 3, 5])
        assert width == 2 and calls == [((1, 2), [7], 1), ((1, 1), [2], 1), ((1, 1), [4], 1)]
    finally:
        engine.infer_impl = infer_impl
    for b, end in enumerate([9, 3, 5]):
        alone = engine.allocate_cache(1, 16)
        reference = engine.infer(tokens[b : b + 1, :end], np.zeros(1, np.int64), alone).logits[0, -1]
        np.testing.assert_allclose(logits[b], reference, atol=1e-4, rtol=1e-4)
        for buf, ref in zip(cache.buffers, alone.buffers):
            np.testing.assert_allclose(buf[b, :, :end], ref[0, :, :end], atol=1e-4, rtol=1e-4)



def test_a_fused_graphs_prefill_leaves_a_row_brought_to_no_tokens_unfed(fused_dirs):
    """A one-token prompt's prefill stops at length - 1 = 0 tokens: fed row by row beside longer rows, that row has no
    token to re-feed (it was once fed an empty slice, its length moved to -1: "input_ids | received empty shape
    (1, 0)"). It is not fed, its length stays 0 and its logits are NaN; the other rows' are what they are alone."""
    from specdeploy.engines.base import feed

    engine = Pipeline.load(fused_dirs["close"]).target
    tokens = np.array([[5, 6, 7, 8], [20, 21, 22, 23], [30, 0, 0, 0]])
    cache = engine.allocate_cache(3, 16)
    logits, width = feed(engine, cache, tokens, [3, 4, 0])
    assert width == 4 and cache.past_len.tolist() == [3, 4, 0] and np.isnan(logits[2]).all()
    alone = engine.infer(tokens[1:2], np.zeros(1, np.int64), engine.allocate_cache(1, 16)).logits[0, -1]
    np.testing.assert_allclose(logits[1], alone, atol=1e-4, rtol=1e-4)


def test_rows_that_leave_free_their_memory_for_the_next_to_join():
    """A leave moves the rows that stay up over those that left, and a join takes that memory: no new array per
    leave or join (at 8 rows of the real pair's 1024-slot caches, a copy moved 470 MB). Each row keeps its valid
    K/V and length, each layer's rows stay one contiguous block (as engines bind them), and views never write
    through."""
    cache = KVCache(np.arange(2 * 4 * 3 * 2, dtype=np.float32).reshape(2, 4, 1, 3, 2))
    cache.commit([3, 1, 2, 0])
    rows = {b: cache.stacked[:, b].copy() for b in range(4)}
    kept = cache.select([0, 2])
    assert np.shares_memory(kept.stacked, cache.stacked) and kept.past_len.tolist() == [3, 2]
    np.testing.assert_array_equal(kept.stacked[:, 1, :, :2], rows[2][:, :, :2])
    assert all(buf.flags.c_contiguous for buf in kept.buffers)
    joining = KVCache(np.full((2, 2, 1, 3, 2), -1.0, np.float32))
    joining.commit([1, 2])
    joined = kept.extend(joining)
    assert np.shares_memory(joined.stacked, cache.stacked) and joined.past_len.tolist() == [3, 2, 1, 2]
    np.testing.assert_array_equal(joined.stacked[:, 0], rows[0])
    np.testing.assert_array_equal(joined.stacked[:, 1, :, :2], rows[2][:, :, :2])
    assert (joined.stacked[:, 2, :, :1] == -1).all() and (joined.stacked[:, 3, :, :2] == -1).all()
    assert all(buf.flags.c_contiguous for buf in joined.buffers)
    grown = joined.extend(joining)  # no room left: a new allocation with every row
    assert not np.shares_memory(grown.stacked, cache.stacked) and grown.shape[1] == 6
    for b, n in enumerate(joined.past_len.tolist()):
        np.testing.assert_array_equal(grown.stacked[:, b, :, :n], joined.stacked[:, b, :, :n])
    assert np.isfinite(grown.stacked).all()  # slots never written are zeros, which no masked attention turns to NaN
    view = grown.rows(1, 3)  # a view into the batch: its select copies, its extend allocates
    before = grown.stacked.copy()
    view.select([1])
    view.extend(joining)
    np.testing.assert_array_equal(grown.stacked, before)


def test_only_valid_prefixes_move_so_an_unseen_draft_cache_costs_no_copy():
    """Slots past a row's length are ignored, so leaves and joins move only each row's valid prefix: a draft
    cache that has seen nothing of its rows (a server batch that decodes plainly) moves no bytes at all."""
    cache = KVCache(np.full((2, 3, 1, 4, 2), 7.0, np.float32))
    cache.commit([4, 0, 2])
    kept = cache.select([1, 2])  # row 1 (nothing valid) moves up: nothing copied; row 2 moves its 2 slots
    assert kept.past_len.tolist() == [0, 2] and (kept.stacked[:, 1, :, :2] == 7).all()
    cache.stacked[:, 0] = 0.0  # mark: a full-row copy of row 1 over row 0 would have left 7s there
    kept = KVCache(cache.stacked, cache.held)
    kept.commit([4, 0, 2])
    left = kept.select([1, 2])
    assert (left.stacked[:, 0] == 0).all()
    unseen = KVCache(np.full((2, 2, 1, 4, 2), 5.0, np.float32))  # fresh rows the draft never prefilled
    grown = left.extend(unseen)
    assert grown.past_len.tolist() == [0, 2, 0, 0] and not (grown.stacked[:, 2:] == 5).any()

