"""tools/bench_prefix_cache.py on the tiny pair: a prompt's second run reuses all but its new token, and the copies
are timed where the runtime makes them (and the runtime is left as it was)."""

from __future__ import annotations

from specdeploy.runtime import batching
from tools import bench_prefix_cache


def test_the_second_run_reuses_the_first_and_every_figure_is_measured(pair_dir):
    keep, reuse = batching.RowCaches.keep, batching.RowCaches._reuse
    rows = bench_prefix_cache.measure(pair_dir, [6, 20], rounds=2, threads=1)
    assert [row["tokens"] for row in rows] == [6, 20]
    assert [row["reused_tokens"] for row in rows] == [6, 20]  # the prompt, one token more: all of the first reused
    assert all(row["keep_s"] > 0 and row["reuse_s"] > 0 and row["cold_s"] > 0 and row["bytes_per_token"] > 0
               for row in rows)
    assert batching.RowCaches.keep is keep and batching.RowCaches._reuse is reuse
