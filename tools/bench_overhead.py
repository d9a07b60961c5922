"""Time per cycle spent outside the backends' calls: acceptance, cache, policy, drafting bookkeeping.

Exports tiny random Llama models (a target and a perturbed copy as draft), then runs greedy and
sampled speculative decoding at batch 1 and 8 and reports, per cycle, wall time minus the time
inside engine calls (each engine is wrapped by a timer), plus the time engines spend writing the
new K/V into the cache (staging: the runtime's cache work, done inside ``Engine.infer``). Target:
<= 50 us per cycle at batch 1. Also printed: the part of engine time spent in ``Engine.infer``'s
input checks, neither in the backend nor staging.

    python -m tools.bench_overhead [--cycles 2000] [--k 4] [--engine ort|instant] [--drafters model]
        [--temperatures 0] [--batches 1] [--policies fixed,cost]
    python -m tools.bench_overhead --index [--index-tokens 200000]

``--index``: the suffix index alone, on text (Spec-Bench's questions, a token a word): what adding a committed token
costs, a proposal from a shared index of ``--index-tokens`` tokens and a request's own, and the memory it takes.

``--policies``: the draft-length policies measured (the cost policy weighs every K at every cycle).

``--engine instant`` swaps ONNX Runtime for engines that return ready outputs at once: the
runtime's own cost, without what each real call leaves behind in the CPU's caches.

``--clock thread`` times the cycle and the engine calls by this thread's CPU time (``time.thread_time``) instead of
wall time: on a shared machine the time other processes held the core is not counted (the engines' K/V staging is
still their wall time).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from tools import arguments

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}  # --clock


class TimedEngine:
    """Delegates to an engine and adds up the seconds spent inside its calls."""

    def __init__(self, engine, clock=time.perf_counter):
        self.engine, self.clock, self.spent, self.backend, self.staging = engine, clock, 0.0, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def infer(self, *args, **kwargs):
        began = self.clock()
        out = self.engine.infer(*args, **kwargs)
        self.spent += self.clock() - began
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

    args = _parser().parse_args()
    if args.index:
        return index_costs(args.index_tokens, args.k)

    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=256), threads=1)
        wrap = InstantEngine if args.engine == "instant" else (lambda engine: engine)
        clock = CLOCKS[args.clock]
        pipeline.target = TimedEngine(wrap(pipeline.target), clock)
        pipeline.draft = TimedEngine(wrap(pipeline.draft), clock)
        print(f"tiny llama pair (vocab {tiny.VOCAB}), k={args.k}, {args.engine} engines, "
              "overhead = cycle wall time - engine time + K/V staging")
        for policy, drafter, temperature, batch in itertools.product(
                args.policies.split(","), args.drafters.split(","), map(float, args.temperatures.split(",")),
                map(int, args.batches.split(","))):
            gen = GenerationConfig(k=args.k, policy=policy, drafter=drafter, temperature=temperature, seed=0,
                                   max_new_tokens=200, ignore_eos=True)
            per_cycle, checks = _overheads(pipeline, gen, batch, args.cycles, clock)
            median = statistics.median(per_cycle) * 1e6
            mean = statistics.fmean(per_cycle) * 1e6
            print(f"policy={policy:<5} drafter={drafter:<13} temperature={temperature} batch={batch}: overhead per cycle "
                  f"median {median:6.1f} us, mean {mean:6.1f} us ({len(per_cycle)} cycles); engines' input checks "
                  f"{statistics.median(checks) * 1e6:5.1f} us", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = arguments.parser(__doc__)
    parser.add_argument("--cycles", type=arguments.integer(1), default=1500, help="cycles measured per configuration")
    parser.add_argument("--k", type=arguments.integer(0), default=4)
    parser.add_argument("--engine", choices=["ort", "instant"], default="ort",
                        help="instant: engines that return at once (random logits), the runtime's own cost")
    parser.add_argument("--drafters", default="model,prompt-lookup", help="comma-separated drafters to measure")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (0: greedy)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--policies", default="fixed", help="comma-separated draft-length policies")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="thread: time by this thread's CPU time, not counting other processes' turns (see above)")
    parser.add_argument("--index", action="store_true", help="measure the suffix index alone (see above)")
    parser.add_argument("--index-tokens", type=arguments.integer(1), default=200_000, help="--index: tokens in the shared index")
    return parser


def _overheads(pipeline, gen, batch: int, cycles: int, clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """Per cycle, whole runs until at least ``cycles``: the seconds outside engine calls plus K/V staging, and the
    seconds in the engines' input checks."""
    per_cycle, checks = [], []
    engines = (pipeline.target, pipeline.draft)
    while len(per_cycle) < cycles:
        run = pipeline.start(["w5 w6 w7 w8 w5 w6"] * batch, gen)
        run.prefill()
        while not run.done:
            spent, backend, staging = _totals(engines)
            began = clock()
            run.step()
            wall = clock() - began
            spent, backend, staging = (after - before for after, before in
                                       zip(_totals(engines), (spent, backend, staging)))
            per_cycle.append(wall - spent + staging)
            checks.append(spent - backend - staging)
    return per_cycle, checks


def index_costs(tokens: int, k: int) -> None:
    """The suffix index's costs on text: Spec-Bench's questions, a token per word (ids by first appearance), repeated
    to ``tokens`` in the shared index; proposals for contexts from the questions held out of it."""
    import json
    from importlib.resources import files

    from specdeploy.runtime.suffix import LEVELS, SuffixIndex, propose

    ids: dict[str, int] = {}
    texts = [[ids.setdefault(word, len(ids)) for word in json.loads(line)["turns"][0].split()]
             for line in files("specdeploy").joinpath("data/spec_bench_question.jsonl").read_text().splitlines()]
    held_out, kept = texts[::10], [t for i, t in enumerate(texts) if i % 10]
    shared, added, began = SuffixIndex(max_tokens=tokens), 0, time.perf_counter()
    for round_ in itertools.count():
        for number, text in enumerate(kept):
            shared.add((round_, number), text)
            added += len(text)
        if added >= tokens:
            break
    per_token = (time.perf_counter() - began) / added
    print(f"shared index: {shared.tokens:,} tokens in {len(shared):,} texts, {shared.nbytes() / 2**20:.1f} MiB "
          f"({shared.nbytes() / shared.tokens:.0f} bytes a token); adding a token {per_token * 1e6:.1f} us")
    updates, proposals, found = [], [], 0
    for number, text in enumerate(held_out):
        own = SuffixIndex()
        for at in range(1, len(text)):  # a request committing one token at a time, a proposal before each
            began = time.perf_counter()
            own.extend(number, text[at - 1 : at])
            updated = time.perf_counter()
            drafts = propose((own, shared), text[max(0, at - LEVELS[0]) : at], k)[0]
            proposals.append(time.perf_counter() - updated)
            updates.append(updated - began)
            found += bool(drafts)
    print(f"a request's own index: adding a committed token median {statistics.median(updates) * 1e6:.1f} us; "
          f"a proposal (own + shared, K <= {k}) median {statistics.median(proposals) * 1e6:.1f} us, "
          f"p90 {sorted(proposals)[len(proposals) * 9 // 10] * 1e6:.1f} us ({len(proposals):,} proposals, "
          f"{found / len(proposals):.0%} found a match)")


if __name__ == "__main__":
    main()
