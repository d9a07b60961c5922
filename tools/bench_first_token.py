"""The first token as a user of `specdeploy generate` waits for it: from the command's start, fresh processes.

Each run is a new `specdeploy generate ART --prompt P --max-new-tokens N --threads 2` process with the CLI's
defaults (the cost policy over the hybrid drafter, costs remembered), plus any --option given; it times the
first byte on stdout (the CLI prints a prompt's text with its first chunk: loading, prefill and the first
cycle) and the whole run. Artifacts alternate within each prompt, their order turning each round, so that the
machine's drift hits them alike; medians per prompt and artifact.

    python -m tools.bench_first_token --artifact OLD --artifact NEW [--humaneval 1] [--specbench 1]
        [--prompt TEXT ...] [--rounds 3] [--max-new-tokens 32] [--option=--k=4 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specdeploy.workloads import PromptFileError, workload
from tools import arguments


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    prompts = [(f"prompt {i}", text) for i, text in enumerate(args.prompt)]
    try:
        prompts += [(p.id if g == "humaneval" else f"{g} {p.id}", p.text)
                    for g, p in workload(args.humaneval, args.specbench, humaneval_from=8)]
    except PromptFileError as exc:
        parser.error(str(exc))
    if not prompts:
        parser.error("no prompts: give --prompt, --humaneval or --specbench")
    runs = _time_runs(args, prompts)
    summary = _medians(runs, prompts, args.artifact)
    if args.out:
        args.out.write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "options": args.option,
                                        "runs": runs, "summary": summary}, indent=1))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = arguments.parser(__doc__)
    parser.add_argument("--artifact", type=Path, action="append", required=True,
                        help="an artifact dir; give it again for each artifact to compare")
    parser.add_argument("--humaneval", type=arguments.integer(0), default=1, help="HumanEval prompts, from HumanEval/8 (default 1)")
    parser.add_argument("--specbench", type=arguments.integer(0), default=1,
                        help="Spec-Bench prompts per category group (default 1)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt of your own (repeatable)")
    parser.add_argument("--rounds", type=arguments.integer(1), default=3)
    parser.add_argument("--max-new-tokens", type=arguments.integer(1), default=32)
    parser.add_argument("--option", action="append", default=[],
                        help="one more `specdeploy generate` argument, e.g. --option=--k=4 (repeatable)")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    return parser


def _time_runs(args: argparse.Namespace, prompts: list[tuple[str, str]]) -> list[dict]:
    """Every round's run of each prompt on each artifact, the artifacts' order turning each round; prints each."""
    runs = []
    for round_ in range(args.rounds):
        for label, text in prompts:
            turn = round_ % len(args.artifact)
            for artifact in args.artifact[turn:] + args.artifact[:turn]:
                first, whole = _run(artifact, text, args.max_new_tokens, args.option)
                runs.append({"prompt": label, "artifact": str(artifact), "first_token_s": first, "whole_run_s": whole})
                print(f"round {round_} {label:40.40} {artifact.name:40.40} first {first:6.2f} s  whole {whole:6.2f} s",
                      flush=True)
    return runs


def _medians(runs: list[dict], prompts: list[tuple[str, str]], artifacts: list[Path]) -> list[dict]:
    """The median first-token and whole-run seconds per prompt and artifact, printed as a Markdown table."""
    summary = []
    print("\n| prompt | artifact | first token s (median) | whole run s (median) |\n|---|---|---|---|")
    for label, _ in prompts:
        for artifact in artifacts:
            mine = [r for r in runs if r["prompt"] == label and r["artifact"] == str(artifact)]
            row = {"prompt": label, "artifact": str(artifact),
                   "first_token_s": statistics.median(r["first_token_s"] for r in mine),
                   "whole_run_s": statistics.median(r["whole_run_s"] for r in mine)}
            summary.append(row)
            print(f"| {label} | {artifact} | {row['first_token_s']:.2f} | {row['whole_run_s']:.2f} |")
    return summary


def _run(artifact: Path, prompt: str, tokens: int, options: list[str]) -> tuple[float, float]:
    """Seconds from the start of one fresh `specdeploy generate` to its first byte on stdout, and to its end."""
    command = [sys.executable, "-m", "specdeploy.cli", "generate", str(artifact), "--prompt", prompt,
               "--max-new-tokens", str(tokens), "--threads", "2", *options]
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.read(1)
    first = time.perf_counter() - began
    _, errors = process.communicate()
    whole = time.perf_counter() - began
    if process.returncode:
        raise SystemExit(f"{' '.join(command[:5])} … failed:\n{errors.decode(errors='replace')[-2000:]}")
    return first, whole


if __name__ == "__main__":
    sys.exit(main())
