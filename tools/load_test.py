"""Load test of `specdeploy serve`: N concurrent streaming clients on loopback, per speculation mode.

For each mode (plain target decoding, the draft at fixed K, the cost policy; "hybrid": the cost
policy over the hybrid drafter, run when named) a server runs in this process on 127.0.0.1 with
continuous batching, all over the same engines, and first answers --warmup requests, unmeasured.
Then, for each of --rounds rounds and each concurrency N, the modes take turns (their order rotating
from round to round, so that a shared machine's drift hits all alike): N client threads (the
official openai client) each send --requests streamed completions one after another, HumanEval
prompts in turn. A mode's figures pool its rounds. Every mode is sent the same prompts in the same order, and each
stage the next ones not yet sent (they repeat only when a run needs more than the set has: it says so), and each
mode's clients present an API key of their own: the servers share one pipeline, whose prefix cache and suffix
index are scoped per key, so no mode reuses another's K/V or drafts from another's answer to the same prompt, and
no stage is timed on a prompt its server has already answered. The clients run in a process of their own, as they
would be deployed: threads of the server's process, they held the GIL the scheduler's thread waits
for between its engine calls (the cost policy's 45 us decision read 2.4 ms of wall time at 4 clients).
Reported per mode and N: throughput (completion tokens / wall time of the stage), time to first token
and inter-token latency (a request's decode time / its tokens - 1) at p50 and p99, and every request
accounted for (completed, or failed with its error). Bounded: --timeout per request, --max-tokens.
With the cost policy and plain or fixed K among the modes, a second table weighs the cost policy
against the better of the two at each N: pooled over the rounds, and round by round (each round's
stages ran back to back, so its ratio is the least touched by the machine's drift).

    python -m tools.load_test --artifact DIR [--concurrency 1,2,4,8] [--requests 2] [--rounds 2] [--max-tokens 64]
                              [--modes plain,fixed,cost] [--warmup 2] [--prompt-file FILE] [--out docs/results/load_test]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from tools.arguments import integer, integers, names, number, parser, prompt_file, refusing
from tools.provenance import header, provenance

MODES = {"plain": dict(drafter="none"), "fixed": dict(policy="fixed", drafter="model"),
         "cost": dict(policy="cost", drafter="model"), "hybrid": dict(policy="cost", drafter="hybrid")}  # hybrid: the default


def main() -> None:
    options = _parser()
    args = options.parse_args()

    from specdeploy import GenerationConfig, Pipeline
    from specdeploy.serve.scheduler import context_slots
    from specdeploy.workloads import humaneval, load_prompts

    prompts = [p.text for p in (load_prompts(args.prompt_file) if args.prompt_file else humaneval())]
    with refusing(options):  # an artifact that does not load, a context it cannot hold: one line, before any server
        pipeline = Pipeline.load(args.artifact, threads=args.threads)
        for mode in args.modes:
            context_slots(pipeline, args.context, GenerationConfig(k=args.k, **MODES[mode]).max_drafts)
    levels = args.concurrency
    repeated = repeats(len(prompts), levels, args)
    if repeated:
        print(f"note: {repeated} requests a mode sends repeat a prompt its server has answered (the set has "
              f"{len(prompts)}): their prefill is reused and they may draft from their own earlier answer", flush=True)
    stages = _run_stages(args, pipeline, prompts, levels, args.modes)
    rows = [_row(mode, n, runs) for (mode, n), runs in stages.items()]
    versus = _versus(rows, stages, levels)
    table = _table(rows, args) + ("\n\n" + _versus_table(versus) if versus else "")
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        pids = sorted({d["pid"] for runs in stages.values() for records, _ in runs for d in records})
        facts = provenance("tools.load_test")
        args.out.with_suffix(".json").write_text(json.dumps({"setup": facts, "rows": rows, "versus": versus,
                                                             "repeated_requests": repeated,
                                                             "server_pid": os.getpid(), "client_pids": pids}, indent=1))
        args.out.with_suffix(".md").write_text(header("specdeploy serve under load", facts) + "\n" + table + "\n")
        _plot(rows, args.out.with_suffix(".png"))


def _parser() -> argparse.ArgumentParser:
    options = parser(__doc__)
    # checked as it loads, after the other arguments: a bad --rounds is named whatever the artifact
    options.add_argument("--artifact", type=Path, required=True, help="The artifact the servers serve.")
    options.add_argument("--concurrency", type=integers(1), default="1,2,4,8",
                         help="Comma list of concurrent clients, a stage each.")
    options.add_argument("--requests", type=integer(1), default=2, help="Requests each client sends, one after another.")
    options.add_argument("--rounds", type=integer(1), default=2,
                         help="Times each (mode, concurrency) stage runs, the modes' order rotating between rounds.")
    options.add_argument("--max-tokens", type=integer(1), default=64, help="New tokens per request at most.")
    options.add_argument("--k", type=integer(0), default=4, help="Draft tokens per cycle (the fixed mode's K, the "
                         "cost policy's most).")
    options.add_argument("--modes", type=names(MODES), default="plain,fixed,cost",
                         help=f"Comma list of {', '.join(MODES)}.")
    options.add_argument("--context", type=integer(1), default=1024, help="Cache slots per request.")
    options.add_argument("--threads", type=integer(1), default=2, help="ONNX Runtime threads.")
    options.add_argument("--warmup", type=integer(0), default=2,
                         help="Requests each server answers before it is measured (ONNX Runtime's first calls, the "
                              "policy's first estimates), from the end of the prompt set; 0: one 8-token request.")
    options.add_argument("--timeout", type=number(0.001), default=600.0, help="Seconds a request may take at most.")
    options.add_argument("--prompt-file", type=prompt_file, default=None, help="Prompts to send instead of HumanEval's.")
    options.add_argument("--out", type=Path, default=None, help="Write OUT.json, OUT.md and OUT.png.")
    return options


def _run_stages(args: argparse.Namespace, pipeline, prompts: list[str], levels: list[int],
                modes: list[str]) -> dict[tuple[str, int], list]:
    """One warmed-up server per mode, then every round's stages: (mode, N) -> each round's (requests, seconds)."""
    from specdeploy import GenerationConfig

    stages = {(mode, n): [] for mode in modes for n in levels}
    with contextlib.ExitStack() as servers:
        # spawned, not forked: a fork of a process running ONNX Runtime's and uvicorn's threads may inherit held locks
        clients = servers.enter_context(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
        urls = {}
        for mode in modes:
            config = GenerationConfig(k=args.k, **MODES[mode])
            urls[mode] = url = servers.enter_context(_server(pipeline, config, args.context, max(levels)))
            warm = _client(url, args.timeout, mode)
            for prompt in prompts[-max(args.warmup, 1):]:  # not measured: a long-running server's state, not its start
                warm.completions.create(model="m", prompt=prompt, max_tokens=args.max_tokens if args.warmup else 8,
                                        temperature=0)
        sent = 0  # prompts each mode has been sent so far: every stage takes the next ones, the same for every mode
        for round_ in range(args.rounds):
            for n in levels:
                batch = [prompts[(sent + i) % len(prompts)] for i in range(n * args.requests)]
                for mode in modes[round_ % len(modes):] + modes[: round_ % len(modes)]:
                    stages[mode, n].append(clients.submit(_stage, urls[mode], mode, batch, n, args).result())
                    print(f"round {round_ + 1}/{args.rounds} " + _line(_row(mode, n, stages[mode, n][-1:])), flush=True)
                sent += len(batch)
    return stages


def repeats(prompts: int, levels: list[int], args: argparse.Namespace) -> int:
    """Requests a mode sends beyond the prompts the set has, the warm-up's included: each repeats a prompt its server
    has answered (its prefix cache and suffix index have seen it)."""
    return max(0, args.rounds * sum(levels) * args.requests + max(args.warmup, 1) - prompts)


def _server(pipeline, config, context: int, max_batch: int):
    from specdeploy.serve.app import create_app
    from specdeploy.serve.background import serve_in_thread
    from specdeploy.serve.scheduler import Scheduler

    @contextlib.contextmanager
    def running():
        scheduler = Scheduler(pipeline, config, context, max_batch=max_batch, max_queue=4 * max_batch)
        scheduler.start()
        try:
            with serve_in_thread(create_app(pipeline, scheduler, "m")) as url:
                yield url
        finally:
            scheduler.stop()

    return running()


def _client(url: str, timeout: float, mode: str):
    from openai import OpenAI

    # a key per mode: the server (no --api-key) checks none, but scopes its prefix cache and suffix index by it
    return OpenAI(base_url=f"{url}/v1", api_key=f"load-test-{mode}", max_retries=0, timeout=timeout)


def _stage(url: str, mode: str, prompts: list[str], clients: int, args) -> tuple[list[dict], float]:
    """``clients`` threads, each sending ``args.requests`` streamed requests in turn, client c prompts c * requests
    onwards: each request's record, and the stage's wall time."""
    done, lock = [], threading.Lock()

    def client(c: int):
        api = _client(url, args.timeout, mode)
        for r in range(args.requests):
            prompt = prompts[c * args.requests + r]
            began, first, tokens, error, speculative, cached = time.perf_counter(), None, 0, "", {}, 0
            try:
                stream = api.completions.create(model="m", prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and first is None:
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                        details = chunk.usage.prompt_tokens_details
                        cached = (details.cached_tokens or 0) if details is not None else 0
                    speculative = (chunk.model_extra or {}).get("speculative") or speculative  # on the final chunk
            except Exception as exc:  # counted, with its message: every request is accounted for
                error = f"{type(exc).__name__}: {exc}"
            ended = time.perf_counter()
            with lock:
                done.append({"began": began, "first": first, "ended": ended, "tokens": tokens, "error": error, "pid": os.getpid(),
                             "cached": cached,
                             "drafted": speculative.get("drafted_tokens", 0), "cycles": speculative.get("cycles", 0)})

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done, time.perf_counter() - began


def _row(mode: str, clients: int, runs: list[tuple[list[dict], float]]) -> dict:
    """A mode's figures at one concurrency, pooled over its runs: throughput is all tokens over all wall time."""
    done = [d for records, _ in runs for d in records]
    wall = sum(seconds for _, seconds in runs)
    ok = [d for d in done if not d["error"] and d["first"] is not None]
    tokens = sum(d["tokens"] for d in ok)
    ttft = [d["first"] - d["began"] for d in ok]
    itl = [(d["ended"] - d["first"]) / (d["tokens"] - 1) for d in ok if d["tokens"] > 1]
    return {"mode": mode, "concurrency": clients, "rounds": len(runs), "requests": len(done), "completed": len(ok),
            "errors": sorted({d["error"] for d in done if d["error"]}),
            "tokens": tokens, "seconds": wall,
            # what speculation did: drafts proposed, and tokens per target call (1.0: decoded plainly)
            "drafted": sum(d["drafted"] for d in ok), "tokens_per_cycle": _ratio(tokens, sum(d["cycles"] for d in ok)),
            "cached_prompt_tokens": sum(d["cached"] for d in ok),  # reused from the prefix cache: a repeated prompt's
            "throughput": tokens / wall,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99)}


