"""How the target's and the draft's ONNX Runtime sessions share the cores: three ways, side by side.

- ``spinning``: a thread pool per session whose threads spin on after each call (ONNX Runtime's default, and
  specdeploy's without ``--threads`` until the change this measures): the idle model's threads run against
  the busy one's;
- ``stop`` (now the default without ``--threads``): a pool per session, ``session.force_spinning_stop``;
- ``shared``: one process-wide pool of ``--threads`` threads (``--threads N`` on the CLI).

Each mode runs in worker processes of its own (ONNX Runtime sets the shared pool once per process),
rotating per round so that the machine's drift hits all alike. A worker decodes one unmeasured request per
configuration, then each configuration ``--repeats`` times, interleaved: plain target decoding, the draft
model at fixed K, and the CLI's default speculation (the cost policy over the hybrid drafter). Prints the
median tok/s (prefill and decoding) per mode and configuration, and each against ``spinning``.

    python -m tools.bench_thread_pool --artifact DIR [--rounds 3] [--repeats 3] [--max-new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import arguments

MODES = ("spinning", "stop", "shared")
ROOT = Path(__file__).resolve().parents[1]  # the workers run as ``python -m tools.bench_thread_pool`` from here


def configurations(k: int) -> dict:
    from specdeploy import GenerationConfig

    return {"plain": GenerationConfig(drafter="none"),
            f"fixed k={k}": GenerationConfig(k=k, policy="fixed", drafter="model"),
            "cost k<=8, hybrid": GenerationConfig(k=8, policy="cost", drafter="hybrid")}


def spinning_pools() -> None:
    """Every session on a pool of its own whose threads spin on after a call, as ONNX Runtime's default has it."""
    import onnxruntime as ort

    session = ort.InferenceSession

    def spinning(path, options=None, *args, **kwargs):
        options = options or ort.SessionOptions()
        options.add_session_config_entry("session.force_spinning_stop", "0")
        return session(path, options, *args, **kwargs)

    ort.InferenceSession = spinning


def worker(artifact: str, mode: str, repeats: int, max_new_tokens: int, k: int, threads: int) -> dict:
    """tok/s per configuration, ``repeats`` requests each, interleaved."""
    from dataclasses import replace

    from specdeploy import Pipeline
    from tools.demo import CODE_PROMPT  # make demo's code completion

    if mode == "spinning":
        spinning_pools()
    pipeline = Pipeline.load(artifact, threads=threads if mode == "shared" else None)
    grid = {name: replace(config, max_new_tokens=max_new_tokens) for name, config in configurations(k).items()}
    for config in grid.values():  # first calls at each shape, unmeasured
        pipeline.generate([CODE_PROMPT], config)
    rates: dict[str, list[float]] = {name: [] for name in grid}
    for _ in range(repeats):
        for name, config in grid.items():
            began = time.perf_counter()
            result = pipeline.generate([CODE_PROMPT], config)[0]
            if result.error:
                raise RuntimeError(f"{mode}, {name}: {result.error}")
            rates[name].append(len(result.token_ids) / (time.perf_counter() - began))
    return rates


def main() -> None:
    parser = arguments.parser(__doc__)
    parser.add_argument("--artifact", type=arguments.artifact, required=True, help="an exported pair (make demo's, for instance)")
    parser.add_argument("--rounds", type=arguments.integer(1), default=3, help="worker processes per mode, rotating")
    parser.add_argument("--repeats", type=arguments.integer(1), default=3, help="measured requests per configuration and worker")
    parser.add_argument("--max-new-tokens", type=arguments.integer(1), default=128)
    parser.add_argument("--k", type=arguments.integer(0), default=4, help="the fixed-K configuration's draft length")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="the shared pool's size")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.artifact, args.worker, args.repeats, args.max_new_tokens, args.k, args.threads)))
        return

    rates: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES[round_ % len(MODES):] + MODES[: round_ % len(MODES)]:
            command = [sys.executable, "-m", "tools.bench_thread_pool", "--artifact", args.artifact, "--worker", mode, "--repeats",
                       str(args.repeats), "--max-new-tokens", str(args.max_new_tokens), "--k", str(args.k),
                       "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                raise SystemExit(f"{mode} worker failed:\n{done.stderr[-2000:]}")
            for name, values in json.loads(done.stdout.strip().splitlines()[-1]).items():
                rates[mode].setdefault(name, []).extend(values)
            print(f"round {round_ + 1}, {mode}: done", flush=True)
    medians = {mode: {name: statistics.median(v) for name, v in by_name.items()} for mode, by_name in rates.items()}
    print(f"\nmake demo's code completion, {args.max_new_tokens} new tokens, greedy, median tok/s over {args.rounds} workers "
          f"x {args.repeats} requests per mode\n{'configuration':20} {'spinning':>9} {'stop':>6} {'shared':>7} "
          f"{'stop/spinning':>14} {'shared/spinning':>16}")
    for name in medians["spinning"]:
        spinning, stop, shared = (medians[mode][name] for mode in MODES)
        print(f"{name:20} {spinning:9.1f} {stop:6.1f} {shared:7.1f} {stop / spinning:14.2f} {shared / spinning:16.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rates": rates, "medians": medians, "max_new_tokens": args.max_new_tokens,
                                        "rounds": args.rounds, "repeats": args.repeats}, indent=1))


if __name__ == "__main__":
    main()
