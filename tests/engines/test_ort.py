"""The ONNX Runtime engine: input checks that name the tensor, providers, graph/manifest agreement, buffers bound once
where the session computes, argmax ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specdeploy.contract import Manifest
from specdeploy.engines import EngineClosedError, EngineInputError, KVCache, OrtEngine, ProviderError, load_engine


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


def _with_tensor(cache, index: int, tensor) -> KVCache:
    """A handle over ``cache``'s array whose tensor ``index`` is ``tensor``: the engine binds a handle's tensors one by
    one, so each is checked (these cases passed a list of tensors before ``infer`` took a KVCache alone)."""
    handle = KVCache(cache.stacked)
    handle.buffers[index] = tensor
    return handle


@pytest.mark.parametrize("mutate,match", [
    (lambda ids, past, cache: (ids.astype(np.int32), past, cache), r"input_ids \| received int32 \(2, 3\); expected int64"),
    (lambda ids, past, cache: (ids[0], past, cache), r"input_ids \| received int64 \(3,\)"),
    (lambda ids, past, cache: (ids, past[:1], cache), r"past_len \| received int64 \(1,\); expected int64 \(2,\)"),
    (lambda ids, past, cache: (ids, past, KVCache(cache.stacked[:3])), "received 3 cache tensors; expected 4"),
    (lambda ids, past, cache: (ids, past, _with_tensor(cache, 2, cache[2].astype(np.float16))),
     r"cache_key.1 \| received float16 \(2, 2, 10, 8\); expected float32 \(2, 2, 10, 8\)"),
    (lambda ids, past, cache: (ids, past, _with_tensor(cache, 0, cache[0][:, :1])),
     r"cache_key.0 \| received float32 \(2, 1, 10, 8\)"),
    (lambda ids, past, cache: (ids, past, list(cache)), r"cache \| received list; expected a KVCache"),
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
    buffers = engine.allocate_cache(2, 80)  # a KVCache where this test passed a list of its tensors before
    engine.infer(np.ones((2, 1), np.int64), np.array([0, 0]), buffers)
    expected = r"cache_key.0 \| received float32 \(2, 2, 80, 8\); expected float32 \(1, 2, 80, 8\)"
    with pytest.raises(EngineInputError, match=expected):
        engine.infer(np.ones((1, 1), np.int64), np.array([0]), buffers)  # the same tensors, another batch
    swapped = _with_tensor(buffers, 3, buffers[3].astype(np.float16))
    with pytest.raises(EngineInputError, match=r"cache_value.1 \| received float16"):
        engine.infer(np.ones((2, 1), np.int64), np.array([0, 0]), swapped)
    long_ids = np.ones((2, 40), np.int64)  # 80 ids: the NumPy range check
    long_ids[1, 7] = 128
    with pytest.raises(EngineInputError, match=r"input_ids range \[1, 128\] outside the vocabulary"):
        engine.infer(long_ids, np.array([0, 0]), buffers)
    with pytest.raises(EngineInputError, match=r"input_ids range \[-1, 1\]"):
        engine.infer(np.array([[1, -1]]), np.array([0]), buffers.rows(0, 1))


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

    old = engine.allocate_cache(2, 16)  # KVCaches passed themselves where this test passed lists of their tensors
    for tokens in (1, 3):  # two shapes, two bindings holding the old cache
        engine.infer(np.ones((2, tokens), np.int64), np.array([0, 0]), old)
    gone = weakref.ref(old)
    del old
    new = engine.allocate_cache(1, 16)
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


def _decode_logits(engine, ids, cache=None):
    """Each step's logits when ``ids`` are fed one token a call through one cache."""
    cache, out = cache if cache is not None else engine.allocate_cache(1, len(ids)), []
    for i, token in enumerate(ids):
        out.append(engine.infer(np.array([[token]]), np.array([i]), cache).logits[0, -1].copy())
        cache.commit([i + 1])
    return np.array(out)