def _versus(rows: list[dict], stages: dict, levels: list[int]) -> list[dict]:
    """The cost policy against the better of plain and fixed K at each concurrency: pooled (each mode's tokens over
    its wall time, as the main table) and per round; empty unless the cost policy and one of them ran."""
    rivals = [mode for mode in ("plain", "fixed") if (mode, levels[0]) in stages]
    if ("cost", levels[0]) not in stages or not rivals:
        return []
    out = []
    for n in levels:
        pooled = {r["mode"]: r["throughput"] for r in rows if r["concurrency"] == n}
        best = max(rivals, key=pooled.get)
        per_round = {mode: [_row(mode, n, [run])["throughput"] for run in stages[mode, n]] for mode in ("cost", *rivals)}
        rounds = [cost / max(per_round[m][i] for m in rivals) for i, cost in enumerate(per_round["cost"])]
        out.append({"concurrency": n, "best": best, "pooled": pooled["cost"] / pooled[best], "rounds": rounds,
                    "rounds_at_least": sum(r >= 1.0 for r in rounds)})
    return out


def _versus_table(versus: list[dict]) -> str:
    lines = ["The cost policy's tok/s over the better rival's at each concurrency (plain or fixed K, by pooled tok/s)", "",
             "| clients | better | pooled | per round | median | rounds >= 1 |", "|---|---|---|---|---|---|"]
    for v in versus:
        lines.append(f"| {v['concurrency']} | {v['best']} | {v['pooled']:.3f} | "
                     f"{' / '.join(f'{r:.2f}' for r in v['rounds'])} | {float(np.median(v['rounds'])):.3f} | "
                     f"{v['rounds_at_least']}/{len(v['rounds'])} |")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def _line(row: dict) -> str:
    return (f"{row['mode']:>5} N={row['concurrency']}: {row['throughput']:6.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f} s "
            f"p99 {row['ttft_p99']:.2f} s, ITL p50 {1e3 * row['itl_p50']:.0f} ms p99 {1e3 * row['itl_p99']:.0f} ms, "
            f"{row['drafted']} drafts, {row['tokens_per_cycle']:.2f} tokens a cycle, "
            f"{row['completed']}/{row['requests']} completed" + (f", errors: {row['errors']}" if row["errors"] else ""))


def _table(rows: list[dict], args) -> str:
    lines = [f"{args.requests} streamed requests per client and round, {args.rounds} rounds (the modes' order rotating), "
             f"after {args.warmup} unmeasured, {args.max_tokens} new tokens "
             f"at most, greedy, K = {args.k}, "
             f"{args.prompt_file or 'HumanEval'} prompts, server and clients on one machine (loopback)", "",
             "| mode | clients | tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | drafts a request | tokens a cycle "
             "| prompt tokens reused | completed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['throughput']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} "
                     f"| {1e3 * r['itl_p50']:.0f} / {1e3 * r['itl_p99']:.0f} | {_ratio(r['drafted'], r['completed']):.1f} "
                     f"| {r['tokens_per_cycle']:.2f} | {r['cached_prompt_tokens']} | {r['completed']}/{r['requests']} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        n = [r["concurrency"] for r in mine]
        left.plot(n, [r["throughput"] for r in mine], marker="o", label=mode)
        right.plot(n, [1e3 * r["itl_p99"] for r in mine], marker="o", label=mode)
    left.set(xlabel="concurrent clients", ylabel="tokens/s (all clients)", title="Throughput")
    right.set(xlabel="concurrent clients", ylabel="ms", title="Inter-token latency, p99")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
