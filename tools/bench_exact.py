"""Exact mode against the default, on real prompts: are the outputs identical, and what does each mode cost?

Per prompt, in turn (the order turning from prompt to prompt, so that a shared machine's drift falls on every
configuration alike): plain decoding and the default speculation (``specdeploy generate``'s drafter, policy and K),
each in the default mode and in exact mode (``GenerationConfig.exact``); greedy. Prints, per mode, how many
speculative outputs are plain decoding's token for token, and each configuration's decode rate against plain
decoding in the default mode (tokens over decode seconds, summed over the prompts; prefill apart). Each run drafts
from its own text alone and reuses no K/V of an earlier run (``suffix_index=None, scope=None``).

    python -m tools.bench_exact --artifact ART [--humaneval 10] [--specbench 0] [--max-new-tokens 128] [--threads 2]
        [--provider cpu] [--draft-provider P] [--out FILE]

``--provider`` (``cpu``, ``openvino`` or ``openvino:DEVICE:PRECISION``) runs the pair on another execution provider,
``--draft-provider`` its draft on another still: exact mode's cost is the target's provider's (a provider whose kernels
compute a position alike whatever a call's size has nothing to pad). ``--specbench N`` adds Spec-Bench's first N
questions of each group after the HumanEval problems; the summary gives each group's rates too.
"""

from __future__ import annotations

import argparse
import json
import os
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


def measure(pipeline, prompts: list, configs: dict, log=print, groups: list[str] | None = None) -> list[dict]:
    """Per prompt, each configuration once, in an order that turns: its tokens, decode seconds and prefill seconds
    (and its workload group, where ``groups`` names each prompt's)."""
    names = list(configs)
    for config in configs.values():  # first calls of each shape and mode, and the policies' warm-up, paid here
        pipeline.generate([prompts[0]], replace(config, max_new_tokens=4), suffix_index=None, scope=None)
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": i, "order": names[i % len(names):] + names[: i % len(names)]}
        if groups is not None:
            row["group"] = groups[i]
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
    """Identical outputs per mode, and each configuration's pooled decode rate and its ratio to plain's; where rows
    name their group, the same per group (``groups``) and exact mode's default against the default mode's."""
    rate = {name: sum(r[name]["tokens"] for r in rows) / sum(r[name]["seconds"] for r in rows)
            for name in (PLAIN, EXACT_PLAIN, DEFAULT, EXACT_DEFAULT)}
    found = _counts(rows, rate)
    named = sorted({r["group"] for r in rows if "group" in r})
    if named:
        found["groups"] = {group: summary([{k: v for k, v in r.items() if k != "group"} for r in rows
                                           if r.get("group") == group]) for group in named}
    return found


def _counts(rows: list[dict], rate: dict) -> dict:
    return {"prompts": len(rows),
            "exact_default_identical_to_exact_plain": sum(r[EXACT_DEFAULT]["token_ids"] == r[EXACT_PLAIN]["token_ids"]
                                                          for r in rows),
            "default_identical_to_plain": sum(r[DEFAULT]["token_ids"] == r[PLAIN]["token_ids"] for r in rows),
            "exact_plain_identical_to_plain": sum(r[EXACT_PLAIN]["token_ids"] == r[PLAIN]["token_ids"] for r in rows),
            "tokens_per_s": rate, "against_plain": {name: rate[name] / rate[PLAIN] for name in rate},
            "exact_default_against_default": rate[EXACT_DEFAULT] / rate[DEFAULT]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True,
                        help="the artifact (a fused-form target, or an explicit one with slot attention)")
    parser.add_argument("--humaneval", type=int, default=10, help="HumanEval prompts, the first N, in order")
    parser.add_argument("--specbench", type=int, default=0, help="Spec-Bench's first N questions of each group, after")
    parser.add_argument("--provider", default="cpu",
                        help="the execution provider: cpu, openvino, or openvino:DEVICE:PRECISION")
    parser.add_argument("--draft-provider", default=None, help="the draft model's provider (default: --provider's)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    parser.add_argument("--out", type=Path, default=None, help="write every run and the summary as JSON")
    args = parser.parse_args()
    if args.humaneval + args.specbench < 1 or min(args.humaneval, args.specbench) < 0 or args.max_new_tokens < 1:
        parser.error(f"--humaneval {args.humaneval}, --specbench {args.specbench}, --max-new-tokens "
                     f"{args.max_new_tokens}: expected counts >= 0, at least one prompt and one token")
    from specdeploy import Pipeline
    from specdeploy.workloads import PromptFileError, workload
    from tools.bench_providers import provider_of

    try:
        draft_provider = None if args.draft_provider is None else provider_of(args.draft_provider)
        pipeline = Pipeline.load(args.artifact, provider=provider_of(args.provider), threads=args.threads,
                                 draft_provider=draft_provider)
        chosen = workload(args.humaneval, args.specbench)
        prompts = [p.for_pipeline(pipeline) for _, p in chosen]
    except (PromptFileError, ValueError, RuntimeError, OSError) as exc:  # ContractError, ConfigError, ProviderError
        parser.error(str(exc))
    load = os.getloadavg()
    rows = measure(pipeline, prompts, configurations(args.max_new_tokens), groups=[group for group, _ in chosen])
    found = summary(rows) | {"providers": {"target": pipeline.target.provider.key,
                                           "draft": None if pipeline.draft is None else pipeline.draft.provider.key},
                             "exact_pads": not pipeline.target.rows_alike,
                             "load": {"before": load, "after": os.getloadavg()}}
    print(json.dumps(found, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"artifact": str(args.artifact), "summary": found, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
