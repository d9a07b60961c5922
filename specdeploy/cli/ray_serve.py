"""``specdeploy serve``'s Ray Serve options, and serving through them: replicas on a Ray cluster (or a local Ray
instance), fixed in number or autoscaled, requests routed by scope (docs/serving.md, Scale-out)."""

from __future__ import annotations

import os
import signal
import time

import click

# flags of `specdeploy serve` that its replicas under Ray do not take yet: refused rather than silently ignored
NOT_UNDER_RAY = ("chat_template", "suffix_file", "ssl_keyfile", "ssl_certfile", "root_path", "forwarded_allow_ips")


def ray_options(command):
    """The --ray-* options of ``serve``; any of --ray-replicas, --ray-max-replicas or --ray-address serves under Ray."""
    options = [
        click.option("--ray-replicas", type=click.IntRange(min=1), default=None,
                     help="Run this many replicas under Ray Serve (needs ray[serve]), same API; each loads the artifact "
                          "and batches its own requests."),
        click.option("--ray-min-replicas", type=click.IntRange(min=0), default=None,
                     help="Autoscaling: the fewest replicas Ray Serve keeps (with --ray-max-replicas; default 1)."),
        click.option("--ray-max-replicas", type=click.IntRange(min=1), default=None,
                     help="Autoscaling: the most replicas; Ray Serve adds and removes replicas to keep about "
                          "--ray-target-ongoing-requests requests in flight on each. A replica removed drains: it takes "
                          "no new requests and its open ones may run --drain-seconds."),
        click.option("--ray-target-ongoing-requests", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Autoscaling: requests in flight per replica that Ray Serve scales to (default: half of "
                          "--max-num-seqs)."),
        click.option("--ray-router", type=click.Choice(["scope", "default"]), default="scope", show_default=True,
                     help="scope: each API key's requests to the replica that holds its suffix index and prefix cache, "
                          "another one only while that replica holds more than 1.25x its share of the requests in "
                          "flight; default: Ray's own (the less busy of two replicas at random, those on the proxy's node "
                          "first)."),
        click.option("--ray-address", default=None,
                     help="A running Ray cluster to deploy to (as `ray start --head` printed it, or 'auto'); by default "
                          "a Ray instance is started on this machine for this process."),
        click.option("--ray-cpus-per-replica", type=click.FloatRange(min=0, min_open=True), default=1.0,
                     show_default=True, help="CPUs Ray reserves for each replica (set --threads to match)."),
        click.option("--ray-max-replicas-per-node", type=click.IntRange(min=1), default=None,
                     help="At most this many replicas on one Ray node (1: one per node, so that a node lost takes one)."),
        click.option("--ray-proxy-location", type=click.Choice(["EveryNode", "HeadOnly"]), default="EveryNode",
                     show_default=True,
                     help="Where Ray Serve runs its HTTP proxy (on --host/--port): on every node, or on the head "
                          "only (several Ray nodes on one machine would contend for one port)."),
        click.option("--ray-metrics-port", type=click.IntRange(1, 65535), default=None,
                     help="Each replica also serves its /metrics at this port plus its rank among the replicas on its "
                          "node (docs/serving.md: scraping replicas); by default only through Ray's proxy."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def serving_on_ray(replicas, max_replicas, address) -> bool:
    return bool(replicas or max_replicas or address)


def serve_on_ray(directory, name: str, host: str, port: int, threads, config, options: dict, pipeline: dict,
                 ray_settings: dict, refused: dict) -> None:
    """Deploy the replicas and block while they serve. ``refused``: flags given that replicas do not take (one line)."""
    given = [f"--{flag.replace('_', '-')}" for flag in NOT_UNDER_RAY if refused.get(flag)]
    if given:
        raise click.ClickException(f"{', '.join(given)}: not applied by replicas under Ray yet; serve without them, "
                                   "or without Ray")
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError as exc:
        raise click.ClickException(f"serving under Ray needs Ray Serve: pip install 'ray[serve]' ({exc})") from exc
    from ..runtime.config import ConfigError
    from ..serve.ray_app import RayOptions, application
    from ..serve.ray_proxy import CALLBACK, CALLBACK_VARIABLE

    settings = dict(ray_settings)
    address, proxy_location = settings.pop("address"), settings.pop("proxy_location")
    if settings["replicas"] and settings["max_replicas"]:
        raise click.ClickException("--ray-replicas and --ray-max-replicas: got both; expected a fixed number of replicas, "
                                   "or autoscaling between --ray-min-replicas and --ray-max-replicas")
    try:
        options_ = RayOptions(replicas=settings.pop("replicas") or 2, **settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if address is None:  # the Ray instance started here: its proxy answers a lost replica's clients (ray_proxy)
        os.environ.setdefault(CALLBACK_VARIABLE, CALLBACK)
    ray.init(address=address) if address else ray.init(include_dashboard=False)
    ray_serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    generation = dict(k=config.k, policy=config.policy, drafter=config.drafter,
                      confidence_threshold=config.confidence_threshold, exact=config.exact)
    count = (f"{options_.min_replicas or 0} to {options_.max_replicas} replicas (autoscaling)" if options_.autoscaling
             else f"{options_.replicas} replicas")
    click.echo(f"deploying {directory} as {name!r} on http://{host}:{port}/v1 with {count} under Ray Serve, routed by "
               f"{'scope' if options_.router == 'scope' else 'Ray'}", err=True)
    ray_serve.run(application(directory, options_, name, threads, options=options, config=generation, pipeline=pipeline))
    if address:  # the cluster's Serve controller keeps the replicas: this process was only their deployer
        click.echo("deployed: the replicas serve on without this process; `serve status` and `serve shutdown` (with the "
                   "cluster's dashboard address, http://HEAD:8265) show and stop them", err=True)
        return
    _serve_until_stopped(ray_serve)


def _serve_until_stopped(ray_serve) -> None:
    """The Ray instance of this process serves until SIGTERM or Ctrl-C; then its replicas drain (Ray Serve stops
    routing to them and waits up to --drain-seconds for their requests) and the process exits 0."""
    signal.signal(signal.SIGTERM, _interrupted)
    click.echo("ready: the replicas answer /health with 200", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("stopping: the replicas drain (up to --drain-seconds), then Ray stops", err=True)
        ray_serve.shutdown()


def _interrupted(number, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops as Ctrl-C does
