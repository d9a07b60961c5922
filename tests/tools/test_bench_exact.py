"""tools/bench_exact.py: plain decoding and the default speculation in both modes, interleaved, and what it counts."""

from __future__ import annotations

from specdeploy import Pipeline
from tools import bench_exact


def test_both_modes_run_per_prompt_in_turn_and_exact_speculation_is_exact_plain(fused_dirs):
    pipeline = Pipeline.load(fused_dirs["close"])
    configs = bench_exact.configurations(16)
    assert [configs[name].exact for name in configs] == [False, True, False, True]
    assert configs[bench_exact.PLAIN].drafter == configs[bench_exact.EXACT_PLAIN].drafter == "none"
    rows = bench_exact.measure(pipeline, ["w5 w6 w7 w8", "w30 w31 w30 w31 w30"], configs, log=lambda line: None,
                               groups=["humaneval", "spec_bench/qa"])
    assert [row["order"][0] for row in rows] == [bench_exact.PLAIN, bench_exact.EXACT_PLAIN]  # the order turns
    assert all(row[name]["exact"] is configs[name].exact for row in rows for name in configs)
    found = bench_exact.summary(rows)
    assert found["exact_default_identical_to_exact_plain"] == found["prompts"] == 2
    plain = found["tokens_per_s"][bench_exact.PLAIN]
    assert found["against_plain"][bench_exact.EXACT_DEFAULT] == found["tokens_per_s"][bench_exact.EXACT_DEFAULT] / plain
    rates = found["tokens_per_s"]
    assert found["exact_default_against_default"] == rates[bench_exact.EXACT_DEFAULT] / rates[bench_exact.DEFAULT]
    # each group's own summary, of its own prompts
    assert sorted(found["groups"]) == ["humaneval", "spec_bench/qa"]
    qa = rows[1]
    assert found["groups"]["spec_bench/qa"]["tokens_per_s"][bench_exact.PLAIN] == (
        qa[bench_exact.PLAIN]["tokens"] / qa[bench_exact.PLAIN]["seconds"])
    assert all(group["prompts"] == 1 and "groups" not in group for group in found["groups"].values())
