"""Ray Serve's autoscaling of specdeploy replicas under a load that rises and falls: replicas added, then removed
while they hold requests (their drain), and what every client saw.

A Ray cluster of two nodes is started on this machine, each its own processes (``tools/ray_cluster.py``), and the
artifact deployed to scale between one and two replicas (one a node, ``target_ongoing_requests`` 1, short delays:
--upscale-delay, --downscale-delay). Tenants (an API key each) send completions one after another, streamed and whole
in turn: one tenant for --calm seconds, --tenants for --busy seconds; then, as the busy tenants' last requests run,
the deployment is capped at one replica (``max_replicas`` 1, as an operator would), so that Ray removes one holding
requests: they drain; --tenants new tenants go on for --busy seconds against the one replica left, then one for --calm
seconds.

Printed: the replicas running over time (Ray Serve's status, each second), every request accounted for (answered whole;
refused as ``replica_lost``, which a drain that ends in time never causes; failed otherwise: expected none) and the
requests in flight when a replica began draining, with their outcomes.

    python -m tools.ray_autoscale --artifact DIR [--tenants 6] [--calm 30] [--busy 60] [--max-tokens 48]
        [--drain-seconds 25] [--upscale-delay 2] [--downscale-delay 5] [--threads 1] [--out docs/results/ray/autoscale]
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from tools import arguments
from tools.provenance import provenance, write_page
from tools.ray_cluster import LocalCluster
from tools.ray_load import MODEL, Tenants, accounted, free_port, replica_options

APP = "autoscale"


def main(argv: list[str] | None = None) -> int:
    parser = arguments.parser(__doc__)
    replica_options(parser, context=256)
    parser.add_argument("--tenants", type=arguments.integer(2), default=6, help="clients at once while busy")
    parser.add_argument("--calm", type=arguments.number(1), default=30, help="seconds of one client, before and after")
    parser.add_argument("--busy", type=arguments.number(1), default=60, help="seconds of --tenants clients")
    parser.add_argument("--max-tokens", type=arguments.integer(1), default=48, help="new tokens a request")
    parser.add_argument("--drain-seconds", type=arguments.number(0), default=25, help="a removed replica's drain")
    parser.add_argument("--upscale-delay", type=arguments.number(0), default=2, help="Ray Serve's upscale_delay_s")
    parser.add_argument("--downscale-delay", type=arguments.number(0), default=5, help="its downscale_delay_s")
    args = parser.parse_args(argv)
    facts = provenance("tools.ray_autoscale")
    record = run(args)
    text = report(record)
    print(text)
    if args.out is not None:
        write_page(args.out, "Ray Serve: autoscaling and draining", facts, text, record)
    return 0


def run(args) -> dict:
    """The requests (one record each, times from the start of the load) and the replicas over time."""
    root = Path(tempfile.mkdtemp(prefix="sdray-", dir="/tmp"))  # short: Ray's socket paths live under it
    with LocalCluster(root, cpus=1) as cluster:
        cluster.start()
        cluster.add_worker()
        os.environ.update(cluster.env)  # this process is the cluster's driver
        import ray
        from ray import serve

        from specdeploy.serve.ray_app import RayOptions, application

        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        url = f"http://127.0.0.1:{port}"
        options = RayOptions(min_replicas=1, max_replicas=2, target_ongoing_requests=1, cpus_per_replica=1,
                             max_replicas_per_node=1, drain_seconds=args.drain_seconds,
                             upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay)
        try:
            serve.run(application(args.artifact, options, MODEL, args.threads, options={"max_batch": 8, "context": args.context}),
                      name=APP)
            began = time.monotonic()
            replicas: list[tuple[float, dict]] = []
            watching = threading.Event()
            watcher = threading.Thread(target=_watch, args=(serve, began, replicas, watching), daemon=True)
            watcher.start()
            phases = []
            capped = replace(options, min_replicas=1, max_replicas=1)
            for name, count, seconds in (("calm", 1, args.calm), ("busy", args.tenants, args.busy),
                                         ("capped at one replica", args.tenants, args.busy), ("calm again", 1, args.calm)):
                tenants = Tenants(url, [f"{name}-{number}" for number in range(count)], args.max_tokens, began)
                phases.append((name, time.monotonic() - began))
                if name.startswith("capped"):  # serve.run returns once the update is applied: meanwhile, load
                    threading.Thread(target=serve.run, daemon=True, name="cap", kwargs=dict(name=APP, target=application(
                        args.artifact, capped, MODEL, args.threads, options={"max_batch": 8, "context": args.context}))
                    ).start()
                tenants.start()
                time.sleep(seconds)
                threading.Thread(target=tenants.stop, daemon=True).start()  # its last requests end on their own
                phases[-1] += (tenants,)
            for *_, tenants in phases:
                tenants.stop()
            time.sleep(max(0.0, args.downscale_delay + args.drain_seconds))  # the last drain, watched
            watching.set()
            watcher.join()
        finally:
            serve.shutdown()
            ray.shutdown()
    cluster.clean()
    requests = [request for *_, tenants in phases for request in tenants.requests]
    return {"replicas": replicas, "phases": [phase[:2] for phase in phases], "requests": requests,
            "load": os.getloadavg()[0]}


def _watch(serve, began: float, replicas: list, done: threading.Event) -> None:
    """Each second, the deployment's replicas by state (Ray Serve's status), when they changed."""
    last = None
    while not done.is_set():
        try:
            deployments = serve.status().applications[APP].deployments
            states = {str(state): count for d in deployments.values() for state, count in d.replica_states.items()}
        except Exception as exc:  # the status is read over Ray: a moment's failure is noted, not fatal
            states = {"unknown": str(exc)[:80]}
        if states != last:
            replicas.append((time.monotonic() - began, states))
            last = states
        time.sleep(1)


def report(record: dict) -> str:
    """The replicas over time, the requests, and the requests in flight when a replica began to stop."""
    requests = record["requests"]
    lines = ["| seconds | replicas by state |", "|---|---|"]
    lines += [f"| {at:.0f} | {', '.join(f'{state} {count}' for state, count in states.items())} |"
              for at, states in record["replicas"]]
    stopping = [at for at, states in record["replicas"] if any("STOPPING" in state for state in states)]
    lines += ["", "phases: " + ", ".join(f"{name} from {at:.0f} s" for name, at in record["phases"]), "",
              f"- {accounted(requests)}"]
    if stopping:
        drained = [r for r in requests if r["start"] < stopping[0] < r["end"]]
        lines.append(f"- in flight when a replica began to stop ({stopping[0]:.0f} s): {len(drained)} requests, "
                     f"{sum(r['outcome'] == 'ok' for r in drained)} answered whole")
    else:
        lines.append("- no replica was removed")
    lines.append(f"\nload average at the end: {record['load']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
