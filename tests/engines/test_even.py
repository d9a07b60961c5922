"""``EvenTokens``: every call padded to an even number of tokens a row, and only the given tokens' results returned."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import Pipeline
from specdeploy.engines import EngineInputError
from specdeploy.engines.base import prefill
from specdeploy.engines.even import EvenTokens

IDS = np.array([[5, 17, 33, 9, 40, 41, 12, 88, 7, 3, 60, 61]], np.int64)


@pytest.fixture(scope="module", params=["explicit", "fused"])
def engines(request, pair_dir, fused_dirs):
    target = Pipeline.load(pair_dir if request.param == "explicit" else fused_dirs["close"]).target
    return target, EvenTokens(target)


def prefilled(engine, rows: int = 1, past: int = 6):
    cache = engine.allocate_cache(rows, 32)
    prefill(engine, cache, np.repeat(IDS, rows, axis=0), [past] * rows)
    return cache


def test_an_odd_call_runs_padded_and_returns_its_own_tokens(engines):
    plain, even = engines
    for tokens in (1, 3):
        ids = IDS[:, 6 : 6 + tokens]
        out = even.infer(ids, np.array([6]), prefilled(plain))
        # the same call with the dummy (the last token again) made by hand, through the plain engine
        padded = plain.infer(np.concatenate([ids, ids[:, -1:]], axis=1), np.array([6]), prefilled(plain))
        assert out.logits.shape == (1, tokens, plain.spec.vocab_size)
        assert np.array_equal(out.logits, padded.logits[:, :tokens])
        assert np.array_equal(out.ids, padded.logits[:, :tokens].argmax(-1))
        last = even.infer(ids, np.array([6]), prefilled(plain), last=1)
        assert np.array_equal(last.logits[:, -1], out.logits[:, -1])


def test_an_even_call_is_the_plain_engines_call(engines):
    plain, even = engines
    ids = IDS[:, 6:8]
    assert np.array_equal(even.infer(ids, np.array([6]), prefilled(plain)).logits,
                          plain.infer(ids, np.array([6]), prefilled(plain)).logits)


def test_the_dummy_writes_past_the_call_and_the_cache_below_it_is_the_padded_calls(engines):
    plain, even = engines
    cache, by_hand = prefilled(plain), prefilled(plain)
    even.infer(IDS[:, 6:7], np.array([6]), cache)
    plain.infer(IDS[:, 6:8].copy(), np.array([6]), by_hand)  # the real token and, as dummy, the next one
    assert np.array_equal(cache.stacked[:, :, :, :7], by_hand.stacked[:, :, :, :7])


def test_ragged_widths_are_rounded_up_and_checked_as_given(engines):
    plain, even = engines
    ids = np.repeat(IDS[:, 6:9], 2, axis=0)
    out = even.infer(ids, np.array([6, 6]), prefilled(plain, 2), widths=[1, 3])
    alone = even.infer(ids[1:], np.array([6]), prefilled(plain))
    assert np.array_equal(out.logits[1], alone.logits[0])
    with pytest.raises(EngineInputError, match=r"widths \| received \[1, 4\]; expected 2 integers in \[1, 3\]"):
        even.infer(ids, np.array([6, 6]), prefilled(plain, 2), widths=[1, 4])


def test_bad_inputs_are_refused_in_the_engines_words(engines):
    plain, even = engines
    with pytest.raises(EngineInputError, match="input tensor input_ids"):
        even.infer(IDS[0], np.array([6]), prefilled(plain))
    with pytest.raises(EngineInputError, match="exceeds cache capacity 32"):  # the dummy needs its slot too
        even.infer(IDS[:, :1], np.array([31]), prefilled(plain))
