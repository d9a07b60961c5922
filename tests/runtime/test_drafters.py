"""Drafters: prompt lookup against a straightforward reference; the draft model against one token a call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy import GenerationConfig
from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from specdeploy.runtime.decoder import BatchState
from specdeploy.runtime.drafters import ModelDrafter, PromptLookup, lookup
from specdeploy.runtime.registry import make_drafter


def _state(tokens, lengths, config=None):
    """A batch state over ``tokens`` [batch, width] with ``lengths`` committed tokens per row."""
    state = BatchState(config or GenerationConfig(), tokens.shape[1], eos=set())
    state.join([row[:length] for row, length in zip(tokens, lengths)], [f"r{b}" for b in range(len(lengths))])
    state.tokens = tokens  # the test's own buffer, whatever lies past each row's length
    return state


def _propose(drafter, state, cache, k, free_k, caps):
    """``drafter``'s proposal of up to ``k`` model drafts and ``free_k`` free ones a row, every free draft it finds
    kept (as a policy that prices none away: the decoder asks the policy between ``find`` and ``propose``)."""
    return drafter.propose(state, cache, k, drafter.find(state, free_k, caps), caps)


def _hybrid(engine):
    """The default drafter (a suffix index and the draft model ``engine``, if any), as the registry makes it."""
    return make_drafter("hybrid", engine)


def _generators(state, generators):
    """Each request of ``state`` draws from ``generators`` (in place: its record keeps its own generator object)."""
    for rng, generator in zip(state.rngs(), generators):
        rng.bit_generator.state = generator.bit_generator.state


class OneTokenACall:
    """The greedy draft model written out plainly: catch up, then one engine call per draft."""

    def __init__(self, engine, capacity):
        self.engine, self.cache = engine, engine.allocate_cache(1, capacity)

    def propose(self, tokens, at, k, threshold):
        seen = int(self.cache.past_len[0])
        logits = self.engine.infer(tokens[:, seen:at], self.cache.past_len, self.cache).logits[0, -1]
        drafts = []
        while len(drafts) < k:
            top = np.exp(logits - logits.max())
            if threshold is not None and (top / top.sum()).max() < threshold:
                break
            drafts.append(int(logits.argmax()))
            if len(drafts) < k:
                ids = np.array([[drafts[-1]]])
                logits = self.engine.infer(ids, np.array([at + len(drafts) - 1]), self.cache).logits[0, -1]
        steps = 1 + min(len(drafts), k - 1)
        self.cache.commit([at + steps - 1])
        tokens[0, at : at + len(drafts)] = drafts
        return np.array([drafts], np.int64).reshape(1, -1), steps, at - seen

    def rollback(self, lengths):
        self.cache.commit([min(int(self.cache.past_len[0]), lengths[0])])


def _reference(seq, k, max_ngram=3):
    """Latest earlier occurrence of the longest final n-gram (n <= max_ngram) that has a continuation."""
    seq = list(seq)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j : j + n] == seq[-n:] and seq[j + n : j + n + k]:
                return seq[j + n : j + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 6))
def test_lookup_matches_reference(seq, k):
    assert list(lookup(np.array(seq), k, 3)) == _reference(seq, k)


def test_propose_pads_rows_without_a_match_and_writes_drafts():
    tokens = np.zeros((2, 16), np.int64)
    tokens[0, :6] = [1, 2, 3, 9, 1, 2]  # "1 2" seen before, followed by "3 9"
    tokens[1, :3] = [4, 5, 6]  # no repeat: no match
    state = _state(tokens, [6, 3])
    proposal = _propose(PromptLookup(), state, None, 0, 3, [3, 3])
    np.testing.assert_array_equal(proposal.drafts, [[3, 9, 1], [6, 6, 6]])
    assert proposal.drafted == [3, 0] and proposal.free == [True, False]
    state.verify_inputs(proposal.drafts)  # the state places them for the target
    np.testing.assert_array_equal(tokens[0, 6:9], [3, 9, 1])
    assert proposal.q is None and proposal.later_calls == 0


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_greedy_drafts_equal_one_token_a_call(pair_dir, threshold):
    """The draft model's drafts, calls and cache equal the plain one-token-a-call loop's."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    rng = np.random.default_rng(0)
    config = GenerationConfig(k=5)
    drafter, cache = ModelDrafter(engine, stop_below=threshold), engine.allocate_cache(1, 64)
    reference = OneTokenACall(engine, 64)
    token_buffers = [np.zeros((1, 64), np.int64) for _ in range(2)]
    length, made_total, stopped_early = 7, 0, False
    for cycle in range(6):
        fresh = rng.integers(0, 128, length - int(cache.past_len[0]))  # tokens it has not seen
        for tokens in token_buffers:
            tokens[0, length - len(fresh) : length] = fresh
        state = _state(token_buffers[0], [length], config)
        fast = _propose(drafter, state, cache, 5, 0, [5])
        state.verify_inputs(fast.drafts)
        drafts, steps, catchup = reference.propose(token_buffers[1], length, 5, threshold)
        np.testing.assert_array_equal(fast.drafts, drafts)  # before the buffers change
        assert (1 + fast.later_calls, fast.first_call_tokens) == (steps, catchup)
        np.testing.assert_array_equal(token_buffers[0], token_buffers[1])
        past = int(cache.past_len[0])
        assert past == int(reference.cache.past_len[0])
        np.testing.assert_array_equal(cache.stacked[..., :past, :], reference.cache.stacked[..., :past, :])
        made_total += fast.drafts.shape[1]
        stopped_early |= fast.drafts.shape[1] < 5
        accepted = cycle % 3  # then the target keeps some drafts and adds one token
        drafter.rollback(cache, [length + accepted])
        reference.rollback([length + accepted])
        length += accepted + 1
    assert made_total > 0 and stopped_early == (threshold is not None)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_proposals_leave_the_batch_state_as_it_was(pair_dir, temperature):
    """A drafter reads the state and writes only its own cache and draft buffer."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    config = GenerationConfig(k=4, temperature=temperature, seed=0)
    tokens = np.zeros((2, 32), np.int64)
    tokens[0, :5], tokens[1, :3] = [5, 6, 7, 8, 9], [10, 11, 12]
    state = _state(tokens, [5, 3], config)
    _generators(state, [np.random.default_rng(i) for i in range(2)])
    before = tokens.copy()
    drafter, cache = ModelDrafter(engine), engine.allocate_cache(2, 32)
    proposal = _propose(drafter, state, cache, 4, 0, [4, 4])
    assert proposal.drafts.shape == (2, 4) and (proposal.q is None) == (temperature == 0)
    np.testing.assert_array_equal(state.tokens, before)
    assert state.lengths == [5, 3]
    assert cache.past_len.tolist() == [5 + 3, 3 + 3]  # caught up, then fed all drafts but the last


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hybrid_rows_take_the_index_or_the_model_each_on_their_own(pair_dir, temperature):
    """A row that repeats itself gets the index's continuation, draws nothing from its generator and
    leaves the draft model's cache at its committed tokens; the other row gets the model's drafts, as
    the model alone would have drafted them with that row's generator."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    config = GenerationConfig(k=4, temperature=temperature, seed=0)
    tokens = np.zeros((2, 32), np.int64)
    tokens[0, :7] = [1, 2, 3, 9, 4, 1, 2]  # "1 2" seen before, followed by "3 9 4 ..."
    tokens[1, :3] = [10, 11, 12]  # no repeat
    results = {}
    for kind in (_hybrid, ModelDrafter):
        state = _state(tokens.copy(), [7, 3], config)
        _generators(state, [np.random.default_rng(i) for i in range(2)])
        drafter, cache = kind(engine), engine.allocate_cache(2, 32)
        proposal = _propose(drafter, state, cache, 4, 3, [4, 4])  # index drafts: at most 3
        results[kind] = proposal, cache.past_len.tolist(), [g.random() for g in state.rngs()]
    (hybrid, hybrid_past, hybrid_next), (model, model_past, model_next) = results[_hybrid], results[ModelDrafter]
    np.testing.assert_array_equal(hybrid.drafts[0, :3], [3, 9, 4])  # the index's 3, as the policy allowed
    np.testing.assert_array_equal(hybrid.drafts[1], model.drafts[1])
    assert hybrid.later_calls == model.later_calls == 3 and hybrid.free == [True, False]
    assert hybrid_past == [7, model_past[1]]  # the index row's model drafts were never its tokens
    assert hybrid_next[1] == model_next[1]  # the model row drew as the model alone draws
    if temperature:
        assert hybrid_next[0] == np.random.default_rng(0).random()  # the index row drew nothing
        np.testing.assert_array_equal(hybrid.q[0].argmax(-1)[:3], [3, 9, 4])
        np.testing.assert_array_equal(hybrid.q[0].max(-1), 1.0)
        np.testing.assert_allclose(hybrid.q[1], model.q[1])
        assert hybrid.drafted == [3, 4]  # the filler after the index's 3 is not the row's
    else:
        assert hybrid.q is None


