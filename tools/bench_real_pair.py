"""Qwen2.5-Coder 0.5B drafting for 1.5B: every configuration against plain target decoding.

Greedy, 128 new tokens, on HumanEval prompts and Spec-Bench first turns (a sample per category).
Configurations run round-robin per prompt in one process (machine drift hits all alike):
plain target decoding, the draft model at K in {1, 2, 3, 4, 6, 8}, the cost-model policy and
prompt lookup. Reports tokens/s, speedup, mean accepted length, acceptance by position, where
the time goes, and identical-output counts; a prompt whose output differs from plain decoding
is checked for a near-tie within the engine's measured 1-token vs K+1-token logits gap.
Optionally the peer: transformers' assisted generation with the same pair on this CPU.

    python tools/bench_real_pair.py --artifact DIR [--humaneval 8] [--specbench 1] [--peer 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "workloads" / "spec_bench_question.jsonl"
GROUPS = {"translation", "summarization", "qa", "math_reasoning", "rag"}  # the rest is MT-bench


def configs(ks):
    from specdeploy import GenerationConfig

    base = dict(max_new_tokens=128, temperature=0.0)
    out = {"plain": GenerationConfig(drafter="none", **base)}
    for k in ks:
        out[f"model k={k}"] = GenerationConfig(k=k, **base)
    out["model cost k<=8"] = GenerationConfig(k=8, policy="cost", **base)
    out["prompt-lookup k=4"] = GenerationConfig(k=4, drafter="prompt-lookup", **base)
    return out


def workload(humaneval_n: int, specbench_n: int):
    from specdeploy.workloads import humaneval, load_prompts

    prompts = [("humaneval", p) for p in humaneval()[:humaneval_n]]
    if specbench_n and SPEC_BENCH.is_file():
        taken = {}
        for p in load_prompts(SPEC_BENCH):
            group = p.category if p.category in GROUPS else "mt_bench"
            if taken.get(group, 0) < specbench_n:
                taken[group] = taken.get(group, 0) + 1
                prompts.append((f"spec_bench/{group}", p))
    return prompts


def logits_gap(pipeline, ids: np.ndarray, k: int = 4) -> float:
    """max |logits| difference between k + 1 single-token calls and one (k + 1)-token call, same positions."""
    engine = pipeline.target
    n = len(ids)
    cache = engine.allocate_cache(1, n + 1)
    engine_out = engine.infer(ids[None, : n - k - 1], np.zeros(1, np.int64), cache)
    for buf, new in zip(cache, engine_out.new_kv):
        buf[:, :, : n - k - 1] = new
    single = []
    for j in range(n - k - 1, n):
        out = engine.infer(ids[None, j : j + 1], np.array([j]), cache)
        for buf, new in zip(cache, out.new_kv):
            buf[:, :, j : j + 1] = new
        single.append(out.logits[0, 0].copy())  # the engine reuses its output buffers
    multi = engine.infer(ids[None, n - k - 1 :], np.array([n - k - 1]), cache).logits[0]
    return float(np.abs(np.stack(single) - multi).max())


def near_tie(pipeline, prompt_ids, plain_ids, other_ids) -> tuple[int, float]:
    """First differing position and the target's top-2 logit margin there (plain decoding's context)."""
    first = next(i for i, (a, b) in enumerate(zip(plain_ids, other_ids)) if a != b)
    ids = np.concatenate([prompt_ids, plain_ids[:first]]).astype(np.int64)
    engine = pipeline.target
    out = engine.infer(ids[None], np.zeros(1, np.int64), engine.allocate_cache(1, len(ids)))
    top = np.sort(out.logits[0, -1])[-2:]
    return first, float(top[1] - top[0])


def peer(target_gguf: Path, draft_gguf: Path, prompts, max_new_tokens: int) -> dict:
    """transformers' assisted generation (assistant_model=) with the same pair, fp32 on this CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    load = dict(dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(target_gguf.parent, gguf_file=target_gguf.name)
    target = AutoModelForCausalLM.from_pretrained(target_gguf.parent, gguf_file=target_gguf.name, **load).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_gguf.parent, gguf_file=draft_gguf.name, **load).eval()
    result = {"plain": [0, 0.0], "assisted": [0, 0.0], "identical": 0}
    for _, p in prompts:
        ids = tok(p.text, return_tensors="pt").input_ids
        outs = {}
        for name, extra in (("plain", {}), ("assisted", {"assistant_model": draft})):
            began = time.perf_counter()
            with torch.no_grad():
                out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
            result[name][1] += time.perf_counter() - began
            result[name][0] += out.shape[1] - ids.shape[1]
            outs[name] = out[0, ids.shape[1] :].tolist()
        result["identical"] += outs["plain"] == outs["assisted"]
    return {name: (tokens / seconds if seconds else 0.0) for name, (tokens, seconds) in
            ((n, result[n]) for n in ("plain", "assisted"))} | {"identical": result["identical"], "prompts": len(prompts)}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from specdeploy import Pipeline
    from specdeploy.runtime.telemetry import acceptance_by_position, mean_accepted_length, time_split

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts (first N)")
    parser.add_argument("--specbench", type=int, default=1, help="Spec-Bench prompts per category group")
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    parser.add_argument("--peer", type=int, default=0, help="prompts for transformers' assisted generation (slow)")
    parser.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "specdeploy")
    parser.add_argument("--out", type=Path, default=None, help="write the per-prompt results as JSON")
    args = parser.parse_args()
    console = Console()

    pipeline = Pipeline.load(args.artifact, threads=2)
    grid = configs([int(k) for k in args.ks.split(",")])
    prompts = workload(args.humaneval, args.specbench)
    for config in grid.values():  # warm-up: the first calls of a session allocate
        pipeline.generate(["def f(x):"], type(config)(**{**config.__dict__, "max_new_tokens": 8}))
    runs = {name: [] for name in grid}
    for index, (group, prompt) in enumerate(prompts):
        order = list(grid)[index % len(grid):] + list(grid)[: index % len(grid)]  # rotate who goes first
        for name in order:
            result = pipeline.generate([prompt.text], grid[name])[0]
            runs[name].append((group, prompt, result))
        console.print(f"[{index + 1}/{len(prompts)}] {group} {prompt.id}: "
                      f"plain {runs['plain'][-1][2].stats['tokens_per_s']:.1f} tok/s", highlight=False)

    gap = max(logits_gap(pipeline, np.concatenate([pipeline.encode(p.text), np.array(r.token_ids)]).astype(np.int64))
              for _, p, r in runs["plain"][:4])
    groups = sorted({g for g, _ in prompts}, key=lambda g: (g != "humaneval", g))
    report = {"logits_gap_1_vs_5": gap, "groups": {}}
    for group in groups:
        table = Table("configuration", "tok/s", "speedup", "mean acc. len", "acceptance by position",
                      "draft/verify/accept/cache s", "identical", "near-ties", title=f"{group} (greedy, 128 tokens)")
        plain = [r for g, _, r in runs["plain"] if g == group]
        plain_rate = sum(r.stats["tokens"] for r in plain) / sum(r.stats["seconds"] for r in plain)
        report["groups"][group] = {}
        for name in grid:
            rows = [(p, r) for g, p, r in runs[name] if g == group]
            results = [r for _, r in rows]
            rate = sum(r.stats["tokens"] for r in results) / sum(r.stats["seconds"] for r in results)
            records = [rec for r in results for rec in r.records]
            split = time_split(records)
            identical, ties = 0, []
            for (p, r), base in zip(rows, plain):
                if r.token_ids == base.token_ids:
                    identical += 1
                else:
                    position, margin = near_tie(pipeline, pipeline.encode(p.text), base.token_ids, r.token_ids)
                    ties.append({"prompt": p.id, "position": position, "top2_margin": margin, "within_gap": margin <= gap})
            by_pos = acceptance_by_position(records)
            report["groups"][group][name] = {
                "tokens_per_s": rate, "speedup": rate / plain_rate, "mean_accepted_length": mean_accepted_length(records),
                "acceptance_by_position": by_pos, "time_split": split, "identical": identical, "prompts": len(rows),
                "differing": ties,
            }
            table.add_row(name, f"{rate:.2f}", f"{rate / plain_rate:.2f}x", f"{mean_accepted_length(records):.2f}",
                          " ".join(f"{a:.2f}" for a in by_pos) or "-",
                          "/".join(f"{split[k]:.0f}" for k in ("draft", "verify", "accept", "cache")),
                          f"{identical}/{len(rows)}", f"{sum(t['within_gap'] for t in ties)}/{len(ties)}")
        console.print(table)
    console.print(f"engine logits gap, 5 single-token calls vs one 5-token call: max {gap:.4f}")
    if args.peer:
        peer_result = peer(args.gguf_dir / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                           args.gguf_dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                           [x for x in prompts if x[0] == "humaneval"][: args.peer], 128)
        report["peer_transformers_assisted"] = peer_result
        console.print(f"transformers (fp32, torch CPU) on {peer_result['prompts']} HumanEval prompts: plain "
                      f"{peer_result['plain']:.2f} tok/s, assisted {peer_result['assisted']:.2f} tok/s, identical "
                      f"{peer_result['identical']}/{peer_result['prompts']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
