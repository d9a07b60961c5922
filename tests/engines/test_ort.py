"""The ONNX Runtime engine: input checks that name the tensor, providers, graph/manifest agreement."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specdeploy.contract import Manifest
from specdeploy.engines import EngineInputError, OrtEngine, ProviderError, load_engine


@pytest.fixture(scope="module")
def engine(pair_dir):
    return load_engine(pair_dir, Manifest.read(pair_dir), "target")


def test_caches_are_preallocated_zero_filled_in_model_dtype(engine):
    cache = engine.allocate_cache(2, 10)
    assert len(cache) == 4 and all(b.shape == (2, 2, 10, 8) and b.dtype == np.float32 and not b.any() for b in cache)
    assert cache.shape == (4, 2, 2, 10, 8)  # one array: staging every layer is one copy


def test_outputs_are_stacked_and_reused_per_shape_only(engine):
    """Small calls write into buffers bound once per (batch, tokens); other shapes never clobber them."""
    cache = engine.allocate_cache(1, 16)
    ids = np.array([[5, 6, 7]])
    first = engine.infer(ids, np.array([0]), cache)
    kept = first.logits.copy(), first.new_kv.copy()
    assert first.new_kv.shape == (4, 1, 2, 3, 8)
    other = engine.infer(ids[:, :1], np.array([3]), cache)  # another shape: its own buffers
    assert not np.shares_memory(other.logits, first.logits)
    np.testing.assert_array_equal(first.logits, kept[0])
    again = engine.infer(ids, np.array([0]), cache)  # the same shape: same buffers, same results
    assert again.logits is first.logits and again.new_kv is first.new_kv
    np.testing.assert_array_equal(again.logits, kept[0])
    np.testing.assert_array_equal(again.new_kv, kept[1])


@pytest.mark.parametrize("mutate,match", [
    (lambda ids, past, cache: (ids.astype(np.int32), past, cache), r"input_ids \| received int32 \(2, 3\); expected int64"),
    (lambda ids, past, cache: (ids[0], past, cache), r"input_ids \| received int64 \(3,\)"),
    (lambda ids, past, cache: (ids, past[:1], cache), r"past_len \| received int64 \(1,\); expected int64 \(2,\)"),
    (lambda ids, past, cache: (ids, past, cache[:3]), "received 3 cache tensors; expected 4"),
    (lambda ids, past, cache: (ids, past, [cache[0], cache[1], cache[2].astype(np.float16), cache[3]]),
     r"cache_key.1 \| received float16 \(2, 2, 10, 8\); expected float32 \(2, 2, 10, 8\)"),
    (lambda ids, past, cache: (ids, past, [cache[0][:, :1], *cache[1:]]), r"cache_key.0 \| received float32 \(2, 1, 10, 8\)"),
    (lambda ids, past, cache: (ids, np.array([8, 2]), cache), r"past_len \[8, 2\] \+ 3 new tokens exceeds cache capacity 10"),
    (lambda ids, past, cache: (ids + 200, past, cache), r"outside the vocabulary \[0, 128\)"),
])
def test_bad_inputs_name_the_tensor(engine, mutate, match):
    ids, past, cache = np.ones((2, 3), np.int64), np.array([0, 2]), engine.allocate_cache(2, 10)
    with pytest.raises(EngineInputError, match=match):
        engine.infer(*mutate(ids, past, cache))
    assert engine.infer(ids, past, cache).logits.shape == (2, 3, 128)  # still usable


def test_checks_hold_after_a_cache_has_passed(engine):
    """Cache tensors that passed are not re-checked while the same ones come back; anything else is."""
    buffers = list(engine.allocate_cache(2, 80))
    engine.infer(np.ones((2, 1), np.int64), np.array([0, 0]), buffers)
    expected = r"cache_key.0 \| received float32 \(2, 2, 80, 8\); expected float32 \(1, 2, 80, 8\)"
    with pytest.raises(EngineInputError, match=expected):
        engine.infer(np.ones((1, 1), np.int64), np.array([0]), buffers)  # the same tensors, another batch
    swapped = [*buffers[:3], buffers[3].astype(np.float16)]
    with pytest.raises(EngineInputError, match=r"cache_value.1 \| received float16"):
        engine.infer(np.ones((2, 1), np.int64), np.array([0, 0]), swapped)
    long_ids = np.ones((2, 40), np.int64)  # 80 ids: the NumPy range check
    long_ids[1, 7] = 128
    with pytest.raises(EngineInputError, match=r"input_ids range \[1, 128\] outside the vocabulary"):
        engine.infer(long_ids, np.array([0, 0]), buffers)
    with pytest.raises(EngineInputError, match=r"input_ids range \[-1, 1\]"):
        engine.infer(np.array([[1, -1]]), np.array([0]), [b[:1] for b in buffers])


def test_unavailable_provider_fails_loudly(pair_dir):
    manifest = Manifest.read(pair_dir)
    with pytest.raises(ProviderError, match="'cuda' .* not available"):
        OrtEngine(pair_dir / "target.onnx", manifest.target, provider="cuda")
    with pytest.raises(ProviderError, match="pip uninstall -y onnxruntime && pip install onnxruntime-gpu"):
        OrtEngine(pair_dir / "target.onnx", manifest.target, provider="cuda")
    with pytest.raises(ProviderError, match="unknown"):
        OrtEngine(pair_dir / "target.onnx", manifest.target, provider="tpu")


def test_graph_disagreeing_with_manifest_is_refused(pair_dir):
    manifest = Manifest.read(pair_dir)
    wrong = dataclasses.replace(manifest.target, num_layers=3)
    with pytest.raises(ProviderError, match="disagree with the manifest"):
        OrtEngine(pair_dir / "target.onnx", wrong)


def test_a_finished_requests_caches_are_not_kept_alive(engine):
    """Bindings are kept per call shape; once another cache is bound, none may still hold the old one."""
    import gc
    import weakref

    old = engine.allocate_cache(2, 16)
    old_buffers = list(old)
    for tokens in (1, 3):  # two shapes, two bindings holding the old cache
        engine.infer(np.ones((2, tokens), np.int64), np.array([0, 0]), old_buffers)
    gone = weakref.ref(old)
    del old, old_buffers
    new = list(engine.allocate_cache(1, 16))
    engine.infer(np.ones((1, 1), np.int64), np.array([0]), new)
    gc.collect()
    assert gone() is None


def test_infer_writes_the_new_kv_into_the_cache_at_each_rows_past_len(engine):
    """The runtime never stages K/V: ``infer`` leaves the new tokens' K/V in the cache, ragged rows included."""
    cache = engine.allocate_cache(2, 12)
    cache.stacked[...] = -7.0  # slots the call must not touch keep this
    out = engine.infer(np.array([[5, 6, 7], [8, 9, 10]]), np.array([1, 4]), cache)
    for b, start in enumerate((1, 4)):
        np.testing.assert_array_equal(cache.stacked[:, b, :, start : start + 3], out.new_kv[:, b])
        assert (cache.stacked[:, b, :, :start] == -7).all() and (cache.stacked[:, b, :, start + 3 :] == -7).all()
    assert out.seconds > 0 and out.stage_seconds > 0
    assert cache.past_len.tolist() == [0, 0]  # the valid length is the caller's to move


