"""The cost policy as a CLI user meets it: every `specdeploy generate` a fresh process.

Each run is a new `specdeploy generate --json` process (greedy, 2 threads), configurations round-robin
per prompt (machine drift hits all alike): plain target decoding, the draft model at fixed K, and the
cost policy (K <= 8) with the engine costs the last run remembered (the CLI default) and without them
(`--no-remember-costs`, every run cold, as before 0.3.1), and the cost policy over the hybrid drafter
(`--drafter hybrid`: prompt lookup where the text repeats itself, the draft model elsewhere). tok/s counts prefill and decoding, not
loading (the same for every configuration). Before the measured runs, one unmeasured cost-policy run
fills the record, as any earlier run on this machine would.

Reports per prompt group and completion length the median tok/s of each configuration, and the cost
policy against plain decoding and the best fixed K (the goal: never below plain, within 5 % of the
best fixed K).

    python tools/bench_cli_policies.py --artifact DIR [--humaneval 8] [--humaneval-from 8] [--specbench 1]
        [--lengths 32,128] [--ks 2,4] [--no-cold] [--baseline CHECKOUT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real_pair import workload  # noqa: E402


def configurations(ks: list[int]) -> dict[str, list[str]]:
    """Each configuration's `generate` options, every one of policy, K and drafter spelled out: left to the CLI's
    defaults (the cost policy over the hybrid drafter since 0.3.1), "k=4" ran the cost policy at K <= 4 and "cost"
    ran the hybrid drafter, so three columns of two runs measured what "hybrid, cost" did (README)."""
    out = {"plain": ["--policy", "fixed", "--drafter", "none"]}
    out |= {f"k={k}": ["--policy", "fixed", "--k", str(k), "--drafter", "model"] for k in ks}
    out["cost"] = ["--policy", "cost", "--k", "8", "--drafter", "model"]
    out["cost, cold"] = [*out["cost"], "--no-remember-costs"]
    out["hybrid, cost"] = ["--policy", "cost", "--k", "8", "--drafter", "hybrid"]
    return out


def _in(tree: Path | None) -> dict:
    """subprocess options that run ``tree``'s specdeploy (from its own directory: ``python -m`` puts the working
    directory first on the path, ahead of PYTHONPATH), with a cost record of its own; none for this checkout."""
    if tree is None:
        return {}
    cache = Path(os.environ.get("SPECDEPLOY_CACHE", Path.home() / ".cache" / "specdeploy")) / "baseline"
    return {"cwd": tree, "env": {**os.environ, "PYTHONPATH": str(tree), "SPECDEPLOY_CACHE": str(cache)}}


def imported_from(tree: Path | None) -> Path:
    """The specdeploy package a run in ``tree`` (None: this checkout) imports."""
    done = subprocess.run([sys.executable, "-c", "import specdeploy; print(specdeploy.__file__)"], capture_output=True,
                          text=True, check=True, **_in(tree))
    return Path(done.stdout.strip()).resolve().parent


def run(artifact: Path, prompt: str, tokens: int, options: list[str], tree: Path | None = None) -> dict:
    """One fresh process (of the checkout ``tree``, with a cost record of its own, where given); its JSON line's stats."""
    command = [sys.executable, "-m", "specdeploy.cli", "generate", str(artifact), "--prompt", prompt, "--json",
               "--threads", "2", "--max-new-tokens", str(tokens), *options]
    done = subprocess.run(command, capture_output=True, text=True, **_in(tree))
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:6])} … failed:\n{done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    stats = row["stats"]
    return {"tokens": stats["tokens"], "seconds": stats["seconds"] + stats["prefill_s"],
            "mean_accepted_length": stats.get("mean_accepted_length"), "token_ids": row["token_ids"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts")
    parser.add_argument("--humaneval-from", type=int, default=8,
                        help="first HumanEval prompt (default 8: prompts the other benches did not tune on)")
    parser.add_argument("--specbench", type=int, default=1, help="Spec-Bench prompts per category group")
    parser.add_argument("--lengths", default="32,128", help="comma list of max new tokens")
    parser.add_argument("--ks", default="2,4", help="comma list of fixed K")
    parser.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                        help="run the cost policy without its remembered costs too ('cost, cold')")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of specdeploy (e.g. a git worktree of an earlier commit): its cost "
                             "configurations run beside this one's, interleaved, with a cost record of their own")
    parser.add_argument("--out", type=Path, default=None, help="write the runs as JSON")
    args = parser.parse_args()

    grid = configurations([int(k) for k in args.ks.split(",")])
    if not args.cold:
        del grid["cost, cold"]
    trees = {}
    if args.baseline is not None:
        if not (args.baseline / "specdeploy" / "__init__.py").is_file():
            raise SystemExit(f"--baseline: {args.baseline} is not a checkout of specdeploy (no specdeploy/__init__.py)")
        package = imported_from(args.baseline.resolve())
        if package != (args.baseline / "specdeploy").resolve():
            raise SystemExit(f"--baseline: a run there imports specdeploy from {package}, not from {args.baseline}")
        print(f"baseline: specdeploy from {package}", flush=True)
        for name in ("cost", "hybrid, cost"):
            grid[f"{name} @base"], trees[f"{name} @base"] = grid[name], args.baseline.resolve()
    prompts = workload(args.humaneval, args.specbench, args.humaneval_from)
    lengths = [int(n) for n in args.lengths.split(",")]
    for name in [n for n in grid if n.startswith(("cost", "hybrid, cost")) and n != "cost, cold"]:
        run(args.artifact, "def f(x):", 16, grid[name], trees.get(name))  # fills its record, as an earlier run would
    runs = []
    for index, ((group, prompt), tokens) in enumerate((p, n) for n in lengths for p in prompts):
        order = list(grid)[index % len(grid):] + list(grid)[: index % len(grid)]
        outputs = {}
        for name in order:
            result = run(args.artifact, prompt.text, tokens, grid[name], trees.get(name))
            outputs[name] = result.pop("token_ids")
            runs.append({"group": group, "prompt": prompt.id, "max_new_tokens": tokens, "config": name, **result})
            print(f"{group:24} {prompt.id:18} {tokens:4} {name:12} {result['tokens'] / result['seconds']:6.2f} tok/s",
                  flush=True)
        plain = outputs["plain"]
        same = sum(o == plain for o in outputs.values()) - 1
        print(f"{'':24} identical to plain: {same}/{len(outputs) - 1}", flush=True)
    summary = summarize(runs, grid, lengths)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


def summarize(runs: list[dict], grid: dict, lengths: list[int]) -> list[dict]:
    """Median tok/s per (group, length, configuration); the cost policy against plain and the best fixed K."""
    groups = sorted({r["group"] for r in runs}, key=lambda g: (g != "humaneval", g))
    header = (f"{'group':24} {'new':>4} " + " ".join(f"{name:>12}" for name in grid)
              + "  cost/plain  cost/best K  hybrid/plain  hybrid/best K")
    print("\nmedian tok/s (prefill + decoding) per prompt group\n" + header)
    summary = []
    for tokens in lengths:
        for group in [*groups, "all"]:
            rates = {}
            for name in grid:
                rows = [r for r in runs if r["config"] == name and r["max_new_tokens"] == tokens
                        and group in ("all", r["group"])]
                rates[name] = statistics.median(r["tokens"] / r["seconds"] for r in rows)
            best = max(v for n, v in rates.items() if n.startswith("k="))
            entry = {"group": group, "max_new_tokens": tokens, "tok_s": rates,
                     "cost_vs_plain": rates["cost"] / rates["plain"], "cost_vs_best_k": rates["cost"] / best,
                     "hybrid_vs_plain": rates["hybrid, cost"] / rates["plain"],
                     "hybrid_vs_best_k": rates["hybrid, cost"] / best}
            base = ""
            if "hybrid, cost @base" in rates:  # the baseline checkout's, against the same plain and fixed K runs
                entry |= {"base_cost_vs_plain": rates["cost @base"] / rates["plain"],
                          "base_hybrid_vs_plain": rates["hybrid, cost @base"] / rates["plain"],
                          "base_hybrid_vs_best_k": rates["hybrid, cost @base"] / best}
                base = (f"  base: cost/plain {entry['base_cost_vs_plain']:.2f} hybrid/plain "
                        f"{entry['base_hybrid_vs_plain']:.2f} hybrid/best K {entry['base_hybrid_vs_best_k']:.2f}")
            summary.append(entry)
            print(f"{group:24} {tokens:4} " + " ".join(f"{rates[n]:12.2f}" for n in grid)
                  + f"  {entry['cost_vs_plain']:10.2f}  {entry['cost_vs_best_k']:11.2f}"
                  + f"  {entry['hybrid_vs_plain']:12.2f}  {entry['hybrid_vs_best_k']:13.2f}" + base)
    return summary


if __name__ == "__main__":
    main()
