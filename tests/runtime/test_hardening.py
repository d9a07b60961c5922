"""Memory planning, concurrency and faults: the pipeline keeps working and loses nothing."""

from __future__ import annotations

import threading

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.cache import CapacityError
from specdeploy.runtime.pipeline import GenerationError

CONFIG = GenerationConfig(k=3, policy="fixed", drafter="model", max_new_tokens=16, ignore_eos=True)


def test_cache_memory_is_reported_and_limited(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    sizes = pipeline.cache_bytes(batch=4, capacity=40)
    # 2 layers x (K and V) x 4 rows x 2 kv heads x 40 slots x 8 dims x 4 bytes, for each model
    assert sizes == {"target": 2 * 2 * 4 * 2 * 40 * 8 * 4, "draft": 2 * 2 * 4 * 2 * 40 * 8 * 4, "total": 2 * 40960}
    limited = Pipeline.load(pair_dir, max_cache_bytes=sizes["total"] - 1)
    prompts = ["w5 w6 w7"] * 4  # 3 + 16 + 3 + 1 = 23 slots
    needed = pipeline.cache_bytes(4, 23)["total"]
    limited.max_cache_bytes = needed - 1
    with pytest.raises(CapacityError, match=r"4 rows x 23 slots need .* MiB \(target .* draft .*\), over the limit"):
        limited.generate(prompts, CONFIG)
    limited.max_cache_bytes = needed
    assert len(limited.generate(prompts, CONFIG)) == 4


def test_threads_sharing_a_pipeline_get_their_own_outputs(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    prompts = [f"w{5 + i} w{9 + i} w{20 + i}" for i in range(6)]
    alone = {p: pipeline.generate(p, CONFIG)[0].token_ids for p in prompts}
    got, errors = {}, []

    def worker(prompt):
        try:
            for _ in range(3):
                got.setdefault(prompt, []).append(pipeline.generate(prompt, CONFIG)[0].token_ids)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(outputs == [alone[p]] * 3 for p, outputs in got.items()) and len(got) == len(prompts)


class FailingEngine:
    """Wraps an engine and raises on the n-th call, or on any call that carries a poison token."""

    def __init__(self, engine, fail_at=None, poison=None):
        self.engine, self.fail_at, self.poison, self.calls = engine, fail_at, poison, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def infer(self, input_ids, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at or (self.poison is not None and (input_ids == self.poison).any()):
            raise RuntimeError("injected engine fault")
        return self.engine.infer(input_ids, *args, **kwargs)


PROMPTS = ["w5 w6 w7", "w10 w11 w12", "w20 w21", "w30 w31 w30"]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_fault_tied_to_one_row_fails_that_row_alone(pair_dir, role):
    pipeline = Pipeline.load(pair_dir)
    reference = [r.token_ids for r in pipeline.generate(PROMPTS, CONFIG)]
    # a token no other row ever feeds the engines: only the third row's calls carry it
    used = {t for ids in reference for t in ids} | {int(t) for p in PROMPTS for t in pipeline.encode(p)}
    poison = next(t for t in range(4, 120) if t not in used)
    original = getattr(pipeline, role)
    setattr(pipeline, role, FailingEngine(original, poison=poison))
    results = pipeline.generate(["w5 w6 w7", "w10 w11 w12", f"w20 w{poison}", "w30 w31 w30"], CONFIG)
    setattr(pipeline, role, original)
    assert results[2].finish_reason == "error" and "injected engine fault" in results[2].error
    for i in (0, 1, 3):  # the other rows of the batch finish exactly as they would have
        assert results[i].token_ids == reference[i] and results[i].finish_reason == "length"
    assert [r.token_ids for r in pipeline.generate(PROMPTS, CONFIG)] == reference


@pytest.mark.parametrize("fail_at", [3, 6])
def test_transient_fault_is_retried_without_changing_outputs(pair_dir, fail_at):
    pipeline = Pipeline.load(pair_dir)
    reference = [r.token_ids for r in pipeline.generate(PROMPTS, CONFIG)]
    pipeline.draft = FailingEngine(pipeline.draft, fail_at=fail_at)
    assert [r.token_ids for r in pipeline.generate(PROMPTS, CONFIG)] == reference


def test_sampled_rows_keep_their_randomness_through_a_retry(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    sampled = GenerationConfig(k=3, policy="fixed", drafter="model", max_new_tokens=16, ignore_eos=True, temperature=1.0,
                               seed=3)
    reference = [r.token_ids for r in pipeline.generate(PROMPTS, sampled)]
    pipeline.target = FailingEngine(pipeline.target, fail_at=4)
    assert [r.token_ids for r in pipeline.generate(PROMPTS, sampled)] == reference


def test_failed_single_request_and_stream(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    reference = pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids
    original = pipeline.target
    pipeline.target = FailingEngine(original, poison=7)
    (failed,) = pipeline.generate(["w5 w6 w7"], CONFIG)
    assert failed.finish_reason == "error" and failed.error == "RuntimeError: injected engine fault"
    with pytest.raises(GenerationError, match="injected engine fault"):
        list(pipeline.stream("w5 w6 w7", CONFIG))
    pipeline.target = original
    assert pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids == reference


def test_interrupted_stream_leaves_pipeline_usable(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    reference = pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids
    stream = pipeline.stream("w5 w6 w7", CONFIG)
    next(stream)
    stream.close()  # the consumer walks away mid-stream
    assert pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids == reference
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(pipeline.stream("w5 w6 w7", CONFIG)):
            if i == 1:
                raise KeyboardInterrupt
    assert pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids == reference


@pytest.mark.parametrize("policy", ["fixed", "cost"])
def test_stream_raises_when_the_prefill_fails(pair_dir, policy):
    # the cost policy plans the draft's catch-up after the prefill: with every row gone there is nothing to plan
    config = GenerationConfig(**{**CONFIG.__dict__, "policy": policy, "drafter": "hybrid" if policy == "cost" else "model"})
    pipeline = Pipeline.load(pair_dir)
    pipeline.target = FailingEngine(pipeline.target, poison=5)  # the prefill feeds "w5 w6", retried alone too
    with pytest.raises(GenerationError, match="injected engine fault"):
        list(pipeline.stream("w5 w6 w7", config))
    (failed,) = pipeline.generate(["w5 w6 w7"], config)
    assert failed.finish_reason == "error" and "injected engine fault" in failed.error