def test_cache_rows_and_selections(engine):
    cache = engine.allocate_cache(3, 8)
    cache.commit([2, 5, 7])
    single = cache.rows(1, 2)
    engine.infer(np.array([[5]]), single.past_len, single)  # a row alone writes into the batch's buffers
    assert cache.stacked[:, 1, :, 5].any() and not cache.stacked[:, [0, 2]].any()
    kept = cache.select([2, 1])
    assert kept.past_len.tolist() == [7, 5] and kept.shape == (4, 2, 2, 8, 8)
    np.testing.assert_array_equal(kept.stacked[:, 1, :, :5], cache.stacked[:, 1, :, :5])  # its valid slots
    assert not kept.stacked[:, 1, :, 5].any()  # written past its length, so ignored: not moved
    assert not np.shares_memory(kept.stacked, cache.stacked)  # leaving rows frees the old buffers


def test_pipelines_with_different_threads_share_one_process(pair_dir):
    """ONNX Runtime's shared thread pool is set once per process; later loads, with another size or
    none, still work (in a fresh interpreter: the pool is process-wide)."""
    import subprocess
    import sys

    script = f"""
import warnings
from specdeploy import GenerationConfig, Pipeline
config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
outputs = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for threads in (2, 1, None):
        outputs.append(Pipeline.load({str(pair_dir)!r}, threads=threads).generate("w5 w6", config)[0].token_ids)
assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 4, outputs
assert any("already has 2 threads" in str(w.message) for w in caught), [str(w.message) for w in caught]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_without_threads_each_model_stops_its_pool_spinning_and_the_process_keeps_no_pool(pair_dir):
    """Left spinning after a call, the idle model's threads slowed the busy one's (tools/bench_thread_pool.py):
    without ``threads`` each session's pool stops spinning when a call ends, and no process-wide pool is made
    (with one, ONNX Runtime refuses any later session a pool of its own: the user's own sessions too). Asked
    for, the shared pool is every later session's."""
    import subprocess
    import sys

    script = f"""
import onnxruntime
from specdeploy import GenerationConfig, Pipeline
from specdeploy.engines import ort
config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
own = Pipeline.load({str(pair_dir)!r})
options = [e.session.get_session_options() for e in (own.target, own.draft)]
assert [o.use_per_session_threads for o in options] == [True, True]
assert [o.get_session_config_entry("session.force_spinning_stop") for o in options] == ["1", "1"]
assert ort._global_pool is None
onnxruntime.InferenceSession({str(pair_dir / "target.onnx")!r})  # another library's session, on its own pool
shared = Pipeline.load({str(pair_dir)!r}, threads=2)
assert [e.session.get_session_options().use_per_session_threads for e in (shared.target, shared.draft)] == [False] * 2
assert own.generate("w5 w6", config)[0].token_ids == shared.generate("w5 w6", config)[0].token_ids
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


class _CopyOnBind:
    """An IOBinding that behaves as ONNX Runtime's does on a device EP: a host input is copied when it is
    bound, so writes made to the host array afterwards never reach the graph."""

    def __init__(self, binding):
        self.binding, self.copies = binding, {}

    def bind_cpu_input(self, name, array):
        self.copies[name] = copy = np.array(array)  # the "device" copy, kept alive as ONNX Runtime keeps its own
        self.binding.bind_cpu_input(name, copy)

    def __getattr__(self, name):
        return getattr(self.binding, name)


class _DeviceLikeSession:
    def __init__(self, session):
        self.session = session

    def io_binding(self):
        return _CopyOnBind(self.session.io_binding())

    def run_with_iobinding(self, binding, *args):
        return self.session.run_with_iobinding(binding.binding, *args)

    def __getattr__(self, name):
        return getattr(self.session, name)


def _device_like(engine, binds_by_copy=True):
    engine.session, engine.binds_by_copy = _DeviceLikeSession(engine.session), binds_by_copy
    return engine


def _decode_logits(engine, ids):
    """Each step's logits when ``ids`` are fed one token a call through one cache."""
    cache, out = engine.allocate_cache(1, len(ids)), []
    for i, token in enumerate(ids):
        out.append(engine.infer(np.array([[token]]), np.array([i]), cache).logits[0, -1].copy())
        cache.commit([i + 1])
    return np.array(out)


def test_an_engine_that_copies_at_bind_time_still_sees_every_cache_update(pair_dir):
    """The stale-cache bug of device EPs, on the CPU: caches bound once and updated in place afterwards
    are invisible to a binding that copied them; such an engine must rebind them on every call."""
    manifest, ids = Manifest.read(pair_dir), [3, 17, 42, 8, 99, 5]
    reference = _decode_logits(load_engine(pair_dir, manifest, "target"), ids)
    stale = _decode_logits(_device_like(load_engine(pair_dir, manifest, "target"), binds_by_copy=False), ids)
    assert np.abs(stale[1:] - reference[1:]).max() > 1e-2  # the simulation reproduces the bug
    rebound = _decode_logits(_device_like(load_engine(pair_dir, manifest, "target")), ids)
    np.testing.assert_allclose(rebound, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_decoding_on_engines_that_copy_at_bind_time_equals_the_cpus(pair_dir, k):
    """Plain and speculative greedy output through copy-on-bind engines (target and draft) equals the
    CPU engines' token for token."""
    from specdeploy import GenerationConfig, Pipeline

    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, k=k, policy="fixed")
    prompts = ["w5 w6", "w9 w1 w3", "w2"]
    expected = [r.token_ids for r in Pipeline.load(pair_dir).generate(prompts, config)]
    pipeline = Pipeline.load(pair_dir)
    _device_like(pipeline.target), _device_like(pipeline.draft)
    assert [r.token_ids for r in pipeline.generate(prompts, config)] == expected
