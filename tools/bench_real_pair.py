"""Qwen2.5-Coder 0.5B drafting for 1.5B: every configuration against plain target decoding.

Greedy, 128 new tokens, on HumanEval prompts and Spec-Bench first turns (a sample per category).
Configurations run round-robin per prompt in one process (machine drift hits all alike):
plain target decoding, the draft model at K in {1, 2, 3, 4, 6, 8}, the cost-model policy,
prompt lookup and the hybrid drafter (lookup where it matches, the model elsewhere; fixed K = 4
and the cost policy). Reports
tokens/s, speedup, mean accepted length, acceptance by position, where the time goes, and
identical-output counts.

Exactness: the target's logits are recorded for every generated position in every run. Where a
run's output differs from plain decoding, at the first differing position both runs saw the same
tokens, so only the engine's arithmetic differs (verification computes tokens K + 1 at a time, and
their K/V then feed later tokens). The report checks there that each run emitted its own argmax (a
failure is an acceptance bug) and compares the plain run's margin between the two tokens with the
gap measured at the positions before any divergence, over all prompts and configurations: the
largest change verification made to the difference of two leading logits (each run's top 5
tokens). A flip needs a margin below that change; a margin above the measured gap would be a bug.
Optionally the peer: transformers' assisted generation with the same pair on this CPU.

Several artifacts (e.g. the explicit and the fused graph form, int8 and int4 targets) run side by side:
every configuration of every artifact round-robin per prompt, and first one call of each model at
T = 1 / 5 / 9 new tokens after a past of 256 (interleaved), the per-call cost the tok/s come from.
Each artifact's runs are checked against its own plain decoding; plain decoding of each against the
first artifact's is reported too (a different graph or weight format computes other roundings).

    python tools/bench_real_pair.py --artifact DIR [--artifact DIR2 ...] [--humaneval 8] [--specbench 1]
        [--ks 1,2,3,4,6,8] [--peer 2] [--out FILE]
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
    out["hybrid k=4"] = GenerationConfig(k=4, drafter="hybrid", **base)
    out["hybrid cost k<=8"] = GenerationConfig(k=8, policy="cost", drafter="hybrid", **base)
    return out


def workload(humaneval_n: int, specbench_n: int, humaneval_from: int = 0):
    """(group, prompt): ``humaneval_n`` HumanEval prompts from HumanEval/``humaneval_from``, then ``specbench_n``
    Spec-Bench prompts per category group."""
    from specdeploy.workloads import humaneval, load_prompts

    prompts = [("humaneval", p) for p in humaneval()[humaneval_from : humaneval_from + humaneval_n]]
    if specbench_n and SPEC_BENCH.is_file():
        taken = {}
        for p in load_prompts(SPEC_BENCH):
            group = p.category if p.category in GROUPS else "mt_bench"
            if taken.get(group, 0) < specbench_n:
                taken[group] = taken.get(group, 0) + 1
                prompts.append((f"spec_bench/{group}", p))
    return prompts


class LogitsRecorder:
    """Wraps the target engine and keeps, per sequence position, the logits of the last call that predicted it.

    A verification call's later positions follow rejected drafts; the next cycle predicts them again
    from the committed tokens, so the last write for a position is the one its output came from.
    Batch 1 only; positions before ``first`` (the prompt) are not kept.
    """

    def __init__(self, engine):
        self.engine, self.first, self.logits = engine, 0, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start(self, first: int) -> dict:
        self.first, self.logits = first, {}
        return self.logits

    def infer(self, input_ids, past_len, cache, last=None):
        out = self.engine.infer(input_ids, past_len, cache)  # every position's logits, whatever the caller needs
        predicted = int(past_len[0]) + 1  # logits[0, j] predict position past_len + j + 1
        for j in range(max(0, self.first - predicted), input_ids.shape[1]):
            self.logits[predicted + j] = out.logits[0, j].copy()
        return out


def leading_shift(plain: np.ndarray, other: np.ndarray, leading: int = 5) -> float:
    """The largest change between two runs in the difference of two logits among the leading candidates.

    Candidates: each run's top ``leading`` tokens. A flip of the emitted token swaps two of them, so it
    needs a margin below this; far-down logits move more but never decide a greedy token.
    """
    candidates = np.union1d(np.argpartition(plain, -leading)[-leading:], np.argpartition(other, -leading)[-leading:])
    return float(np.ptp(other[candidates] - plain[candidates]))


def compare(first: int, plain: tuple[list[int], dict], other: tuple[list[int], dict]) -> dict:
    """Where ``other``'s output leaves plain decoding's, and the logits gap at the positions before that."""
    (plain_ids, plain_logits), (other_ids, other_logits) = plain, other
    differ = next((i for i, (a, b) in enumerate(zip(plain_ids, other_ids)) if a != b), None)
    same_context = range(first, first + (min(len(plain_ids), len(other_ids)) if differ is None else differ))
    spreads = [leading_shift(plain_logits[q], other_logits[q]) for q in same_context]
    result = {"gap_before": max(spreads, default=0.0), "positions_compared": len(spreads)}
    if differ is not None:
        q, a, b = first + differ, plain_ids[differ], other_ids[differ]
        plain_at, other_at = plain_logits[q], other_logits[q]
        result.update(position=differ, plain_token=a, other_token=b,
                      margin=float(plain_at[a] - plain_at[b]),  # how far plain preferred its token
                      shift=leading_shift(plain_at, other_at),  # how far verification moved them apart there
                      own_argmax=bool(plain_at.argmax() == a and other_at.argmax() == b))
    return result


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


def per_call(engines: dict, token_counts=(1, 5, 9), rounds: int = 10, capacity: int = 512) -> dict:
    """Median seconds of one call of each engine at each token count, after a past of capacity / 2 (the cache a
    HumanEval request plans), every engine and count interleaved round by round."""
    rng = np.random.default_rng(0)
    caches, inputs, times = {}, {}, {}
    for label, engine in engines.items():
        caches[label] = engine.allocate_cache(1, capacity)
        for buf in caches[label]:
            buf[:] = rng.normal(0, 1, buf.shape)
        inputs[label] = {t: rng.integers(0, engine.spec.vocab_size, (1, t)) for t in token_counts}
        times[label] = {t: [] for t in token_counts}
    past = np.array([capacity // 2], np.int64)
    for warm in (True,) + (False,) * rounds:
        for label, engine in engines.items():
            for t in token_counts:
                began = time.perf_counter()
                engine.infer(inputs[label][t], past, caches[label])
                if not warm:
                    times[label][t].append(time.perf_counter() - began)
    return {label: {t: float(np.median(v)) for t, v in counts.items()} for label, counts in times.items()}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from specdeploy import Pipeline
    from specdeploy.runtime.telemetry import acceptance_by_position, mean_accepted_length, time_split

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, action="append", required=True,
                        help="an artifact of the pair; repeat to run several side by side")
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts (first N)")
    parser.add_argument("--specbench", type=int, default=1, help="Spec-Bench prompts per category group")
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    parser.add_argument("--groups", default="", help="comma list of prompt groups to keep (humaneval, "
                        "spec_bench/rag, ...); default all")
    parser.add_argument("--peer", type=int, default=0, help="prompts for transformers' assisted generation (slow)")
    parser.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "specdeploy")
    parser.add_argument("--out", type=Path, default=None, help="write the per-prompt results as JSON")
    args = parser.parse_args()
    console = Console()

    labels = [a.name if [b.name for b in args.artifact].count(a.name) == 1 else f"{i}:{a.name}"
              for i, a in enumerate(args.artifact)]
    pipelines, recorders = {}, {}
    for label, artifact in zip(labels, args.artifact):
        pipelines[label] = Pipeline.load(artifact, threads=2)
        recorders[label] = pipelines[label].target = LogitsRecorder(pipelines[label].target)
    several = len(labels) > 1
    grid = {}  # name -> (artifact label, config)
    for label in labels:
        for name, config in configs([int(k) for k in args.ks.split(",")]).items():
            grid[f"{label} | {name}" if several else name] = (label, config)
    plain_of = {label: f"{label} | plain" if several else "plain" for label in labels}
    weights = {label: (p.manifest.target.weights, p.manifest.target.dtype) for label, p in pipelines.items()}
    # an artifact with the same target weights as an earlier one (the other graph form): plain decoding of
    # the two differs only in arithmetic, so each divergence must be a near-tie as well
    twins = {label: next(o for o in labels if weights[o] == weights[label]) for label in labels}
    twins = {label: twin for label, twin in twins.items() if twin != label}
    prompts = workload(args.humaneval, args.specbench)
    if args.groups:
        prompts = [(g, p) for g, p in prompts if g in args.groups.split(",")]
    for label, config in grid.values():  # warm-up: the first calls of a session allocate
        pipelines[label].generate(["def f(x):"], type(config)(**{**config.__dict__, "max_new_tokens": 8}))
    engines = {f"{label} {role} {p.manifest.models[role].weights}/{p.manifest.models[role].graph}": engine
               for label, p in pipelines.items() for role, engine in (("target", recorders[label].engine),
                                                                     ("draft", p.draft)) if engine is not None}
    calls = per_call(engines)
    table = Table("model", *(f"T = {t} ms" for t in (1, 5, 9)), "T = 5 / T = 1", "T = 9 / T = 1",
                  title="one call, batch 1, past 256 of 512 slots (median of 10, interleaved)")
    for label, medians in calls.items():
        table.add_row(label, *(f"{medians[t] * 1e3:.1f}" for t in (1, 5, 9)),
                      f"{medians[5] / medians[1]:.2f}", f"{medians[9] / medians[1]:.2f}")
    console.print(table)
    runs = {name: [] for name in grid}
    exactness = {}  # (configuration, prompt id) -> compare()
    for index, (group, prompt) in enumerate(prompts):
        order = list(grid)[index % len(grid):] + list(grid)[: index % len(grid)]  # rotate who goes first
        first = len(pipelines[labels[0]].encode(prompt.text))
        logits = {}
        for name in order:
            label, config = grid[name]
            logits[name] = recorders[label].start(first)
            result = pipelines[label].generate([prompt.text], config)[0]
            runs[name].append((group, prompt, result))
        for name, (label, _) in grid.items():  # compare now: the recorded logits of this prompt are dropped after it
            plain = runs[plain_of[label]][-1][2]
            result = runs[name][-1][2]
            exactness[name, prompt.id] = compare(first, (plain.token_ids, logits[plain_of[label]]),
                                                 (result.token_ids, logits[name]))
        for label, twin in twins.items():
            ours, theirs = runs[plain_of[label]][-1][2], runs[plain_of[twin]][-1][2]
            exactness[f"{plain_of[label]} vs {twin}", prompt.id] = compare(
                first, (theirs.token_ids, logits[plain_of[twin]]), (ours.token_ids, logits[plain_of[label]]))
        rates = ", ".join(f"{label} {runs[plain_of[label]][-1][2].stats['tokens_per_s']:.1f}" for label in labels)
        console.print(f"[{index + 1}/{len(prompts)}] {group} {prompt.id}: plain tok/s {rates}", highlight=False)

    gap = max(c["gap_before"] for c in exactness.values())
    compared = sum(c["positions_compared"] for c in exactness.values())
    groups = sorted({g for g, _ in prompts}, key=lambda g: (g != "humaneval", g))
    report = {"measured_gap": gap, "positions_compared": compared, "per_call_s": calls, "groups": {}, "forms": {}}
    for label, twin in twins.items():
        checked = [(p, exactness[f"{plain_of[label]} vs {twin}", p.id]) for _, p in prompts]
        report["forms"][f"{label} vs {twin}"] = {
            "identical": sum("position" not in c for _, c in checked), "prompts": len(checked),
            "differing": [{"prompt": p.id, **c, "within_gap": c["margin"] <= gap} for p, c in checked if "position" in c]}

    def rate_of(name: str, group: str) -> float:
        results = [r for g, _, r in runs[name] if g == group]
        return sum(r.stats["tokens"] for r in results) / sum(r.stats["seconds"] for r in results)

    for group in groups:
        versus = [f"vs {labels[0]} plain"] if several else []
        table = Table("configuration", "tok/s", "speedup", *versus, "mean acc. len", "acceptance by position",
                      "draft/verify/accept/cache s", "identical", "near-ties", title=f"{group} (greedy, 128 tokens)")
        report["groups"][group] = {}
        for name, (label, _) in grid.items():
            plain_rate, first_rate = rate_of(plain_of[label], group), rate_of(plain_of[labels[0]], group)
            rows = [(p, r) for g, p, r in runs[name] if g == group]
            results = [r for _, r in rows]
            rate = rate_of(name, group)
            records = [rec for r in results for rec in r.records]
            split = time_split(records)
            checked = [(p, exactness[name, p.id]) for p, _ in rows]
            differing = [{"prompt": p.id, **c, "within_gap": c["margin"] <= gap} for p, c in checked if "position" in c]
            identical = len(rows) - len(differing)
            by_pos = acceptance_by_position(records)
            report["groups"][group][name] = {
                "tokens_per_s": rate, "speedup": rate / plain_rate, "mean_accepted_length": mean_accepted_length(records),
                "acceptance_by_position": by_pos, "time_split": split, "identical": identical, "prompts": len(rows),
                "differing": differing,
            }
            table.add_row(name, f"{rate:.2f}", f"{rate / plain_rate:.2f}x", *([f"{rate / first_rate:.2f}x"] if several else []),
                          f"{mean_accepted_length(records):.2f}",
                          " ".join("-" if np.isnan(a) else f"{a:.2f}" for a in by_pos) or "-",
                          "/".join(f"{split[k]:.0f}" for k in ("draft", "verify", "accept", "cache")),
                          f"{identical}/{len(rows)}",
                          f"{sum(d['within_gap'] and d['own_argmax'] for d in differing)}/{len(differing)}")
        console.print(table)
    differing = [d for g in report["groups"].values() for c in g.values() for d in c["differing"]]
    differing += [d for c in report["forms"].values() for d in c["differing"]]
    bugs = [d for d in differing if not d["own_argmax"] or not d["within_gap"]]
    console.print(f"measured gap (largest change verification made to a difference of two leading logits, over {compared} "
                  f"positions with the same tokens in both runs): {gap:.3f}")
    console.print(f"differing outputs: {len(differing)}; first divergence a near-tie within the gap and each run "
                  f"emitting its own argmax: {len(differing) - len(bugs)}; otherwise: {len(bugs)}")
    for d in bugs:
        console.print(f"  not explained: {d}", highlight=False)
    for pair, c in report["forms"].items():
        console.print(f"plain decoding, {pair} (same weights, another graph form): identical {c['identical']}/{c['prompts']}; "
                      f"divergences near-ties, own argmax: {sum(d['within_gap'] and d['own_argmax'] for d in c['differing'])}/"
                      f"{len(c['differing'])}")
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
