"""Paired A/B of one target call between two artifacts of the same model (two exports, two exporter versions).

Each round times one call of each artifact's target at each token count (same tokens, same past, caches of the
same capacity filled with the same random K/V), A and B in turning order, so that machine drift on a shared box hits
both alike; reports each side's median and the median of the per-round ratios B / A with its interquartile range.

    python -m tools.bench_step_ab --a DIR --b DIR [--tokens 1,2,5] [--past 128] [--rounds 40] [--capacity N]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from tools.arguments import artifact, integer, integers, parser


def step_seconds(engine, ids: np.ndarray, past: int, cache) -> float:
    """Seconds of one call of ``ids`` [1, tokens] after ``past`` slots (nothing is committed: the same slots are
    written again by the next round's call)."""
    start = time.perf_counter()
    engine.infer(ids, np.array([past], np.int64), cache)
    return time.perf_counter() - start


def paired(engines: dict, token_counts: list[int], past: int, capacity: int, rounds: int, log=print) -> dict:
    """{tokens: {"a_ms", "b_ms" (medians), "ratio" (median of B / A per round), "ratio_q1", "ratio_q3"}}."""
    rng = np.random.default_rng(0)
    caches = {}
    for side, engine in engines.items():
        caches[side] = engine.allocate_cache(1, capacity)
        for buffer in caches[side].buffers:  # the same random K/V on both sides
            buffer[...] = np.random.default_rng(1).standard_normal(buffer.shape).astype(buffer.dtype)
    vocab = engines["a"].spec.vocab_size
    out = {}
    for tokens in token_counts:
        ids = rng.integers(0, vocab, (1, tokens), dtype=np.int64)
        times = {"a": [], "b": []}
        for side in ("a", "b"):  # warm-up: the first call of a shape allocates
            step_seconds(engines[side], ids, past, caches[side])
        for r in range(rounds):
            for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                times[side].append(step_seconds(engines[side], ids, past, caches[side]))
        ratios = sorted(b / a for a, b in zip(times["a"], times["b"]))
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out[tokens] = {"a_ms": 1e3 * statistics.median(times["a"]), "b_ms": 1e3 * statistics.median(times["b"]),
                       "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3}
        row = out[tokens]
        log(f"T={tokens}: A {row['a_ms']:.2f} ms, B {row['b_ms']:.2f} ms (medians of {rounds}); B / A per round "
            f"{row['ratio']:.3f} (IQR {q1:.3f}-{q3:.3f})")
    return out


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--a", type=artifact, required=True, help="the first artifact (the baseline)")
    options.add_argument("--b", type=artifact, required=True, help="the second artifact (the change)")
    options.add_argument("--tokens", type=integers(1, "tokens"), default="1,2,5", help="token counts of the calls timed")
    options.add_argument("--past", type=integer(0), default=128, help="cache slots before the call's tokens")
    options.add_argument("--capacity", type=integer(2), default=None,
                         help="cache slots allocated (default: the artifacts' exported capacity)")
    options.add_argument("--rounds", type=integer(3), default=40, help="paired rounds per token count")
    options.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = options.parse_args()
    from specdeploy import Pipeline

    engines = {"a": Pipeline.load(args.a).target, "b": Pipeline.load(args.b).target}
    capacity = args.capacity or min(engine.spec.capacity for engine in engines.values())
    if args.past + max(args.tokens) > capacity:
        options.error(f"--past {args.past} + {max(args.tokens)} tokens exceeds the capacity {capacity}")
    result = paired(engines, args.tokens, args.past, capacity, args.rounds)
    if args.out is not None:
        from tools.provenance import provenance

        args.out.write_text(json.dumps({**provenance("tools.bench_step_ab"), "a": str(args.a), "b": str(args.b),
                                        "past": args.past, "capacity": capacity, "rounds": args.rounds,
                                        "tokens": result}, indent=2))


if __name__ == "__main__":
    main()
