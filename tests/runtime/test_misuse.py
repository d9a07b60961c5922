"""Misuse of the low-level API (issue 52): a Generation stepped from two threads, join and merge given what a batch
cannot take, settings past a float's range. Each is refused with the package's own error, and the batch goes on to
the output it gives alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.config import ConfigError
from specdeploy.runtime.errors import ConcurrentUseError

CONFIG = GenerationConfig(k=3, policy="fixed", drafter="model", max_new_tokens=12, ignore_eos=True)
PROMPTS = ["w5 w6 w7", "w10 w11"]


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


@pytest.fixture(scope="module")
def alone(pipeline):
    return [pipeline.generate(p, CONFIG)[0].token_ids for p in PROMPTS]


def _finish(run):
    while not run.done:
        run.step()
    return [row.token_ids for row in run.results]


def test_a_second_thread_stepping_one_generation_is_refused_and_the_first_goes_on(pipeline, alone):
    """Two threads stepping one batch gave wrong tokens, silently in most trials."""
    run = pipeline.start(PROMPTS, CONFIG)
    run.step()
    inside, release = threading.Event(), threading.Event()
    infer_impl = pipeline.target.infer_impl

    def held(*args):  # the first thread's cycle stays inside its target call until the second has tried
        inside.set()
        release.wait(30)
        return infer_impl(*args)

    pipeline.target.infer_impl = held
    first = threading.Thread(target=run.step)
    try:
        first.start()
        assert inside.wait(30)
        del pipeline.target.infer_impl  # the second thread would not block; it must not get in at all
        for call in (run.step, lambda: run.cancel(0), lambda: run.join([pipeline.encode("w40")], ["late"])):
            with pytest.raises(ConcurrentUseError, match=r"called while another thread is in Generation.step"):
                call()
    finally:
        release.set()
        first.join(30)
    assert _finish(run) == alone


def test_join_refuses_what_a_batch_cannot_take_naming_the_argument(pipeline, alone):
    run = pipeline.start(PROMPTS, CONFIG)
    run.step()
    for prompts, ids, match in [
        ("w5 w6", ["a"], r"prompts: got str; expected a non-empty list of token-id arrays"),
        ([], [], r"prompts: got list; expected a non-empty list"),
        ([np.array([5, 500])], ["a"], r"prompts\[0\]: range \[5, 500\] outside the vocabulary \[0, 128\)"),
        ([np.array([], np.int64)], ["a"], r"prompts\[0\]: got no tokens"),
        ([[5.0, 6.0]], ["a"], r"prompts\[0\]: got 5.0 among them; expected integers"),
        ([np.array([5, 6])], ["a", "b"], r"request_ids: got list of 2; expected 1 strings"),
        ([np.array([5, 6])], "a", r"request_ids: got str; expected 1 strings"),
    ]:
        with pytest.raises(ConfigError, match=match):
            run.join(prompts, ids)
    with pytest.raises(ConfigError, match=r"settings: got list of 0; expected None or 1 RowSettings"):
        run.join([np.array([5, 6])], ["a"], [])
    assert len(run.active) == 2 and _finish(run) == alone  # the batch unchanged by every refusal


def test_merge_refuses_what_a_batch_cannot_take_naming_why(pipeline, alone):
    run = pipeline.start(PROMPTS, CONFIG)
    run.prefill()
    fresh = pipeline.start(["w20"], CONFIG, capacity=run.state.capacity)
    smaller = pipeline.start(["w20"], CONFIG, capacity=run.state.capacity - 1)
    smaller.prefill()
    plain = pipeline.start(["w20"], GenerationConfig(drafter="none", max_new_tokens=12), capacity=run.state.capacity)
    plain.prefill()
    for other, match in [("w20", r"other: got str; expected a Generation"),
                         (run, r"other: got this Generation itself"),
                         (fresh, r"other: not prefilled; expected a Generation whose prefill is done"),
                         (smaller, rf"merge: capacity {run.state.capacity - 1} != {run.state.capacity}: other has another"),
                         (plain, r"other: speculation k=0 without a draft model; expected this batch's k=3 with one")]:
        with pytest.raises(ConfigError, match=match):
            run.merge(other)
    other = Pipeline.load(pipeline.directory).start(["w20"], CONFIG, capacity=run.state.capacity)
    other.prefill()
    with pytest.raises(ConfigError, match=r"other: a Generation of another pipeline's target engine"):
        run.merge(other)
    fresh.prefill()
    run.merge(fresh)  # what it can take, it takes
    assert _finish(run)[:2] == alone


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "confidence_threshold"])
def test_numbers_past_a_floats_range_are_refused_naming_the_field(field):
    """10 ** 400 raised a bare OverflowError from float conversion."""
    with pytest.raises(ConfigError, match=rf"{field}: got 1{'0' * 56}\.\.\. \(int\); expected"):
        GenerationConfig(**{field: 10**400})
