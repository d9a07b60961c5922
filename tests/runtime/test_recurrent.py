"""Speculation over recurrent layers stays exact: a hybrid target (LFM2's short convolutions, Granite 4.0-H's Mamba-2
beside attention) drafted for by its own int4 copy decodes what it decodes plainly, whatever the drafter, k
and batch, with drafts accepted and rolled back (a rollback restores the recurrent state of the accepted length), a
reused prefix and exact mode; its committed cache equals a fresh prefill's, recurrent states included."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.config import ConfigError
from specdeploy.runtime.prefix_cache import RING_PARTIAL
from specdeploy.runtime.suffix import SuffixIndex
from tests import tiny
from tests.runtime.test_cache import RandomK

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 30, 31, 30]]  # ragged: 9, 3 and 5 tokens
NEW = 24
FAMILIES = ("lfm2", "granitemoehybrid")  # a positional state (conv inputs), rings (Mamba-2's conv inputs and scan)


@pytest.fixture(scope="module", params=[(name, form) for name in FAMILIES for form in ("explicit", "fused")],
                ids=lambda param: "-".join(param))
def pipeline(request, tmp_path_factory, exported_architecture):
    """A hybrid target (parity's model: its trace is shared, tests/traces.py) and its own int4 copy as its draft
    (rounding moves its logits: partial, ragged acceptance), exported once."""
    name, form = request.param
    checkpoint = exported_architecture.checkpoint(name)
    directory = tiny.export_cli(tmp_path_factory.mktemp(name) / "art", checkpoint, checkpoint, "--graph", form,
                                "--draft-weights", "int4")
    pipeline = Pipeline.load(directory, prefix_cache_bytes=0)
    assert pipeline.target.spec.states and pipeline.draft.spec.states
    return pipeline


@pytest.fixture(scope="module")
def plain(pipeline):
    """Each prompt decoded plainly, alone."""
    config = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True)
    return [pipeline.generate([p], config)[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def texts(plain):
    """The prompts with their answers, every fifth answer token changed: in a suffix index, drafts that run right for
    four tokens and then part from the text (a rejection and a rollback)."""
    return [prompt + [t if i % 5 != 4 else (t + 1) % tiny.VOCAB for i, t in enumerate(answer)]
            for prompt, answer in zip(PROMPTS, plain)]


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("drafter", ["model", "suffix", "prompt-lookup", "hybrid"])
def test_speculative_greedy_equals_plain(pipeline, plain, texts, drafter, k):
    """Batch 3, ragged prompts, drafts accepted and rejected (prompt lookup's follow the prompt's own text, which
    random weights rarely repeat: verified, seldom accepted)."""
    config = GenerationConfig(k=k, policy="fixed", drafter=drafter, max_new_tokens=NEW, ignore_eos=True)
    index = SuffixIndex()
    for i, text in enumerate(texts):
        index.add(("earlier", i), text)
    results = pipeline.generate(PROMPTS, config, suffix_index=index)
    assert [r.token_ids for r in results] == plain
    records = [r for result in results for r in result.records if r.drafted]
    assert records  # drafts were verified
    if drafter != "prompt-lookup":
        assert max(r.accepted for r in records) >= min(k, 2) and any(r.accepted < r.drafted for r in records)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_every_batch_size_is_lossless(pipeline, plain, batch_size):
    config = GenerationConfig(k=3, policy="fixed", drafter="hybrid", max_new_tokens=NEW, ignore_eos=True)
    assert [r.token_ids for r in pipeline.generate(PROMPTS, config, batch_size=batch_size)] == plain


def test_seeded_sampling_is_unchanged_by_drafting(pipeline):
    """A seeded request's text depends on neither the drafter nor its batch mates."""
    texts = []
    for drafter in ("none", "model", "suffix", "hybrid"):
        config = GenerationConfig(k=4, drafter=drafter, temperature=0.8, seed=11, max_new_tokens=NEW, ignore_eos=True)
        texts.append([r.token_ids for r in pipeline.generate(PROMPTS, config)])
    assert texts[0] == texts[1] == texts[2] == texts[3]
    greedy = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True)
    assert texts[0] != [r.token_ids for r in pipeline.generate(PROMPTS, greedy)]  # sampled, not greedy


