"""A ragged verification: rows with fewer drafts than the widest pad the call, and a form that runs rows alone (the
fused graph at a batch of several rows) runs each row only as far as its own tokens, with the logits and K/V the
padded call computes there."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.contract import Manifest
from specdeploy.engines import EngineInputError, load_engine

PAST = 6


def _prefilled(engine, rng):
    cache = engine.allocate_cache(2, 24)
    engine.infer(rng.integers(0, 128, (2, PAST)), np.zeros(2, np.int64), cache)
    return cache


@pytest.mark.parametrize("form", ["explicit", "fused"])
def test_each_row_computes_its_own_tokens_as_the_padded_call_does(pair_dir, fused_dirs, form):
    directory = pair_dir if form == "explicit" else fused_dirs["close"]
    engine = load_engine(directory, Manifest.read(directory), "target")
    padded_cache, ragged_cache = _prefilled(engine, np.random.default_rng(3)), _prefilled(engine, np.random.default_rng(3))
    ids = np.random.default_rng(4).integers(0, 128, (2, 5))
    past = np.full(2, PAST, np.int64)
    padded = engine.infer(ids, past, padded_cache).logits.copy()
    calls, run = [], engine.infer_impl

    def recorded(input_ids, *args):
        calls.append(input_ids.shape)
        return run(input_ids, *args)

    engine.infer_impl = recorded
    ragged = engine.infer(ids, past, ragged_cache, widths=[5, 2]).logits
    np.testing.assert_allclose(ragged[0], padded[0], atol=1e-5)
    np.testing.assert_allclose(ragged[1, :2], padded[1, :2], atol=1e-5)
    for b, width in enumerate((5, 2)):  # the K/V of the tokens that matter, as the padded call wrote them
        for mine, theirs in zip(ragged_cache.rows(b, b + 1).buffers, padded_cache.rows(b, b + 1).buffers):
            np.testing.assert_allclose(mine[..., PAST : PAST + width, :], theirs[..., PAST : PAST + width, :], atol=1e-5)
    if form == "fused":  # rows alone: row 1 ran its 2 tokens, its padding reads zeros
        assert calls == [(1, 5), (1, 2)]
        assert not ragged[1, 2:].any()
    else:  # one call of all rows: the padding is computed with them
        assert calls == [(2, 5)]
        np.testing.assert_allclose(ragged[1, 2:], padded[1, 2:], atol=1e-5)


@pytest.mark.parametrize("widths", [[0, 5], [6, 1], [5], [5, 1, 1], [5, 1.0]])
def test_widths_that_do_not_fit_the_call_are_refused_naming_them(fused_dirs, widths):
    engine = load_engine(fused_dirs["close"], Manifest.read(fused_dirs["close"]), "target")
    cache = _prefilled(engine, np.random.default_rng(3))
    with pytest.raises(EngineInputError, match=r"target: widths \| received .*; expected 2 integers in \[1, 5\]"):
        engine.infer(np.ones((2, 5), np.int64), np.full(2, PAST, np.int64), cache, widths=widths)


@pytest.mark.parametrize("widths, shown", [(5, "int 5"), (True, "bool True"), ({5: 1, 2: 1}, "dict"),
                                           ([True, 5], r"\[True, 5\]"), ([5, np.True_], r"\[5, np.True_\]"),
                                           ("52", "str '52'"), (np.array([[5, 2]]), r"int64 \(1, 2\)")])
def test_widths_of_another_kind_are_refused_naming_them(fused_dirs, widths, shown):
    """An int, a bool, a dict (whose keys list() would take as widths) or bools inside a list: the input error of
    any other argument, naming widths and what it got, never a TypeError or a bool taken as width 1."""
    engine = load_engine(fused_dirs["close"], Manifest.read(fused_dirs["close"]), "target")
    cache = _prefilled(engine, np.random.default_rng(3))
    with pytest.raises(EngineInputError, match=rf"target: widths \| received {shown}.*; expected 2 integers in \[1, 5\]"):
        engine.infer(np.ones((2, 5), np.int64), np.full(2, PAST, np.int64), cache, widths=widths)