@pytest.mark.parametrize("form", ["explicit", "fused"])
def test_a_requests_calls_bind_every_buffer_once_by_address_and_copy_nothing_at_bind_time(pair_dir, fused_dirs, form):
    """A device EP copies a host array when it is bound (``bind_cpu_input``): later in-place updates would never reach
    the graph. The engine binds every cache tensor, input and output by address where the session computes, once per
    (shape, cache): a request's draft steps and verifications rebind nothing, each row run alone keeps its own binding,
    and the results are the unrecorded engine's."""
    from tests.engines.recording import record

    directory = pair_dir if form == "explicit" else fused_dirs["close"]
    manifest = Manifest.read(directory)
    reference = load_engine(directory, manifest, "target")
    engine = load_engine(directory, manifest, "target")
    session = record(engine)
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    caches = [engine.allocate_cache(2, 16), reference.allocate_cache(2, 16)]
    for e, cache in zip((engine, reference), caches):
        e.infer(ids[:, :4], np.zeros(2, np.int64), cache)
    outputs = []
    for step in range(3):  # a cycle's shapes: one-token steps, then a ragged verification of 3 tokens
        past = np.array([4 + 4 * step, 3 + 4 * step])
        for e, cache in zip((engine, reference), caches):
            one = e.infer(ids[:, 4:5], past, cache).logits.copy()
            three = e.infer(ids[:, 5:8], past + 1, cache).logits.copy()
            outputs.append((one, three))
    for (ours, theirs) in zip(outputs[::2], outputs[1::2]):
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_array_equal(ours[1], theirs[1])
    assert all(not b.copied for b in session.bindings)
    per_binding = {}
    for run in session.runs:
        per_binding.setdefault(id(run.binding), set()).add(run.binds)
    assert all(len(counts) == 1 for counts in per_binding.values())  # bound once, never again between its runs
    cache = caches[0]
    rows = 2 if form == "fused" else 1  # a fused graph runs several tokens row by row: each row its own binding
    assert len(session.bindings) == rows + 1 + rows  # the prefill's, the one-token steps', the verification's
    for run in session.runs:
        keys = {name: bound for name, bound in run.bound.items() if name.startswith("cache_key.")}
        batch = run.bound["input_ids"][2][0]
        assert len(keys) == manifest.target.num_layers
        assert all(device == "cpu" for device, _, _ in run.bound.values())
        if batch == 2:
            assert keys["cache_key.0"][1] == cache.buffers[0].ctypes.data
        else:
            assert keys["cache_key.0"][1] in (cache.rows(0, 1).buffers[0].ctypes.data,
                                              cache.rows(1, 2).buffers[0].ctypes.data)
        if form == "fused":  # the cache is its own present_*: the graph writes the new K/V in place
            assert run.bound["present_key.0"][1] == keys["cache_key.0"][1]


