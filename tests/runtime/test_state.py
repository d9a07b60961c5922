"""The batch state: rows join and leave, a row alone writes through, snapshots undo, drafts are placed for the target."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy import GenerationConfig
from specdeploy.runtime.decoder import BatchState
from specdeploy.runtime.telemetry import FinishReason


def _state(prompts, config=None, capacity=16, eos=(2,)):
    state = BatchState(config or GenerationConfig(), capacity, set(eos))
    state.join([np.array(p, np.int64) for p in prompts], [f"r{i}" for i in range(len(prompts))])
    return state


def test_join_and_leave_keep_rows_in_order():
    state = _state([[5, 6, 7], [8, 9]])
    state.join([np.array([10, 11, 12, 13])], ["late"])  # a request joining a running batch
    assert state.active == [0, 1, 2] and state.lengths == [3, 2, 4]
    np.testing.assert_array_equal(state.tokens[2, :4], [10, 11, 12, 13])
    assert state.leave([1]) == [0, 2]
    assert state.active == [0, 2] and state.lengths == [3, 4] and [r.request_id for r in state.results] == ["r0", "r1", "late"]
    np.testing.assert_array_equal(state.tokens[:, :4], [[5, 6, 7, 0], [10, 11, 12, 13]])


def test_verify_inputs_place_drafts_after_each_rows_committed_tokens():
    state = _state([[5, 6, 7], [8, 9]])
    ids = state.verify_inputs(np.array([[20, 21], [30, 31]]))
    np.testing.assert_array_equal(ids, [[7, 20, 21], [9, 30, 31]])  # [x[L - 1], d_1, d_2] per row
    same = _state([[5, 6], [8, 9]])
    ids = same.verify_inputs(np.array([[20], [30]]))
    np.testing.assert_array_equal(ids, [[6, 20], [9, 30]])
    assert np.shares_memory(ids, same.tokens)  # rows at one position: a slice, no gather


def test_commit_keeps_accepted_drafts_then_the_emitted_token_and_stops_rows():
    state = _state([[5, 6, 7], [8, 9]], GenerationConfig(max_new_tokens=3))
    state.verify_inputs(np.array([[20, 21], [30, 31]]))
    committed, finished = state.commit([2, 0], [[20, 21, 22], [40, -1, -1]], left=[3, 3])
    assert committed == [(0, [20, 21, 22]), (1, [40])] and finished == [0]
    assert state.results[0].finish_reason == FinishReason.LENGTH == "length" and not state.results[1].finish_reason
    assert state.lengths == [6, 3]
    np.testing.assert_array_equal(state.tokens[0, :6], [5, 6, 7, 20, 21, 22])
    np.testing.assert_array_equal(state.tokens[1, :3], [8, 9, 40])
    state.commit([0, 1], [[2, -1], [41, 2]], left=[0, 2])  # row 1 reaches EOS (2): cut after it
    assert state.results[1].token_ids == [40, 41, 2] and state.results[1].finish_reason == "eos"


def test_a_row_alone_writes_through_to_the_batch():
    state = _state([[5, 6, 7], [8, 9]])
    single = state.row(1)
    single.verify_inputs(np.array([[30]]))
    single.commit([1], [[30, 31]], left=[10])
    state.lengths[1] = single.lengths[0]
    assert state.lengths == [3, 4] and state.results[1].token_ids == [30, 31]
    np.testing.assert_array_equal(state.tokens[1, :4], [8, 9, 30, 31])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_snapshot_restore_undoes_lengths_and_randomness(temperature):
    state = _state([[5, 6, 7], [8, 9]], GenerationConfig(temperature=temperature, seed=4))
    snapshot = state.snapshot()
    first = [rng.random() for rng in state.rngs()]
    state.lengths[0] += 5
    state.restore(snapshot)
    assert state.lengths == [3, 2]
    again = [rng.random() for rng in state.rngs()]
    assert (again == first) == (temperature > 0)  # greedy keeps no generator states: it draws nothing


def test_each_request_has_its_own_seeded_generator():
    a = _state([[5], [6]], GenerationConfig(temperature=1.0, seed=1))
    b = _state([[5], [6]], GenerationConfig(temperature=1.0, seed=1))
    draws = [[rng.random() for rng in s.rngs()] for s in (a, b)]
    assert draws[0] == draws[1] and draws[0][0] != draws[0][1]