def test_hybrid_without_a_model_row_calls_no_model(pair_dir):
    """Every row repeating itself: an index proposal, no draft call, the draft left behind for later."""
    engine = load_engine(pair_dir, Manifest.read(pair_dir), "draft")
    tokens = np.zeros((1, 32), np.int64)
    tokens[0, :6] = [1, 2, 3, 9, 1, 2]
    state = _state(tokens, [6])
    drafter, cache = _hybrid(engine), engine.allocate_cache(1, 32)
    proposal = _propose(drafter, state, cache, 3, 3, [3])
    np.testing.assert_array_equal(proposal.drafts, [[3, 9, 1]])
    assert proposal.first_call_seconds == 0 and proposal.free == [True] and cache.past_len.tolist() == [0]
    assert drafter.behind(state, cache) == 4


def test_hybrid_without_a_draft_model_drafts_by_the_index_alone():
    """On a target-only artifact the hybrid drafter is the suffix index alone: it asks for no draft cache."""
    tokens = np.zeros((2, 32), np.int64)
    tokens[0, :6], tokens[1, :3] = [1, 2, 3, 9, 1, 2], [4, 5, 6]
    drafter = _hybrid(None)
    assert not drafter.uses_model and drafter.finds_free
    proposal = _propose(drafter, _state(tokens, [6, 3]), None, 4, 3, [3, 3])
    np.testing.assert_array_equal(proposal.drafts, [[3, 9, 1], [6, 6, 6]])
    assert proposal.drafted == [3, 0] and proposal.later_calls == 0


def test_the_model_drafter_without_a_draft_model_is_refused_before_anything_is_built():
    from specdeploy.runtime.errors import ConfigError
    from specdeploy.runtime.registry import check_drafter, make_drafter

    with pytest.raises(ConfigError, match="'model' needs a draft model"):
        make_drafter("model", None)
    with pytest.raises(ConfigError, match="'model' needs a draft model"):
        check_drafter("model", has_draft_model=False)
    check_drafter("hybrid", has_draft_model=False)  # the suffix index alone