def test_exact_mode_speculative_equals_exact_plain(pipeline):
    """Exact mode pads each call to an even number of tokens: the padding's state lands past the row's length, where
    the ring has room for it."""
    plain = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True, exact=True)
    drafted = GenerationConfig(k=5, policy="fixed", drafter="model", max_new_tokens=NEW, ignore_eos=True, exact=True)
    assert [r.token_ids for r in pipeline.generate(PROMPTS, drafted)] == [
        r.token_ids for r in pipeline.generate(PROMPTS, plain)]


def test_the_prefix_cache_resumes_a_kept_text(pipeline, plain):
    """A repeated prompt and a conversation's next turn start from the kept text's K/V and states and decode what a
    cold start decodes; a ring resumes a text only where it ended (``refused`` counts the others), a positional
    state anywhere."""
    warm = Pipeline(pipeline.manifest, pipeline.tokenizer, pipeline.target, pipeline.draft)
    config = GenerationConfig(k=4, policy="fixed", drafter="hybrid", max_new_tokens=NEW, ignore_eos=True)
    first = warm.generate([PROMPTS[0]], config)[0]
    assert first.token_ids == plain[0]
    turn = [*PROMPTS[0], *first.token_ids, 40, 41]
    cold = pipeline.generate([turn], config)[0]
    resumed = warm.generate([turn], config)[0]
    assert resumed.stats["cached_prompt_tokens"] == len(PROMPTS[0]) + NEW - 1 and resumed.token_ids == cold.token_ids
    shorter = PROMPTS[0][:6] + [50, 51]  # matches 6 tokens of a kept text that ran on
    partial = warm.generate([shorter], config)[0]
    assert partial.token_ids == pipeline.generate([shorter], config)[0].token_ids
    ring = pipeline.target.spec.keeps_ring
    assert partial.stats["cached_prompt_tokens"] == (0 if ring else 6)
    assert warm.prefix_cache.refused[RING_PARTIAL] == int(ring)


def test_a_turn_asked_again_resumes_where_the_turn_before_it_ended(pipeline, plain):
    """A conversation's turn asked twice (a regenerated answer): the first answer's text runs on past the turn's prompt,
    so a ring cannot resume from it; the turn before it is still kept (a text that a newer one extends stays where the
    newer one cannot resume at its end) and the second run resumes from it too, decoding what a cold start decodes (a
    positional state resumes from the longer text, all of the prompt but its last token). Found by
    tools/gpu_check.py's prefix part, which runs a second turn plainly, then speculatively."""
    warm = Pipeline(pipeline.manifest, pipeline.tokenizer, pipeline.target, pipeline.draft)
    config = GenerationConfig(k=4, policy="fixed", drafter="model", max_new_tokens=NEW, ignore_eos=True)
    first = warm.generate([PROMPTS[0]], config)[0]
    turn = [*PROMPTS[0], *first.token_ids, 40, 41]
    cold = pipeline.generate([turn], config)[0].token_ids
    runs = [warm.generate([turn], config)[0] for _ in range(2)]
    assert [r.token_ids for r in runs] == [cold, cold]
    ring = pipeline.target.spec.keeps_ring
    assert [r.stats["cached_prompt_tokens"] for r in runs] == [len(PROMPTS[0]) + NEW - 1,
                                                               len(PROMPTS[0]) + NEW - 1 if ring else len(turn) - 1]
    assert warm.prefix_cache.refused[RING_PARTIAL] == 0 and len(warm.prefix_cache) == (2 if ring else 1)


