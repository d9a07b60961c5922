"""Routing by scope against Ray's default router: tenants' multi-turn conversations through replicas on two Ray nodes.

A Ray cluster of two nodes is started on this machine, each its own processes (``tools/ray_cluster.py``: `ray start
--head`, `ray start --address=...`), and the artifact deployed on it once per setup:

- ``scope``: two replicas, one a node, requests routed by scope (``specdeploy.serve.ray_router.ScopeRouter``);
- ``default``: the same two replicas under Ray's default router (the less busy of two at random). Its proxy prefers
  replicas on its own node unless told not to (``RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING``): with one proxy, as
  here, that fills the head's replica first, where clients behind a load balancer over a proxy a node (Ray's default
  ``EveryNode``) meet a random node's proxy; so the cluster is told not to, unless --prefer-local-node;
- ``one``: a single replica, which holds every conversation (the reference for what reuse can reach).

Each setup starts on fresh replicas (empty prefix caches and suffix indexes) and runs the same workload: --tenants
tenants at once, each with an API key of its own (its scope) and one of the shipped 3-turn code-edit conversations
(``specdeploy.workloads.conversations``), its turns sent one after another as chat completions (greedy, at most
--max-tokens new tokens). Reported per setup, pooled over --rounds (setups rotating their order from round to round):
the prefix cache's hit rate (prompt tokens whose K/V a replica reused, ``usage.prompt_tokens_details.cached_tokens``,
over all prompt tokens, and over the later turns' alone), drafted tokens accepted per request (the responses'
``speculative`` blocks), completion tokens per second (all of a setup's completion tokens over its wall time), and
every request accounted for. Goals (issue 71): scope's hit rate at least
90 % of one replica's, and its tok/s at least 1.2x the default router's.

    python -m tools.bench_ray_routing --artifact DIR [--setups scope,default,one] [--rounds 1] [--tenants 8]
        [--max-tokens 64] [--threads 1] [--max-batch 8] [--context 1024] [--prefer-local-node]
        [--out docs/results/ray/routing]
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

from tools import arguments
from tools.provenance import provenance, write_page
from tools.ray_cluster import LocalCluster
from tools.ray_load import MODEL, free_port, placement, replica_options

SETUPS = ("scope", "default", "one")


def main(argv: list[str] | None = None) -> int:
    parser = arguments.parser(__doc__)
    replica_options(parser, context=1024)
    parser.add_argument("--setups", type=arguments.names(SETUPS), default=list(SETUPS), help="comma list, in order")
    parser.add_argument("--rounds", type=arguments.integer(1), default=1, help="rounds of every setup")
    parser.add_argument("--tenants", type=arguments.integer(1, 8), default=8, help="conversations at once (<= 8)")
    parser.add_argument("--max-tokens", type=arguments.integer(1), default=64, help="new tokens a turn at most")
    parser.add_argument("--max-batch", type=arguments.integer(1), default=8, help="--max-num-seqs of a replica")
    parser.add_argument("--prefer-local-node", action="store_true",
                        help="let Ray's default router prefer the replicas on its proxy's node (Ray's default)")
    args = parser.parse_args(argv)
    facts = provenance("tools.bench_ray_routing")
    runs = run(args)
    table = report(runs)
    print(table)
    if args.out is not None:
        write_page(args.out, "Ray Serve: routing by scope", facts, table, {"runs": runs})
    return 0


def run(args) -> list[dict]:
    """One record per (round, setup): its requests' usage and speculation, and its wall time."""
    from specdeploy.workloads import conversations

    turns = conversations()
    chats = [[p for p in turns if p.id.startswith(f"{name}/")] for name in dict.fromkeys(p.id.rsplit("/", 1)[0]
                                                                                            for p in turns)]
    chats = chats[: args.tenants]
    root = Path(tempfile.mkdtemp(prefix="sdray-", dir="/tmp"))  # short: Ray's socket paths live under it
    local_first = "1" if args.prefer_local_node else "0"
    with LocalCluster(root, cpus=1, variables={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": local_first}) as cluster:
        cluster.start()
        cluster.add_worker()
        os.environ.update(cluster.env)  # this process is the cluster's driver
        import ray
        from ray import serve

        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        url = f"http://127.0.0.1:{port}"
        runs = []
        try:
            for number in range(args.rounds):
                order = args.setups[number % len(args.setups):] + args.setups[: number % len(args.setups)]
                for setup in order:
                    print(f"round {number + 1}, {setup}: deploying", flush=True)
                    serve.run(_application(args, setup), name="routing")
                    _wait_ready(url, 2 if setup != "one" else 1)
                    began = time.perf_counter()
                    requests = _converse(url, chats, args.max_tokens)
                    runs.append({"round": number + 1, "setup": setup, "seconds": time.perf_counter() - began,
                                 "load": os.getloadavg()[0], "requests": requests})
                    print(f"round {number + 1}, {setup}: {summary(runs[-1])}", flush=True)
                    serve.delete("routing")
        finally:
            serve.shutdown()
            ray.shutdown()
    cluster.clean()
    return runs


def _application(args, setup: str):
    from specdeploy.serve.ray_app import RayOptions, application

    options = RayOptions(replicas=1 if setup == "one" else 2, router="default" if setup == "default" else "scope",
                         cpus_per_replica=1, max_replicas_per_node=1)
    return application(args.artifact, options, MODEL, args.threads,
                       options={"max_batch": args.max_batch, "context": args.context, "max_queue": 64})


def _converse(url: str, chats: list, max_tokens: int) -> list[dict]:
    """Every tenant's conversation at once, each turn after the last one's answer; one record per request."""
    import openai

    records: list[dict] = []

    def tenant(number: int, turns: list) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=f"tenant-{number}", max_retries=0, timeout=1800)
        for turn, prompt in enumerate(turns, 1):
            began = time.perf_counter()
            try:
                answer = client.chat.completions.create(model=MODEL, messages=list(prompt.messages), temperature=0,
                                                        max_tokens=max_tokens)
                usage, extra = answer.usage, answer.model_extra or {}
                records.append({"tenant": number, "turn": turn, "ok": True, "prompt_tokens": usage.prompt_tokens,
                                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                                "completion_tokens": usage.completion_tokens,
                                "speculative": extra.get("speculative"), "seconds": time.perf_counter() - began})
            except openai.APIError as exc:
                records.append({"tenant": number, "turn": turn, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    threads = [threading.Thread(target=tenant, args=(number, turns), daemon=True) for number, turns in enumerate(chats)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records


def figures(requests: list[dict], seconds: float) -> dict:
    """A setup's figures from its request records and wall time."""
    done = [r for r in requests if r["ok"]]
    later = [r for r in done if r["turn"] > 1]
    speculative = [r["speculative"] or {} for r in done]
    prompt, cached = sum(r["prompt_tokens"] for r in done), sum(r["cached_tokens"] for r in done)
    completion = sum(r["completion_tokens"] for r in done)
    return {"requests": len(requests), "failed": len(requests) - len(done), "prompt_tokens": prompt,
            "hit_rate": cached / prompt if prompt else 0.0,
            "later_hit_rate": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
            "accepted_per_request": sum(s.get("accepted_tokens", 0) for s in speculative) / max(1, len(done)),
            "drafted_per_request": sum(s.get("drafted_tokens", 0) for s in speculative) / max(1, len(done)),
            "completion_tokens": completion, "tok_s": completion / seconds if seconds > 0 else 0.0}


def summary(record: dict) -> str:
    f = figures(record["requests"], record["seconds"])
    return (f"{f['requests'] - f['failed']}/{f['requests']} answered, hit rate {f['hit_rate']:.1%}, "
            f"{f['accepted_per_request']:.1f} drafted tokens accepted a request, {f['tok_s']:.2f} tok/s "
            f"({record['seconds']:.0f} s, load {record['load']:.1f})")


def report(runs: list[dict]) -> str:
    """A markdown table of each setup's figures, pooled over the rounds, and the goals."""
    pooled = {}
    for setup in dict.fromkeys(r["setup"] for r in runs):
        mine = [r for r in runs if r["setup"] == setup]
        pooled[setup] = figures([q for r in mine for q in r["requests"]], sum(r["seconds"] for r in mine))
    lines = ["| setup | requests answered | prompt tokens | prefix-cache hit rate (later turns) | drafted tokens accepted "
             "a request (drafted) | completion tokens | tok/s |", "|---|---|---|---|---|---|---|"]
    for setup, f in pooled.items():
        lines.append(f"| {setup} | {f['requests'] - f['failed']}/{f['requests']} | {f['prompt_tokens']:,} | "
                     f"{f['hit_rate']:.1%} ({f['later_hit_rate']:.1%}) | {f['accepted_per_request']:.1f} "
                     f"({f['drafted_per_request']:.1f}) | {f['completion_tokens']:,} | {f['tok_s']:.2f} |")
    if {"scope", "one"} <= pooled.keys() and pooled["one"]["hit_rate"]:
        ratio = pooled["scope"]["hit_rate"] / pooled["one"]["hit_rate"]
        lines.append(f"\nscope's hit rate over one replica's: {ratio:.2f} (goal >= 0.90: "
                     f"{'met' if ratio >= 0.9 else 'not met'})")
    if {"scope", "default"} <= pooled.keys() and pooled["default"]["tok_s"]:
        ratio = pooled["scope"]["tok_s"] / pooled["default"]["tok_s"]
        lines.append(f"\nscope's tok/s over the default router's: {ratio:.2f} (goal >= 1.2: "
                     f"{'met' if ratio >= 1.2 else 'not met'})")
    return "\n".join(lines)


def _wait_ready(url: str, replicas: int, seconds: float = 900) -> None:
    """Until ``replicas`` replicas answer /health with 200 (keys spread the probes over them)."""
    deadline, seen, keys = time.monotonic() + seconds, set(), [f"probe-{number}" for number in range(16)]
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(seen)} of {replicas} replicas ready after {seconds:.0f} s")
        seen |= {replica for replica, _node in placement(url, keys).values()}
        if len(seen) < replicas:
            time.sleep(1)


if __name__ == "__main__":
    raise SystemExit(main())
