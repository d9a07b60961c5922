"""The cost policy with and without its benefit of the doubt, side by side in one process.

Each request starts from a fresh policy (no costs or acceptance carried from the one before, as in a
new `specdeploy generate` process but with warm ONNX Runtime sessions), greedy, 128 new tokens, on
HumanEval and one Spec-Bench first turn per group; configurations rotate per prompt. "no-doubt" sets
``CostModel.settled = 0``: plain decoding is then chosen whenever the point estimate says so, as before
the doubt. Prints decode tok/s per prompt, the median and the geometric mean of each against plain.

    python tools/ab_policy_doubt.py --artifact DIR [--humaneval 8] [--specbench 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real_pair import workload  # noqa: E402

CONFIGS = {  # name -> (GenerationConfig fields, CostModel.settled for it; None: the class's own)
    "plain": ({"drafter": "none"}, None),
    "k=4": ({"policy": "fixed", "k": 4, "drafter": "model"}, None),
    "cost doubt": ({"policy": "cost", "k": 8, "drafter": "model"}, None),
    "cost no-doubt": ({"policy": "cost", "k": 8, "drafter": "model"}, 0),
    "hybrid doubt": ({"policy": "cost", "k": 8, "drafter": "hybrid"}, None),
    "hybrid no-doubt": ({"policy": "cost", "k": 8, "drafter": "hybrid"}, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True, help="an exported artifact dir with a draft")
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts (default: 8)")
    parser.add_argument("--specbench", type=int, default=1, help="Spec-Bench prompts per group (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="also write the rates as JSON")
    args = parser.parse_args()

    from specdeploy import GenerationConfig, Pipeline
    from specdeploy.runtime.policies import CostModel

    settled = CostModel.settled
    pipeline = Pipeline.load(args.artifact, threads=2, remember_costs=False)
    pipeline.generate(["def f(x):"], GenerationConfig(max_new_tokens=8, drafter="none"))  # warm-up
    prompts = workload(args.humaneval, args.specbench)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for i, (group, prompt) in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            fields, doubt = CONFIGS[name]
            CostModel.settled = settled if doubt is None else doubt
            pipeline._policies.clear()  # a fresh policy for every request: nothing inherited
            result = pipeline.generate([prompt.text], GenerationConfig(max_new_tokens=args.max_new_tokens, **fields))[0]
            rates[name].append(result.stats["tokens_per_s"])
        print(f"{group:<26}" + " ".join(f"{name} {rates[name][-1]:.1f}" for name in names), flush=True)
    CostModel.settled = settled
    print("median tok/s    " + " ".join(f"{name} {statistics.median(v):.2f}" for name, v in rates.items()))
    print("geomean / plain " + " ".join(
        f"{name} {statistics.geometric_mean([a / b for a, b in zip(v, rates['plain'])]):.3f}" for name, v in rates.items()))
    if args.out:
        args.out.write_text(json.dumps({"groups": [g for g, _ in prompts], "rates": rates}, indent=2))


if __name__ == "__main__":
    main()
