"""Exact mode against the default, on real prompts: are the outputs identical, and what does each mode cost?

Per prompt, in turn (the order turning from prompt to prompt, so that a shared machine's drift falls on every
configuration alike): plain decoding and the default speculation (``specdeploy generate``'s drafter, policy and K),
each in the default mode and in exact mode (``GenerationConfig.exact``); greedy. Prints, per mode, how many
speculative outputs are plain decoding's token for token, and each configuration's decode rate against plain
decoding in the default mode (tokens over decode seconds, summed over the prompts; prefill apart). Each run drafts
from its own text alone and reuses no K/V of an earlier run (``suffix_index=None, scope=None``).

    python -m tools.bench_exact --artifact ART [--humaneval 10] [--max-new-tokens 128] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

PLAIN, EXACT_PLAIN, DEFAULT, EXACT_DEFAULT = "plain", "exact plain", "default", "exact default"


def configurations(max_new_tokens: int) -> dict:
    """The four configurations: plain and the CLI's default speculation, each in the default and in exact mode."""
    from tools.demo import cli_default

    default = replace(cli_default(), max_new_tokens=max_new_tokens, temperature=0.0)
    plain = replace(default, drafter="none")
    return {PLAIN: plain, EXACT_PLAIN: replace(plain, exact=True), DEFAULT: default,
            EXACT_DEFAULT: replace(default, exact=True)}


def measure(pipeline, prompts: list, configs: dict, log=print) -> list[dict]:
    """Per prompt, each configuration once, in an order that turns: its tokens, decode seconds and prefill seconds."""
    names = list(configs)
    for config in configs.values():  # first calls of each shape and mode, and the policies' warm-up, paid here
        pipeline.generate([prompts[0]], replace(config, max_new_tokens=4), suffix_index=None, scope=None)
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": i, "order": names[i % len(names):] + names[: i % len(names)]}
        for name in row["order"]:
            result = pipeline.generate([prompt], configs[name], suffix_index=None, scope=None)[0]
            row[name] = {"token_ids": result.token_ids, "tokens": result.stats["tokens"],
                         "seconds": result.stats["seconds"], "prefill_s": result.stats["prefill_s"],
                         "exact": result.stats["exact"]}
        rows.append(row)
        log(f"prompt {i}: " + ", ".join(f"{name} {row[name]['tokens'] / row[name]['seconds']:.2f} tok/s"
                                         for name in names)
            + f"; exact default {'==' if row[EXACT_DEFAULT]['token_ids'] == row[EXACT_PLAIN]['token_ids'] else '!='}"
              f" exact plain; default {'==' if row[DEFAULT]['token_ids'] == row[PLAIN]['token_ids'] else '!='} plain")
    return rows


def summary(rows: list[dict]) -> dict:
    """Identical outputs per mode, and each configuration's pooled decode rate and its ratio to plain's."""
    rate = {name: sum(r[name]["tokens"] for r in rows) / sum(r[name]["seconds"] for r in rows)
            for name in (PLAIN, EXACT_PLAIN, DEFAULT, EXACT_DEFAULT)}
    return {"prompts": len(rows),
            "exact_default_identical_to_exact_plain": sum(r[EXACT_DEFAULT]["token_ids"] == r[EXACT_PLAIN]["token_ids"]
                                                          for r in rows),
            "default_identical_to_plain": sum(r[DEFAULT]["token_ids"] == r[PLAIN]["token_ids"] for r in rows),
            "exact_plain_identical_to_plain": sum(r[EXACT_PLAIN]["token_ids"] == r[PLAIN]["token_ids"] for r in rows),
            "tokens_per_s": rate, "against_plain": {name: rate[name] / rate[PLAIN] for name in rate}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True,
                        help="the artifact (a fused-form target, or an explicit one with slot attention)")
    parser.add_argument("--humaneval", type=int, default=10, help="HumanEval prompts, the first N, in order")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    parser.add_argument("--out", type=Path, default=None, help="write every run and the summary as JSON")
    args = parser.parse_args()
    if args.humaneval < 1 or args.max_new_tokens < 1:
        parser.error(f"--humaneval {args.humaneval}, --max-new-tokens {args.max_new_tokens}: expected at least 1 each")
    from specdeploy import Pipeline
    from specdeploy.workloads import PromptFileError, workload

    try:
        pipeline = Pipeline.load(args.artifact, threads=args.threads)
        prompts = [p.for_pipeline(pipeline) for _, p in workload(args.humaneval, 0)]
    except (PromptFileError, ValueError, RuntimeError, OSError) as exc:  # ContractError, ConfigError
        parser.error(str(exc))
    rows = measure(pipeline, prompts, configurations(args.max_new_tokens))
    found = summary(rows)
    print(json.dumps(found, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"artifact": str(args.artifact), "summary": found, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
