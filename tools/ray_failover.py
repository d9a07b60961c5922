"""A Ray node killed under load, and brought back: what every client saw.

A Ray cluster of two nodes is started on this machine, each its own processes (``tools/ray_cluster.py``: `ray start
--head`, `ray start --address=...`), and the artifact deployed with one replica a node (requests routed by scope).
--tenants clients (an API key each) send completions one after another, streamed and whole in turn, for --seconds;
after --kill-after seconds the worker node is killed (SIGKILL to all of its processes at once, as a machine fails),
and --down seconds later started again. A request refused as ``replica_lost`` (a 503 before any text, or an error
event ending a stream) is sent again once, as a client would.

Printed: every request accounted for (answered whole; refused as lost, then answered or not on its retry; failed
otherwise: expected none), the requests in flight at the kill, the seconds from the kill until every tenant had been
answered again, from the restart until the rejoined node's replica answered, and tokens per second before the kill,
while the node was down, and after it rejoined.

    python -m tools.ray_failover --artifact DIR [--tenants 6] [--seconds 150] [--kill-after 20] [--down 20]
        [--max-tokens 48] [--threads 1] [--context 256] [--out docs/results/ray/failover]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from tools import arguments
from tools.provenance import provenance, write_page
from tools.ray_cluster import LocalCluster
from tools.ray_load import MODEL, Tenants, accounted, free_port, placement, replica_options


def main(argv: list[str] | None = None) -> int:
    parser = arguments.parser(__doc__)
    replica_options(parser, context=256)
    parser.add_argument("--tenants", type=arguments.integer(1), default=6, help="clients at once, an API key each")
    parser.add_argument("--seconds", type=arguments.number(1), default=150, help="how long the clients send")
    parser.add_argument("--kill-after", type=arguments.number(0), default=20, help="seconds of load before the kill")
    parser.add_argument("--down", type=arguments.number(0), default=20, help="seconds the node stays down")
    parser.add_argument("--max-tokens", type=arguments.integer(1), default=48, help="new tokens a request")
    args = parser.parse_args(argv)
    facts = provenance("tools.ray_failover")
    record = run(args)
    text = report(record)
    print(text)
    if args.out is not None:
        write_page(args.out, "Ray Serve: a node killed under load", facts, text, record)
    return 0


def run(args) -> dict:
    """The requests (one record each, times from the start of the load) and the run's events."""
    root = Path(tempfile.mkdtemp(prefix="sdray-", dir="/tmp"))  # short: Ray's socket paths live under it
    events: dict = {}
    with LocalCluster(root, cpus=1) as cluster:
        cluster.start()
        worker = cluster.add_worker()
        os.environ.update(cluster.env)  # this process is the cluster's driver
        import ray
        from ray import serve

        from specdeploy.serve.ray_app import RayOptions, application

        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        url = f"http://127.0.0.1:{port}"
        try:
            serve.run(application(args.artifact, RayOptions(replicas=2, cpus_per_replica=1, max_replicas_per_node=1),
                                  MODEL, args.threads, options={"max_batch": 8, "context": args.context}))
            keys = [f"tenant-{number}" for number in range(args.tenants)]
            events["commands"], events["placement"] = cluster.commands, placement(url, keys)
            began = time.monotonic()
            tenants = Tenants(url, keys, args.max_tokens, began)
            tenants.start()
            time.sleep(args.kill_after)
            events["killed"] = time.monotonic() - began
            cluster.kill(worker)
            time.sleep(args.down)
            events["restarting"] = time.monotonic() - began
            worker = cluster.restart(worker)
            events["restarted"] = time.monotonic() - began
            rejoined = cluster.node_id(worker)[:12]
            while time.monotonic() - began < args.seconds:
                if "rejoined" not in events and rejoined in {node for _, node in placement(url, keys).values()}:
                    events["rejoined"] = time.monotonic() - began
                time.sleep(1)
            tenants.stop()
        finally:
            serve.shutdown()
            ray.shutdown()
    cluster.clean()
    return {"events": events, "requests": tenants.requests, "load": os.getloadavg()[0]}


def report(record: dict) -> str:
    """What the clients saw, in a few lines and a table."""
    events, requests = record["events"], record["requests"]
    killed, restarted = events["killed"], events["restarted"]
    lost = [r for r in requests if r["outcome"] == "replica_lost"]
    in_flight = [r for r in requests if r["start"] < killed < r["end"]]
    lost_tenants = {r["tenant"] for r in lost}
    answered_again = [min([r["end"] for r in requests if r["tenant"] == tenant and r["start"] > killed
                           and r["outcome"] == "ok"] + [r["retry"]["end"] for r in lost if r["tenant"] == tenant
                                                        and r["retry"]["outcome"] == "ok"], default=float("inf"))
                      for tenant in lost_tenants]
    lines = [f"Commands run: `{'`; `'.join(events['commands'])}`", "",
             f"- {accounted(requests)}",
             f"- in flight at the kill ({killed:.1f} s): {len(in_flight)} requests, of which "
             f"{sum(r['outcome'] == 'replica_lost' for r in in_flight)} on the killed node",
             f"- every tenant of the killed node answered again (a retry, or its next request) "
             f"{max(answered_again, default=killed) - killed:.1f} s after the kill" if lost_tenants
             else "- no tenant lost a request",
             f"- the node restarted at {restarted:.1f} s ({restarted - events['restarting']:.1f} s for `ray start`); its "
             f"replica answered {events['rejoined'] - restarted:.1f} s later" if "rejoined" in events
             else f"- the node restarted at {restarted:.1f} s; its replica did not answer before the end",
             "", "| phase | seconds | requests answered | tokens | tok/s |", "|---|---|---|---|---|"]
    end = max((r["end"] for r in requests), default=killed)
    phases = (("before the kill", 0.0, killed), ("node down", killed, events.get("rejoined", end)),
              ("after it rejoined", events.get("rejoined", end), end))
    for name, start, stop in phases:
        done = [r for r in requests if r["outcome"] == "ok" and start <= r["end"] < stop]
        tokens = sum(r["tokens"] for r in done)
        lines.append(f"| {name} | {stop - start:.1f} | {len(done)} | {tokens:,} | "
                     f"{tokens / (stop - start) if stop > start else 0:.1f} |")
    lines.append(f"\nload average at the end: {record['load']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
