"""Soak: many cycles on tiny models with random configurations; resident memory must stay flat.

Exports a tiny random Llama pair, then runs random requests (drafter, policy, k, temperature,
top-k/top-p, batch size, prompt length, stop tokens) until --cycles cycles have run, sampling the
process's resident set size. Reports RSS after warm-up and at the end (target: within 5%), and
any error (with the configuration that raised it).

    python -m tools.soak [--cycles 10000] [--seed 0]
"""

from __future__ import annotations

import random
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools import arguments

DRIFT_LIMIT = 5.0  # percent of the RSS after warm-up


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


@dataclass
class Soaked:
    cycles: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)  # each with the configuration that raised it
    rss_start: float = 0.0  # MiB
    rss_warm: float = 0.0  # after the warm-up cycles
    rss_end: float = 0.0

    @property
    def drift(self) -> float:
        """RSS growth from the end of the warm-up to the end, in percent."""
        return (self.rss_end - self.rss_warm) / self.rss_warm * 100


def soak(pipeline, cycles: int, warmup: int, seed: int) -> Soaked:
    """Random requests on ``pipeline`` (words w4..w119 of the tiny tokenizer) until ``cycles`` cycles have run."""
    rng = random.Random(seed)
    soaked = Soaked(rss_start=rss_mib())
    while soaked.cycles < cycles:
        config = random_config(rng)
        prompts = [" ".join(f"w{rng.randint(4, 119)}" for _ in range(rng.randint(1, 20))) for _ in range(rng.randint(1, 6))]
        try:
            run = pipeline.start(prompts, config)
            while not run.done:
                run.step()
                soaked.cycles += 1
            soaked.requests += len(prompts)
        except Exception as exc:  # the soak reports every error rather than stopping at the first
            soaked.errors.append(f"{type(exc).__name__}: {exc} ({config})")
            soaked.cycles += 1  # a request that fails at once still moves the soak on
        if not soaked.rss_warm and soaked.cycles >= warmup:
            soaked.rss_warm = rss_mib()
    soaked.rss_end = rss_mib()
    soaked.rss_warm = soaked.rss_warm or soaked.rss_end
    return soaked


def main() -> None:
    from specdeploy import Pipeline
    from tests import tiny

    parser = arguments.parser(__doc__)
    parser.add_argument("--cycles", type=arguments.integer(1), default=10_000)
    parser.add_argument("--seed", type=arguments.integer(0), default=0)
    parser.add_argument("--warmup", type=arguments.integer(0), default=1000, help="cycles before the baseline RSS is taken")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=128), threads=1)
        began = time.perf_counter()
        soaked = soak(pipeline, args.cycles, args.warmup, args.seed)
        print(f"{soaked.cycles} cycles, {soaked.requests} requests in {time.perf_counter() - began:.0f} s; RSS at start "
              f"{soaked.rss_start:.1f} MiB, after {args.warmup} warm-up cycles {soaked.rss_warm:.1f} MiB, at end "
              f"{soaked.rss_end:.1f} MiB ({soaked.drift:+.1f}%); errors: {len(soaked.errors)}")
        for error in soaked.errors[:10]:
            print("  " + error)
        sys.exit(1 if soaked.errors or abs(soaked.drift) > DRIFT_LIMIT else 0)


if __name__ == "__main__":
    main()