@pytest.mark.parametrize("seed", range(2))
def test_committed_cache_equals_a_fresh_prefill(pipeline, seed):
    """After random cycles (drafts of random length, rollbacks of any length), each row's K/V and recurrent states at
    the positions its length reads are those a fresh prefill of its committed tokens computes, in both models."""
    config = GenerationConfig(k=6, max_new_tokens=30, temperature=1.0, seed=seed, ignore_eos=True, drafter="model")
    run = pipeline.start(PROMPTS, config)
    run.policy = RandomK(6, seed)
    for _ in range(6):
        run.step()
    drafted = [r for result in run.results for r in result.records if r.drafted]
    assert any(r.accepted < r.drafted for r in drafted)  # rollbacks happened
    assert run.cache.past_len.tolist() == (run.lengths - 1).tolist()
    for cache, engine in ((run.cache, pipeline.target), (run.draft_cache, pipeline.draft)):
        for b in range(len(run.active)):
            n = int(cache.past_len[b])
            fresh = engine.allocate_cache(1, n + 1)
            engine.infer(run.tokens[b : b + 1, :n], np.zeros(1, np.int64), fresh)
            for buf, ref in zip(cache.buffers, fresh.buffers):
                np.testing.assert_allclose(buf[b, :, :n], ref[0, :, :n], atol=1e-4, rtol=1e-4)
            for state, group, ref in zip(engine.spec.states, cache.states, fresh.states):
                read = range(max(0, n - state.lookback), n)  # what the row's next call reads
                got = group[:, b, [p % group.shape[2] for p in read]]
                want = ref[:, 0, [p % ref.shape[2] for p in read]]
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=state.name)


def test_more_drafts_than_a_ring_holds_are_refused_in_one_line(pipeline):
    most = pipeline.target.spec.max_drafts
    if most is None:  # a positional state bounds no k
        assert pipeline.generate([PROMPTS[1]], GenerationConfig(k=30, policy="fixed", max_new_tokens=4))
        return
    with pytest.raises(ConfigError, match=rf"^k: got {most + 1}; the target model keeps its recurrent state .* in a ring "
                                          rf"of \d+ positions, so a cycle verifies at most {most} drafts; use k <= {most}$"):
        pipeline.generate([PROMPTS[1]], GenerationConfig(k=most + 1, max_new_tokens=4))
    assert pipeline.generate([PROMPTS[1]], GenerationConfig(k=most, policy="fixed", max_new_tokens=4))


def test_recurrent_states_move_with_their_rows():
    """Rows leaving and joining move each row's states with its K/V: the first min(length, slots) slots (a full ring's
    every slot), on the memory the rows that left freed; a row's view writes into the batch's buffers."""
    from specdeploy.engines.base import KVCache

    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 3, 1, 16, 2)).astype(np.float32)
    ring, positional = rng.standard_normal((1, 3, 5, 4)).astype(np.float32), rng.standard_normal((2, 3, 16, 3)).astype(np.float32)
    cache = KVCache(kv, states=[ring, positional])
    cache.commit([9, 2, 4])  # row 0 has wrapped its ring of 5; rows 1 and 2 have not
    rows = {b: (ring[:, b].copy(), positional[:, b].copy()) for b in range(3)}
    kept = cache.select([0, 2])
    assert np.shares_memory(kept.states[0], ring) and kept.past_len.tolist() == [9, 4]
    np.testing.assert_array_equal(kept.states[0][:, 0], rows[0][0])  # every slot of a full ring
    np.testing.assert_array_equal(kept.states[0][:, 1, :4], rows[2][0][:, :4])
    np.testing.assert_array_equal(kept.states[1][:, 1, :4], rows[2][1][:, :4])
    joining = KVCache(np.zeros((2, 1, 1, 16, 2), np.float32), states=[np.full((1, 1, 5, 4), 7.0, np.float32),
                                                                      np.full((2, 1, 16, 3), 8.0, np.float32)])
    joining.commit([3])
    joined = kept.extend(joining)
    assert np.shares_memory(joined.states[1], positional) and joined.past_len.tolist() == [9, 4, 3]
    assert (joined.states[0][:, 2, :3] == 7).all() and (joined.states[1][:, 2, :3] == 8).all()
    np.testing.assert_array_equal(joined.states[0][:, 0], rows[0][0])
    view = joined.rows(1, 2)
    view.state_buffers[0][0, 4] = -1.0  # ring 0, layer 0 of row 1, slot 4
    assert (joined.states[0][0, 1, 4] == -1).all() and len(joined.state_buffers) == 3
