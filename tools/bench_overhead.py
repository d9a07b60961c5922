"""Time per cycle spent outside the backends' calls: acceptance, cache, policy, drafting bookkeeping.

Exports tiny random Llama models (a target and a perturbed copy as draft), then runs greedy and
sampled speculative decoding at batch 1 and 8 and reports, per cycle, wall time minus the time
inside engine calls (each engine is wrapped by a timer), plus the time engines spend writing the
new K/V into the cache (staging: the runtime's cache work, done inside ``Engine.infer``). Target:
<= 50 us per cycle at batch 1. Also printed: the part of engine time spent in ``Engine.infer``'s
input checks, neither in the backend nor staging.

    python -m tools.bench_overhead [--cycles 2000] [--k 4] [--engine ort|instant] [--drafters model]
        [--temperatures 0] [--batches 1] [--policies fixed,cost]

``--policies``: the draft-length policies measured (the cost policy weighs every K at every cycle).

``--engine instant`` swaps ONNX Runtime for engines that return ready outputs at once: the
runtime's own cost, without what each real call leaves behind in the CPU's caches.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path


class TimedEngine:
    """Delegates to an engine and adds up the seconds spent inside its calls."""

    def __init__(self, engine):
        self.engine, self.spent, self.backend, self.staging = engine, 0.0, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def infer(self, *args):
        began = time.perf_counter()
        out = self.engine.infer(*args)
        self.spent += time.perf_counter() - began
        self.backend += out.seconds  # the backend's own part
        self.staging += out.stage_seconds  # writing the new K/V into the cache; the rest is input checks
        return out


class InstantEngine:
    """Returns ready-made outputs of the right shapes at once (the real engine's spec and checks)."""

    def __init__(self, engine):
        import numpy as np

        from specdeploy.engines.base import Engine

        class Instant(Engine):
            def __init__(self, spec):
                self.spec, self.outputs, self.rng = spec, {}, np.random.default_rng(0)

            def infer_impl(self, input_ids, past_len, cache, kept):
                shape = (*input_ids.shape, kept)
                if shape not in self.outputs:
                    batch, tokens = input_ids.shape
                    logits = self.rng.standard_normal((batch, kept, self.spec.vocab_size)).astype(np.float32)
                    kv = np.zeros((2 * self.spec.num_layers, *self.spec.cache_shape(batch, tokens)), self.cache_dtype)
                    self.outputs[shape] = logits, kv, None  # no argmax ids output
                return self.outputs[shape]

        self.engine = Instant(engine.spec)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _totals(engines) -> tuple[float, float, float]:
    """Seconds the timed engines spent in calls, in their backends and staging K/V, so far."""
    return tuple(sum(getattr(e, name) for e in engines) for name in ("spent", "backend", "staging"))


def main() -> None:
    from specdeploy import GenerationConfig, Pipeline
    from tests import tiny

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=1500, help="cycles measured per configuration")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--engine", choices=["ort", "instant"], default="ort",
                        help="instant: engines that return at once (random logits), the runtime's own cost")
    parser.add_argument("--drafters", default="model,prompt-lookup", help="comma-separated drafters to measure")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (0: greedy)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--policies", default="fixed", help="comma-separated draft-length policies")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=256), threads=1)
        wrap = InstantEngine if args.engine == "instant" else (lambda engine: engine)
        pipeline.target = TimedEngine(wrap(pipeline.target))
        pipeline.draft = TimedEngine(wrap(pipeline.draft))
        print(f"tiny llama pair (vocab {tiny.VOCAB}), k={args.k}, {args.engine} engines, "
              "overhead = cycle wall time - engine time + K/V staging")
        for policy, drafter, temperature, batch in itertools.product(
                args.policies.split(","), args.drafters.split(","), map(float, args.temperatures.split(",")),
                map(int, args.batches.split(","))):
            per_cycle, checks = [], []
            engines = (pipeline.target, pipeline.draft)
            gen = GenerationConfig(k=args.k, policy=policy, drafter=drafter, temperature=temperature, seed=0,
                                   max_new_tokens=200, ignore_eos=True)
            cycles = 0
            while cycles < args.cycles:
                run = pipeline.start(["w5 w6 w7 w8 w5 w6"] * batch, gen)
                run.prefill()
                while not run.done:
                    spent, backend, staging = _totals(engines)
                    began = time.perf_counter()
                    run.step()
                    wall = time.perf_counter() - began
                    spent, backend, staging = (after - before for after, before in
                                               zip(_totals(engines), (spent, backend, staging)))
                    per_cycle.append(wall - spent + staging)
                    checks.append(spent - backend - staging)
                    cycles += 1
            median = statistics.median(per_cycle) * 1e6
            mean = statistics.fmean(per_cycle) * 1e6
            print(f"policy={policy:<5} drafter={drafter:<13} temperature={temperature} batch={batch}: overhead per cycle "
                  f"median {median:6.1f} us, mean {mean:6.1f} us ({cycles} cycles); engines' input checks "
                  f"{statistics.median(checks) * 1e6:5.1f} us", flush=True)


if __name__ == "__main__":
    main()
