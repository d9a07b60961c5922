"""Every registered architecture, exported through the CLI, against transformers' own forward.

Prefill (tokens = 7), decode (tokens = 1) and verification (tokens = 5) after a non-empty past,
batch 3 with a different past_len per row and finite garbage in every unused cache slot.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from specdeploy.exporter import ARCHITECTURES
from tests import tiny
from tests.exporter.cases import PARITY_CASES, REFUSED

PAST = np.array([4, 9, 6])


def test_every_registered_architecture_has_a_parity_case():
    covered = {name.split("-")[0] for name in PARITY_CASES}
    missing = sorted(set(ARCHITECTURES) - covered)
    assert not missing, f"registered without a parity test: {missing}"


FORMS = ("explicit", "fused")


@pytest.fixture(scope="module", params=[(name, form) for name in sorted(PARITY_CASES) for form in FORMS
                                        if (name, form) not in REFUSED],
                ids=lambda param: "-".join(param))
def exported(request, exported_architecture):
    name, form = request.param
    model, directory = exported_architecture(name, form)
    manifest = Manifest.read(directory)
    assert manifest.target.graph == form
    return f"{name} ({form})", model, load_engine(directory, manifest, "target")


def _reference(model, sequence: np.ndarray):
    """transformers' logits [T, V], per attention layer (K, V), each [kv_heads, T, head_dim], and per recurrent layer
    its states after the last token (LFM2: the last conv_L_cache convolution inputs [hidden, kernel]; Mamba-2: the
    last mamba_d_conv inputs [conv_dim, kernel], then the scan's state [heads, head_dim, d_state]), for one row. The
    cache keeps every token's K/V, windowed layers' too (a config's own cache keeps only a window's)."""
    from transformers import DynamicCache

    recurrent = {"conv", "linear_attention"} & set(getattr(model.config, "layer_types", None) or ())
    cache = DynamicCache(config=model.config) if recurrent else DynamicCache()  # a hybrid's layers need their kinds
    with torch.no_grad():
        out = model(torch.tensor(sequence)[None], past_key_values=cache, use_cache=True)
    kv, states = [], []
    for layer in out.past_key_values.layers:
        if hasattr(layer, "keys"):
            kv.append((layer.keys[0].numpy(), layer.values[0].numpy()))
        else:
            states.append([layer.conv_states[0][0].numpy()] + (
                [layer.recurrent_states[0][0].numpy()] if layer.recurrent_states.get(0) is not None else []))
    return out.logits[0].numpy(), (kv, states)


def _garbage_cache(engine, batch, capacity, rng):
    """A KVCache filled with garbage (a list of garbage tensors before ``infer`` took a KVCache alone: the same values,
    drawn in the same order), recurrent states' buffers too."""
    cache = engine.allocate_cache(batch, capacity)
    cache.stacked[...] = rng.uniform(-50, 50, cache.shape).astype(cache.stacked.dtype)
    for group in cache.states:
        group[...] = rng.uniform(-50, 50, group.shape).astype(group.dtype)
    return cache


def _tolerance(reference):
    return 1e-4 * max(1.0, float(np.abs(reference).max()))


def _copy(cache):
    """Copies of a cache's K/V tensors and recurrent states' arrays, to compare with after a call."""
    return [buf.copy() for buf in cache], [group.copy() for group in cache.states]


def _check_cache(name, spec, cache, before, reference, row, start, tokens):
    """The call's K/V sit in the row's slots start .. start + tokens (both forms: the explicit form's are staged
    there by the engine, the fused graph writes them itself), and every other slot is as it was; a recurrent layer's
    states of the call's last positions sit at their slots (position p at p mod slots) and are transformers' own."""
    before, before_states = before
    kv, states = reference
    _check_states(name, spec, cache, before_states, states, row, start, tokens)
    for i, (k, v) in enumerate(kv):
        for buf, old, reference in ((cache[2 * i], before[2 * i], k), (cache[2 * i + 1], before[2 * i + 1], v)):
            np.testing.assert_allclose(buf[row][:, start : start + tokens], reference[:, start : start + tokens],
                                       atol=1e-4, rtol=1e-4, err_msg=name)
            assert np.array_equal(buf[row][:, : start], old[row][:, : start]), f"{name}: layer {i} slots before {start}"
            assert np.array_equal(buf[row][:, start + tokens :], old[row][:, start + tokens :]), (
                f"{name}: layer {i} slots after {start + tokens}")


def _check_states(name, spec, cache, before, reference, row, start, tokens):
    """Each recurrent state's slots: the call's last min(tokens, slots) positions written (the last ones compared with
    transformers' states after the text: its conv inputs' last positions, its scan's final state), every other slot
    as it was. ``reference``: per recurrent layer, its states in the manifest's kinds' order."""
    end = start + tokens
    for kind, (state, group, old) in enumerate(zip(spec.states, cache.states, before)):
        slots = group.shape[2]
        written = {p % slots for p in range(end - min(tokens, slots), end)}
        assert len(reference) == len(state.layers), f"{name}: transformers' cache has {len(reference)} recurrent layers"
        for j, layer_states in enumerate(reference):
            got, theirs = group[j, row], layer_states[kind]
            if theirs.ndim == 2:  # conv inputs [channels, kernel]: the last min(kernel, end) positions
                last = min(theirs.shape[1], end, min(tokens, slots))
                for back in range(1, last + 1):
                    np.testing.assert_allclose(got[(end - back) % slots], theirs[:, -back], atol=1e-4, rtol=1e-4,
                                               err_msg=f"{name}: {state.name} layer {j} position {end - back}")
            else:  # the scan's state after the last token
                np.testing.assert_allclose(got[(end - 1) % slots], theirs, atol=1e-4, rtol=1e-4,
                                           err_msg=f"{name}: {state.name} layer {j} position {end - 1}")
            kept = [s for s in range(slots) if s not in written]
            assert np.array_equal(got[kept], old[j, row][kept]), f"{name}: {state.name} layer {j} slots not written"


def test_prefill_matches_transformers(exported):
    name, model, engine = exported
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tiny.VOCAB, (3, 7))
    cache = _garbage_cache(engine, 3, 20, rng)
    before = _copy(cache)
    out = engine.infer(ids, np.zeros(3, np.int64), cache)
    for b in range(3):
        logits, kv = _reference(model, ids[b])
        assert np.abs(out.logits[b] - logits).max() <= _tolerance(logits), name
        _check_cache(name, engine.spec, cache, before, kv, b, 0, 7)


@pytest.mark.parametrize("tokens", [1, 5])
def test_decode_and_verify_after_ragged_past(exported, tokens):
    name, model, engine = exported
    rng = np.random.default_rng(tokens)
    capacity = 24
    sequences = [rng.integers(0, tiny.VOCAB, PAST[b] + tokens) for b in range(3)]
    cache = _garbage_cache(engine, 3, capacity, rng)
    # the past comes from the engine's own prefill of each row, written into the garbage-filled buffers
    for b in range(3):
        engine.infer(sequences[b][None, : PAST[b]], np.zeros(1, np.int64), cache.rows(b, b + 1))  # was a list of row views
    before = _copy(cache)
    new_ids = np.stack([s[PAST[b] :] for b, s in enumerate(sequences)])
    out = engine.infer(new_ids, PAST.astype(np.int64), cache)
    assert np.isfinite(out.logits).all()
    for b in range(3):
        logits, kv = _reference(model, sequences[b])
        reference = logits[PAST[b] :]
        gap = np.abs(out.logits[b] - reference).max()
        assert gap <= _tolerance(reference), f"{name}: tokens={tokens} row {b}: max |logits gap| {gap}"
        _check_cache(name, engine.spec, cache, before, kv, b, PAST[b], tokens)
