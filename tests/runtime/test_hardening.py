"""Memory planning, concurrency and faults: the pipeline keeps working and loses nothing."""

from __future__ import annotations

import threading

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.cache import CapacityError

CONFIG = GenerationConfig(k=3, max_new_tokens=16, ignore_eos=True)


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
    """Wraps an engine and raises on the n-th call."""

    def __init__(self, engine, fail_at):
        self.engine, self.fail_at, self.calls = engine, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def infer(self, *args):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected engine fault")
        return self.engine.infer(*args)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_engine_fault_fails_the_request_and_pipeline_stays_usable(pair_dir, role):
    pipeline = Pipeline.load(pair_dir)
    reference = pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids
    original = getattr(pipeline, role)
    setattr(pipeline, role, FailingEngine(original, fail_at=4))
    with pytest.raises(RuntimeError, match="injected engine fault"):
        pipeline.generate(["w5 w6 w7"], CONFIG)
    assert pipeline.generate(["w5 w6 w7"], CONFIG)[0].token_ids == reference  # the next request is unaffected
    setattr(pipeline, role, original)
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
