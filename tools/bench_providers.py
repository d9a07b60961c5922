"""What one call costs at T = 1 .. 9 tokens, per execution provider and graph form, in one process.

Each side is an artifact on a provider (``--side LABEL=DIR@PROVIDER``, provider a word or ``openvino:DEVICE:PRECISION``);
each round times one call of each side's model at each token count (the same tokens, the same past, caches of the same
capacity filled with the same random K/V), the sides in turning order, so that drift on a shared machine hits them
alike. Prints each side's median per T and its ratio to T = 1, and each side's median against the first side's.
``--moving`` advances the past by one slot every round, as decoding does, so that a provider that prepares each new
input shape (OpenVINO) pays for it where a graph's shapes follow the text's length. The first call of each shape is
timed apart (``first``): the compile or preparation a request would meet if no warm-up ran it.

    python -m tools.bench_providers --side cpu=ART@cpu --side ov=ART2@openvino [--role target|draft]
        [--tokens 1,2,3,4,5,6,7,8,9] [--past 200] [--capacity 2048] [--moving] [--rounds 15] [--threads 2]
        [--out FILE.json]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from tools.arguments import integer, integers, parser


def side(text: str) -> tuple[str, Path, str]:
    """LABEL=DIR@PROVIDER -> (label, artifact dir, provider text)."""
    import argparse

    label, sep, rest = text.partition("=")
    directory, at, provider = rest.rpartition("@")
    if not sep or not at or not label or not directory:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected LABEL=DIR@PROVIDER")
    if not (Path(directory) / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"{directory}: no manifest.json; expected an artifact dir")
    return label, Path(directory), provider


def provider_of(text: str):
    """``cpu``, ``openvino`` or ``openvino:DEVICE:PRECISION`` as a Provider."""
    from specdeploy.engines.providers import Provider

    name, *options = text.split(":")
    return Provider(name, *(option or None for option in options))


def time_sides(engines: dict, token_counts: list[int], past: int, capacity: int, rounds: int, moving: bool,
               log=print) -> dict:
    """{label: {"first": {T: seconds}, "median": {T: seconds}}}: each side's first call of each shape, then the median
    of ``rounds`` interleaved calls (the past moving by one slot a round with ``moving``)."""
    caches = {}
    for label, engine in engines.items():
        caches[label] = engine.allocate_cache(1, capacity)
        rng = np.random.default_rng(1)
        for buffer in caches[label].buffers:  # the same random K/V on every side
            buffer[...] = rng.standard_normal(buffer.shape).astype(buffer.dtype)
    vocab = min(engine.spec.vocab_size for engine in engines.values())
    ids = {t: np.random.default_rng(t).integers(0, vocab, (1, t), dtype=np.int64) for t in token_counts}
    first = {label: {} for label in engines}
    times = {label: {t: [] for t in token_counts} for label in engines}
    for label, engine in engines.items():
        for t in token_counts:
            first[label][t] = _seconds(engine, ids[t], past, caches[label])
    for r in range(rounds):
        at = past + (r + 1 if moving else 0)
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for t in token_counts:
            for label in order:
                times[label][t].append(_seconds(engines[label], ids[t], at, caches[label]))
        log(f"round {r + 1}/{rounds}", end="\r")
    log(" " * 20, end="\r")
    return {label: {"first": first[label], "median": {t: statistics.median(v) for t, v in times[label].items()}}
            for label in engines}


def _seconds(engine, ids: np.ndarray, past: int, cache) -> float:
    start = time.perf_counter()
    engine.infer(ids, np.array([past], np.int64), cache)
    return time.perf_counter() - start


def table(results: dict, token_counts: list[int]) -> list[str]:
    """One line per side: the median ms per T, the ratio to T = 1, and the ratio to the first side at each T."""
    labels = list(results)
    base = results[labels[0]]["median"]
    lines = []
    for label in labels:
        median = results[label]["median"]
        cells = [f"T={t}: {median[t] * 1e3:7.1f} ms ({median[t] / median[token_counts[0]]:4.2f}x"
                 + ("" if label == labels[0] else f", {median[t] / base[t]:4.2f} of {labels[0]}") + ")"
                 for t in token_counts]
        first = max(results[label]["first"].values())
        lines.append(f"{label:<14} " + "  ".join(cells) + f"  [first call of a shape: up to {first:.2f} s]")
    return lines


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--side", type=side, action="append", required=True, help="LABEL=DIR@PROVIDER (repeatable)")
    options.add_argument("--role", choices=["target", "draft"], default="target")
    options.add_argument("--tokens", type=integers(1, "token counts"), default=list(range(1, 10)))
    options.add_argument("--past", type=integer(0), default=200)
    options.add_argument("--capacity", type=integer(2), default=None, help="cache slots [default: the artifact's]")
    options.add_argument("--moving", action="store_true", help="advance the past by one slot each round")
    options.add_argument("--rounds", type=integer(1), default=15)
    options.add_argument("--threads", type=integer(1), default=2)
    options.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = options.parse_args()

    from specdeploy.contract import Manifest
    from specdeploy.engines import OrtEngine

    engines = {}
    for label, directory, provider in args.side:
        spec = Manifest.read(directory).models[args.role]
        engines[label] = OrtEngine(directory / spec.file, spec, provider=provider_of(provider), threads=args.threads)
    capacity = args.capacity or min(engine.spec.capacity for engine in engines.values())
    if args.past + max(args.tokens) + (args.rounds if args.moving else 0) > capacity:
        options.error(f"--past {args.past} + {max(args.tokens)} tokens (+ {args.rounds} rounds with --moving) exceeds "
                      f"the capacity {capacity}")
    load = os.getloadavg()
    print(f"{args.role}, batch 1, past {args.past}{' moving' if args.moving else ''}, capacity {capacity}, "
          f"{args.threads} threads, {args.rounds} rounds; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"{platform.processor() or platform.machine()}")
    results = time_sides(engines, args.tokens, args.past, capacity, args.rounds, args.moving,
                         log=lambda *a, **k: print(*a, **k, flush=True))
    for line in table(results, args.tokens):
        print(line)
    after = os.getloadavg()
    print(f"load after: {after[0]:.1f} {after[1]:.1f} {after[2]:.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"sides": {label: [str(d), p] for label, d, p in args.side}, "role": args.role,
                                        "past": args.past, "moving": args.moving, "capacity": capacity,
                                        "load": [load, after], "results": results}, indent=1))


if __name__ == "__main__":
    main()
