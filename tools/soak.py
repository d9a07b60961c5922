"""Soak: many cycles on tiny models with random configurations; resident memory must stay flat.

Exports a tiny random Llama pair, then runs random requests (drafter, policy, k, temperature,
top-k/top-p, batch size, prompt length, stop tokens) until --cycles cycles have run, sampling the
process's resident set size. Reports RSS after warm-up and at the end (target: within 5%), and
any error (with the configuration that raised it).

    python tools/soak.py [--cycles 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    """Current resident set size from /proc (ru_maxrss only gives the peak)."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def random_config(rng: random.Random):
    from specdeploy import GenerationConfig

    return GenerationConfig(
        max_new_tokens=rng.randint(1, 48), temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.3]),
        top_k=rng.choice([0, 0, 5, 20]), top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]), seed=rng.randint(0, 2**31), k=rng.randint(0, 8),
        policy=rng.choice(["fixed", "confidence", "heuristic", "cost"]),
        drafter=rng.choice(["model", "model", "prompt-lookup", "none"]),
        stop_token_ids=tuple(rng.sample(range(128), rng.choice([0, 0, 1]))), ignore_eos=rng.random() < 0.5,
    )


def main() -> None:
    from specdeploy import Pipeline
    from tests import tiny

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1000, help="cycles before the baseline RSS is taken")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=128), threads=1)
        cycles, errors, requests, baseline = 0, [], 0, None
        start = rss_mib()
        began = time.perf_counter()
        while cycles < args.cycles:
            gen = random_config(rng)
            prompts = [" ".join(f"w{rng.randint(4, 119)}" for _ in range(rng.randint(1, 20)))
                       for _ in range(rng.randint(1, 6))]
            try:
                run = pipeline.start(prompts, gen)
                while not run.done:
                    run.step()
                    cycles += 1
                requests += len(prompts)
            except Exception as exc:  # the soak reports every error rather than stopping at the first
                errors.append(f"{type(exc).__name__}: {exc} ({gen})")
            if baseline is None and cycles >= args.warmup:
                baseline = rss_mib()
        end = rss_mib()
        drift = (end - baseline) / baseline * 100
        print(f"{cycles} cycles, {requests} requests in {time.perf_counter() - began:.0f} s; RSS at start {start:.1f} MiB, "
              f"after {args.warmup} warm-up cycles {baseline:.1f} MiB, at end {end:.1f} MiB ({drift:+.1f}%); "
              f"errors: {len(errors)}")
        for error in errors[:10]:
            print("  " + error)
        sys.exit(1 if errors or abs(drift) > 5 else 0)


if __name__ == "__main__":
    main()
