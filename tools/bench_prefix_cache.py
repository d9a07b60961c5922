"""What the prefix cache costs and saves, per prompt length: a prompt prefilled from nothing, then again with the
K/V of the first run's text reused (``runtime/prefix_cache.py``).

Per length, a random prompt is generated (8 new tokens) on a pipeline whose prefix cache is empty, then the same
prompt with one token more (a conversation's next turn, shortened): reported are both runs' prefill seconds, how
long keeping the finished text took (copying its slots out of the batch's caches) and reusing it (copying them into
the new row's), the tokens reused, and the bytes kept a token (both models' K/V). Median over ``--rounds``.

    python -m tools.bench_prefix_cache --artifact DIR [--lengths 128,512,1024] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from tools import arguments


def main(argv: list[str] | None = None) -> int:
    parser = arguments.parser(__doc__)
    parser.add_argument("--artifact", type=arguments.artifact, required=True, help="an artifact dir")
    parser.add_argument("--lengths", default="128,512,1024", help="comma list of prompt lengths in tokens")
    parser.add_argument("--rounds", type=arguments.integer(1), default=3, help="rounds per length (median reported)")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="ONNX Runtime threads")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.rounds < 1 or not lengths or min(lengths) < 2:
        parser.error("--rounds must be at least 1 and every length at least 2")
    print("| prompt tokens | prefill, cold | prefill, reused | tokens reused | keep | reuse | bytes kept a token |")
    print("|---|---|---|---|---|---|---|")
    for row in measure(args.artifact, lengths, args.rounds, args.threads):
        print(f"| {row['tokens']} | {row['cold_s'] * 1e3:.0f} ms | {row['reused_s'] * 1e3:.1f} ms | {row['reused_tokens']} | "
              f"{row['keep_s'] * 1e3:.1f} ms | {row['reuse_s'] * 1e3:.1f} ms | {row['bytes_per_token']:,.0f} |")
    return 0


def measure(artifact: Path, lengths: list[int], rounds: int, threads: int = 2) -> list[dict]:
    """One row per length: the medians of ``rounds`` pairs of runs (see the module's docstring)."""
    from specdeploy import Pipeline
    from specdeploy.runtime import batching

    pipeline = Pipeline.load(artifact, threads=threads)
    spent: dict[str, list[float]] = {"keep": [], "_reuse": []}
    originals = {name: getattr(batching.RowCaches, name) for name in spent}
    for name in spent:  # the two copies, timed where the runtime makes them (put back at the end)
        setattr(batching.RowCaches, name, _timed(originals[name], spent[name]))
    try:
        return _rows(pipeline, lengths, rounds, spent)
    finally:
        for name, method in originals.items():
            setattr(batching.RowCaches, name, method)


def _rows(pipeline, lengths: list[int], rounds: int, spent: dict[str, list[float]]) -> list[dict]:
    from specdeploy import GenerationConfig
    from specdeploy.runtime.prefix_cache import PrefixCache

    config = GenerationConfig(max_new_tokens=8, ignore_eos=True, drafter="none")
    rng, vocab = np.random.default_rng(0), pipeline.target.spec.vocab_size
    pipeline.generate([rng.integers(0, vocab, 16).tolist()], config)  # the engines' first calls
    rows = []
    for length in lengths:
        runs = []
        for _ in range(rounds):
            pipeline.prefix_cache = PrefixCache()
            prompt = rng.integers(0, vocab, length).tolist()
            cold = pipeline.generate([prompt], config)[0]
            kept = pipeline.prefix_cache.bytes / (length + len(cold.token_ids) - 1)
            reused = pipeline.generate([prompt + [int(rng.integers(0, vocab))]], config)[0]
            runs.append({"cold_s": cold.stats["prefill_s"], "reused_s": reused.stats["prefill_s"],
                         "reused_tokens": reused.stats["cached_prompt_tokens"], "keep_s": spent["keep"][-2],
                         "reuse_s": spent["_reuse"][-1], "bytes_per_token": kept})
        rows.append({"tokens": length, **{key: statistics.median(run[key] for run in runs) for key in runs[0]}})
    return rows


def _timed(method, seconds: list[float]):
    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - began)

    return timed


if __name__ == "__main__":
    raise SystemExit(main())
