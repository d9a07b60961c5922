"""tools/op_diff.py: one position's arithmetic compared op by op between two calls over the same tokens."""

from __future__ import annotations

import numpy as np

from specdeploy import GenerationConfig, Pipeline
from specdeploy.engines.base import prefill
from tools import op_diff


def test_the_probe_runs_the_engines_kernels_and_finds_each_outputs_position(fused_dirs, tmp_path):
    """Its logits are the engine's, bit for bit (the graph as ONNX Runtime optimizes it for the engine), and an output's
    slice at a position is that position's."""
    pipeline = Pipeline.load(fused_dirs["close"])
    engine, ids = pipeline.target, np.array([[5, 17, 33, 9, 40, 41, 12, 88, 7, 3]], np.int64)
    probe = op_diff.OpProbe(fused_dirs["close"], engine.spec, tmp_path)
    cache = engine.allocate_cache(2, 32)
    prefill(engine, cache, np.repeat(ids, 2, axis=0), [4, 4])
    one = cache.rows(0, 1)
    probe.learn_axes({(1, 1): probe.run(op_diff.Call(ids[:, 4:5], [4]), one),
                      (1, 2): probe.run(op_diff.Call(ids[:, 4:6], [4]), one),
                      (1, 3): probe.run(op_diff.Call(ids[:, 4:7], [4]), one),
                      (2, 1): probe.run(op_diff.Call(np.repeat(ids[:, 4:5], 2, axis=0), [4, 4]), cache)})
    call = op_diff.Call(ids[:, 4:9], [4], at=3)
    ran = probe.run(call, one)
    logits = engine.infer(ids[:, 4:9], np.array([4]), one).logits
    assert np.array_equal(ran["logits"], logits)
    assert np.array_equal(probe.position("logits", ran["logits"], call), logits[0, 3])
    present = engine.spec.cache_outputs[0]  # the fused graph's whole cache: the slot the position wrote
    assert np.array_equal(probe.position(present, ran[present], call), ran[present][0, :, 7])
    diffs = op_diff.compare_ops(probe, (call, ran), (call, ran))
    assert diffs and all(d.equal for d in diffs)


def test_the_report_finds_a_padded_step_and_a_verifications_rows_the_same_in_the_fused_form(fused_dirs, tmp_path):
    """What exact mode rests on, on the tiny fused target: a position's arithmetic in a call of 2 tokens is a call of
    5's (row 0) and a verification's row j is a two-token call's at that position, at every op."""
    pipeline = Pipeline.load(fused_dirs["close"])
    ids = [5, 17, 33, 9, 40, 41, 12]
    sequence = ids + pipeline.generate([ids], GenerationConfig(drafter="none", max_new_tokens=8, ignore_eos=True),
                                       suffix_index=None)[0].token_ids
    rows = op_diff.op_report(pipeline.target, fused_dirs["close"], sequence, len(ids) - 1, [5], tmp_path,
                             log=lambda line: None)
    found = {row["case"]: row for row in rows}
    assert set(found) == {"T=1 vs T=5, row 0", "T=2 vs T=5, row 0", "verify T=5 row 1 vs T=1 at p+1",
                          "verify T=5 row 1 vs T=2 at p+1", "verify T=5 row 1 vs T=5 at p+1",
                          "verify T=5 row 4 vs T=1 at p+4", "verify T=5 row 4 vs T=2 at p+4",
                          "verify T=5 row 4 vs T=5 at p+4"}
    for case in ("T=2 vs T=5, row 0", "verify T=5 row 1 vs T=2 at p+1", "verify T=5 row 4 vs T=2 at p+4"):
        assert found[case]["outputs_differing"] == 0 and found[case]["first_differing"] is None, case
        assert found[case]["logits_max_abs"] == 0.0 and found[case]["kv_written_max_abs"] == 0.0


def test_a_kernels_rows_are_told_apart_by_the_calls_that_computed_them():
    """The row table of one MatMulNBits node: every row of every call of 2..9 rows is compared with that row alone and
    as row 0 of a two-row call (which rows differ is the CPU's kernels' own: the same each time it is asked)."""
    found = op_diff.matmul_nbits_rows(64, 96, 32, 4)
    assert found["rows_compared"] == sum(range(2, 10))
    for key in ("differ_from_one_row_call", "differ_from_row_0_of_two"):
        assert all(2 <= m <= 9 and 0 <= j < m for m, j in found[key])
    assert op_diff.matmul_nbits_rows(64, 96, 32, 4) == found


def test_the_explicit_forms_folded_rows_and_slots_are_read_at_the_position_and_every_op_agrees(pair_dir, tmp_path):
    """The explicit form folds query heads into rows (row = g * tokens + t) and scores every cache slot: an output's
    slice at a position is that position's row of each head group, over the slots up to its own. With slot attention,
    a padded step, a verification's rows and a batch mate compute a position alike at every op (tiny fp32 target)."""
    pipeline = Pipeline.load(pair_dir)
    engine, ids = pipeline.target, np.array([[5, 17, 33, 9, 40, 41, 12, 88, 7, 3]], np.int64)
    probe = op_diff.OpProbe(pair_dir, engine.spec, tmp_path)
    cache, wider, both = engine.allocate_cache(1, 32), engine.allocate_cache(1, 33), engine.allocate_cache(2, 32)
    for made in (cache, wider, both):
        prefill(engine, made, np.repeat(ids, made.buffers[0].shape[0], axis=0), [4] * made.buffers[0].shape[0])
    probe.learn_axes({(1, 1): probe.run(op_diff.Call(ids[:, 4:5], [4]), cache),
                      (1, 2): probe.run(op_diff.Call(ids[:, 4:6], [4]), cache),
                      (1, 3): probe.run(op_diff.Call(ids[:, 4:7], [4]), cache),
                      (2, 1): probe.run(op_diff.Call(np.repeat(ids[:, 4:5], 2, axis=0), [4, 4]), both)},
                     probe.run(op_diff.Call(ids[:, 4:5], [4]), wider))
    group = engine.spec.num_heads // engine.spec.kv_heads
    call = op_diff.Call(ids[:, 4:9], [4], at=3)
    ran = probe.run(call, cache)
    scores = [name for name in probe.names if probe.token_axes[name][:1] == [(2, group)] and probe.slot_axes[name] == [3]
              and ran[name].dtype == np.float32]
    assert scores, "no float [batch, kv_heads, group * tokens, capacity] output found"
    for name in scores:
        assert np.array_equal(probe.position(name, ran[name], call), ran[name][0, :, 3::5, :8])  # slots 0 .. 4 + 3
    sequence = ids[0].tolist() + pipeline.generate([ids[0].tolist()], GenerationConfig(
        drafter="none", max_new_tokens=8, ignore_eos=True), suffix_index=None)[0].token_ids
    (tmp_path / "report").mkdir()
    rows = op_diff.op_report(engine, pair_dir, sequence, ids.shape[1] - 1, [2, 5], tmp_path / "report",
                             log=lambda line: None)
    assert any(row["case"].startswith("batch mate") for row in rows)
    for row in rows:
        assert row["outputs_differing"] == 0 and row["logits_max_abs"] == 0.0, row