@pytest.mark.parametrize("form", ["explicit", "fused"])
def test_rows_leaving_and_joining_keep_their_valid_prefixes_for_the_engine(pair_dir, fused_dirs, form):
    """After rows leave (``select``, in place) and join (``extend``, into the memory they left), the engine's next
    call computes for each row what the row computes alone."""
    directory = pair_dir if form == "explicit" else fused_dirs["close"]
    engine = load_engine(directory, Manifest.read(directory), "target")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n) for n in (5, 9, 3, 7)]

    def alone(prompt, token):
        cache = engine.allocate_cache(1, 16)
        engine.infer(prompt[None], np.zeros(1, np.int64), cache)
        return engine.infer(np.array([[token]]), np.array([len(prompt)]), cache).logits[0, -1].copy()

    cache = engine.allocate_cache(3, 16)
    for b in range(3):
        row = cache.rows(b, b + 1)
        engine.infer(prompts[b][None], np.zeros(1, np.int64), row)
    cache.commit([len(p) for p in prompts[:3]])
    kept = cache.select([0, 2])  # row 1 leaves; row 2 moves up over it
    assert kept.stacked.ctypes.data == cache.stacked.ctypes.data
    joining = engine.allocate_cache(1, 16)
    engine.infer(prompts[3][None], np.zeros(1, np.int64), joining)
    joining.commit([len(prompts[3])])
    joined = kept.extend(joining)  # into the row that left
    assert joined.stacked.ctypes.data == cache.stacked.ctypes.data and joined.past_len.tolist() == [5, 3, 7]
    tokens = np.array([[11], [12], [13]])
    got = engine.infer(tokens, joined.past_len, joined).logits[:, -1]
    for b, prompt in enumerate((prompts[0], prompts[2], prompts[3])):
        np.testing.assert_allclose(got[b], alone(prompt, tokens[b, 0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["explicit", "fused"])
def test_greedy_acceptance_reads_argmax_ids(pair_dir, fused_dirs, form):
    """``EngineOutput.ids`` is each kept position's argmax token: the fused graph's own ``ids`` output, else the argmax
    of the logits."""
    from tests.engines.recording import record

    directory = pair_dir if form == "explicit" else fused_dirs["close"]
    manifest = Manifest.read(directory)
    engine = load_engine(directory, manifest, "target")
    session = record(engine)
    assert manifest.target.argmax_ids == (form == "fused")
    ids = np.random.default_rng(2).integers(0, 128, (2, 6))
    out = engine.infer(ids, np.array([0, 0]), engine.allocate_cache(2, 8))
    assert out.ids.shape == (2, 6) and out.ids.dtype == np.int64
    np.testing.assert_array_equal(out.ids, out.logits.argmax(-1))
    assert ("ids" in session.runs[-1].bound) == (form == "fused")


class _DeviceArray:
    """Stands in for a CuPy array: a host array behind ``get`` (the copy to the host), counting the copies."""

    def __init__(self, array, copies: list):
        self.array, self.copies, self.nbytes = array, copies, array.nbytes

    def get(self):
        self.copies.append(self.array.shape)
        return self.array.copy()

    def argmax(self, axis):
        return _DeviceArray(self.array.argmax(axis), self.copies)


def test_device_outputs_reach_the_host_only_when_read_and_ids_alone_when_only_ids_are():
    from specdeploy.engines import EngineOutput
    from specdeploy.engines.memory import transfers

    logits = np.random.default_rng(3).standard_normal((2, 5, 40)).astype(np.float32)
    copies, before = [], transfers.to_host
    out = EngineOutput(_DeviceArray(logits, copies), None, 0.0, ids=_DeviceArray(logits.argmax(-1), copies))
    assert copies == []
    np.testing.assert_array_equal(out.ids, logits.argmax(-1))
    assert copies == [(2, 5)] and transfers.to_host - before == 80  # ten integers, not the logits
    np.testing.assert_array_equal(out.logits, logits)
    assert out.logits is out.logits and copies == [(2, 5), (2, 5, 40)]  # copied once
    assert transfers.to_host - before == 80 + logits.nbytes
    graphless = EngineOutput(_DeviceArray(logits, copies := []), None, 0.0)
    np.testing.assert_array_equal(graphless.ids, logits.argmax(-1))
    assert copies == [(2, 5)]  # the argmax taken where the logits are


def test_a_fused_fp32_artifact_is_refused_on_cuda_before_any_session(fused_dirs, monkeypatch):
    import onnxruntime

    def no_session(*args, **kwargs):
        raise AssertionError("a session was created")

    monkeypatch.setattr(onnxruntime, "InferenceSession", no_session)
    directory = fused_dirs["close"]
    manifest = Manifest.read(directory)
    assert manifest.target.dtype == "float32" and manifest.target.graph == "fused"
    for role in ("target", "draft"):
        with pytest.raises(ProviderError) as caught:
            load_engine(directory, manifest, role, provider="cuda")
        message = str(caught.value)
        assert str(directory) in message and f"the {role} model" in message
        assert "got float32, expected float16" in message and "--dtype float16 --graph fused" in message


def test_a_closed_engine_lets_its_session_go_and_refuses_calls(pair_dir):
    import gc
    import weakref

    with load_engine(pair_dir, Manifest.read(pair_dir), "target") as engine:
        cache = engine.allocate_cache(1, 8)
        engine.infer(np.array([[5, 6]]), np.array([0]), cache)
        session = weakref.ref(engine.session)
    gc.collect()
    assert session() is None  # nothing still holds it: not the engine, nor a thread's bound buffers
    with pytest.raises(EngineClosedError, match="target: the engine is closed"):
        engine.infer(np.array([[5]]), np.array([2]), cache)
    engine.close()  # closing twice is harmless


def test_a_fused_hybrid_is_given_the_slots_of_the_states_it_reads_and_writes():
    """``state_slots``: the lookback positions before each row's first new token (-1 before position 0, a zero state)
    and the call's last min(tokens, slots) positions, at p mod slots in a ring and at p where positional."""
    from specdeploy.contract import StateSpec
    from specdeploy.engines.base import state_slots

    ring, positional = StateSpec("ssm", (0,), (2,), 3, slots=7), StateSpec("conv", (0,), (4,), 2)
    past = np.array([0, 5, 12], np.int64)
    read, write = state_slots(ring, past, 2)
    assert read.tolist() == [[-1, -1, -1], [2, 3, 4], [2, 3, 4]] and write.tolist() == [[0, 1], [5, 6], [5, 6]]
    read, write = state_slots(ring, np.array([4], np.int64), 9)  # a chunk longer than the ring: its last 7 positions
    assert read.tolist() == [[1, 2, 3]] and write.tolist() == [[6, 0, 1, 2, 3, 4, 5]]
    read, write = state_slots(positional, np.array([1, 30], np.int64), 3)
    assert read.tolist() == [[-1, 0], [28, 29]] and write.tolist() == [[1, 2, 3], [30, 31, 32]]
