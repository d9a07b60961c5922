"""Prefill and a draft's catch-up as the runtime runs them, per artifact, model and prompt length.

Exporter 0.3.2's fused graphs put only the positions whose logits are asked for through the head
(``ModelSpec.trims_logits``): a prefill chunk or a catch-up needs the last one. Given the same pair exported
before and after, this times ``engines.base.prefill`` (the runtime's path: chunks of PREFILL_CHUNK tokens,
the last position's logits asked for) of one random prompt per length into a fresh cache, every model of
every artifact in turn within a round, so that the machine's drift hits them alike. The first call of each
shape is cold (ONNX Runtime plans and allocates its buffers), as in every `specdeploy generate` process: it is
reported apart, and the median of the later rounds as the warm cost (the cold call also reads the weights from
disk when they are not in the page cache). The last position's logits of each artifact are compared with the
first artifact's.

    python -m tools.bench_prefill --artifact OLD --artifact NEW [--lengths 32,128,512,1024] [--rounds 5]
        [--threads 2] [--out FILE]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

try:
    from tools import arguments
except ImportError:  # run as a script (python tools/bench_prefill.py): its folder is on the path
    import arguments


def main(argv: list[str] | None = None) -> int:
    parser = arguments.parser(__doc__)
    parser.add_argument("--artifact", type=Path, action="append", required=True,
                        help="an artifact dir; give it again for each artifact to compare (the first is the reference)")
    parser.add_argument("--lengths", default="32,128,512,1024", help="comma list of prompt lengths in tokens")
    parser.add_argument("--rounds", type=arguments.integer(1), default=5, help="rounds after the cold one (median reported)")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="one ONNX Runtime pool of this many threads")
    parser.add_argument("--out", type=Path, help="write the timings as JSON here")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.rounds < 1 or not lengths or min(lengths) < 1:
        parser.error("--rounds and every length must be at least 1")

    from specdeploy.contract import Manifest
    from specdeploy.engines import load_engine

    engines = {}  # (artifact index, role) -> engine
    for index, directory in enumerate(args.artifact):
        manifest = Manifest.read(directory)
        for role in manifest.models:
            spec = manifest.models[role]
            if max(lengths) >= spec.capacity:
                parser.error(f"--lengths: {max(lengths)} tokens do not fit {directory}'s {role} (capacity {spec.capacity})")
            engines[index, role] = load_engine(directory, manifest, role, "cpu", args.threads)
    vocab = min(e.spec.vocab_size for e in engines.values())
    prompts = {n: np.random.default_rng(n).integers(0, vocab, (1, n)) for n in lengths}

    seconds, last_logits = _time_rounds(engines, prompts, lengths, args.rounds)
    rows = _rows(args.artifact, engines, seconds, last_logits)
    _print(rows)
    if args.out:
        args.out.write_text(json.dumps({"lengths": lengths, "rounds": args.rounds, "threads": args.threads,
                                        "rows": rows}, indent=1))
    return 0


def _time_rounds(engines: dict, prompts: dict[int, np.ndarray], lengths: list[int], rounds: int) -> tuple[dict, dict]:
    """The cold round and ``rounds`` more of every model on every prompt: seconds per (artifact index, role, length),
    and the last round's last-position logits."""
    seconds: dict[tuple, list[float]] = {}
    last_logits: dict[tuple, np.ndarray] = {}
    order = list(engines.items())
    for round_ in range(rounds + 1):
        for n in lengths:
            turn = round_ % len(order)  # each model goes first in turn: nothing gains from its place in a round
            for key, engine in order[turn:] + order[:turn]:
                taken, logits = _prefill(engine, prompts[n])
                seconds.setdefault((*key, n), []).append(taken)
                last_logits[(*key, n)] = logits
    return seconds, last_logits


def _rows(artifacts: list[Path], engines: dict, seconds: dict, last_logits: dict) -> list[dict]:
    """One row per artifact, model and length: cold and warm ms, and against the first artifact's same model."""
    rows = []
    for (index, role, n), times in seconds.items():
        reference = seconds[0, role, n] if (0, role, n) in seconds else None
        differs = last_logits.get((0, role, n))
        rows.append({
            "artifact": str(artifacts[index]), "index": index, "role": role, "tokens": n,
            "trims_logits": engines[index, role].spec.trims_logits,
            "cold_ms": 1000 * times[0], "warm_ms": 1000 * statistics.median(times[1:]),
            "warm_vs_first_artifact": statistics.median(times[1:]) / statistics.median(reference[1:]) if reference else None,
            "max_logit_difference": None if differs is None else float(np.abs(last_logits[index, role, n] - differs).max()),
        })
    return rows


def _prefill(engine, ids: np.ndarray) -> tuple[float, np.ndarray]:
    """Seconds to bring a fresh cache up to all of ``ids`` as the runtime does, and the last position's logits."""
    from specdeploy.engines.base import feed, prefill

    cache = engine.allocate_cache(1, ids.shape[1] + 1)
    began = time.perf_counter()
    prefill(engine, cache, ids, [ids.shape[1] - 1])
    logits, _ = feed(engine, cache, ids, [ids.shape[1]])  # the last token, as a catch-up's last call: its logits
    return time.perf_counter() - began, logits[0].copy()


def _print(rows: list[dict]) -> None:
    print("| artifact | model | trims logits | tokens | cold ms | warm ms | warm / first artifact | last logits differ by |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["role"] != "target", r["role"], r["tokens"], r["index"])):
        ratio = "" if r["warm_vs_first_artifact"] is None else f"{r['warm_vs_first_artifact']:.2f}"
        differ = "" if r["max_logit_difference"] is None else f"{r['max_logit_difference']:.2g}"
        print(f"| {r['index']} | {r['role']} | {'yes' if r['trims_logits'] else 'no'} | {r['tokens']} | "
              f"{r['cold_ms']:.0f} | {r['warm_ms']:.0f} | {ratio} | {differ} |")
    for index, artifact in sorted({(r["index"], r["artifact"]) for r in rows}):
        print(f"artifact {index}: {artifact}")


if __name__ == "__main__":
    sys.exit(main())
