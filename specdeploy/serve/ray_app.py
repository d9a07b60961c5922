"""Replicas of the server under Ray Serve: the same OpenAI API, over any number of Ray nodes.

Each replica is a Ray actor that loads the artifact and runs its own scheduler (continuous batching within the
replica). ``RayOptions`` says how many replicas run (a fixed number, or between a minimum and a maximum as their load
asks: Ray Serve's autoscaling), how requests are routed to them (``ray_router.ScopeRouter`` by default: a client's
requests to the replica that holds its suffix index and prefix cache), where they may run, and how one that is removed
drains: Ray stops routing to it and waits up to ``drain_seconds`` for its requests to finish; one still open then is
ended by Ray, and its client answered by the proxy's ``ray_proxy.LostReplica`` (a 503 ``replica_lost`` to retry, or
an error event ending its stream).

    from ray import serve
    from specdeploy.serve.ray_app import RayOptions, application
    serve.run(application("art", RayOptions(min_replicas=1, max_replicas=4), options={"max_batch": 8}))

or, from Ray's own CLI and config files (a RayService's ``serveConfigV2`` on Kubernetes), ``app_builder``:

    serve run specdeploy.serve.ray_app:app_builder artifact=/models/art
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from ..runtime.config import ConfigError
from ..values import is_integer, short

ROUTERS = {"scope": "specdeploy.serve.ray_router:ScopeRouter",
           "default": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}  # Ray's own default
APP_SETTINGS = ("default_max_tokens", "max_body_bytes", "api_key", "allowed_origins", "template_seconds", "suffix_scope")


@dataclass(frozen=True)
class RayOptions:
    """How the replicas run on Ray. ``replicas``: a fixed number; with ``max_replicas``, Ray Serve scales between
    ``min_replicas`` (None: 1; 0: none while idle) and ``max_replicas`` to keep about ``target_ongoing_requests``
    requests in flight on each (None: half of a replica's batch), waiting ``upscale_delay_s`` and ``downscale_delay_s``
    before it adds or removes one (None: Ray's 30 s and 600 s). ``router``: ``scope`` (each client's requests to the
    replica that holds its scope, under bounded loads of ``load_factor`` times an even share) or ``default`` (Ray's:
    the less busy of two at random, preferring its proxy's node). ``max_ongoing_requests``: requests sent to a replica
    at once (None: its batch, ``max_batch``; more wait in Ray's queue, where the router places each when a replica has
    room). ``drain_seconds``: how long a removed replica's requests may run on. ``metrics_port``: each replica also
    serves its /metrics on its node at this port plus its rank among the deployment's replicas on that node (None: only
    through Ray's proxy)."""

    replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay_s: float | None = None
    downscale_delay_s: float | None = None
    router: str = "scope"
    load_factor: float = 1.25
    cpus_per_replica: float = 1.0
    max_replicas_per_node: int | None = None
    max_ongoing_requests: int | None = None
    drain_seconds: float = 25.0
    metrics_port: int | None = None

    def __post_init__(self):
        for name, low in (("replicas", 1), ("min_replicas", 0), ("max_replicas", 1), ("max_replicas_per_node", 1),
                          ("max_ongoing_requests", 1), ("metrics_port", 1)):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < low):
                raise ConfigError(f"Ray {name}: got {short(value)}; expected an integer >= {low}")
        if self.router not in ROUTERS:
            raise ConfigError(f"Ray router: got {short(self.router)}; expected one of {', '.join(ROUTERS)}")
        if self.max_replicas is None and self.min_replicas is not None:
            raise ConfigError(f"Ray min_replicas: got {self.min_replicas} without max_replicas; autoscaling needs both")
        if self.max_replicas is not None and (self.min_replicas or 0) > self.max_replicas:
            raise ConfigError(f"Ray min_replicas: got {self.min_replicas}; expected at most max_replicas ({self.max_replicas})")
        for name, positive in (("target_ongoing_requests", True), ("cpus_per_replica", True), ("drain_seconds", False),
                               ("upscale_delay_s", False), ("downscale_delay_s", False)):
            value = getattr(self, name)
            if value is not None and not (value > 0 if positive else value >= 0):
                raise ConfigError(f"Ray {name}: got {short(value)}; expected a number {'>' if positive else '>='} 0")
        if self.load_factor < 1:
            raise ConfigError(f"Ray load_factor: got {short(self.load_factor)}; expected at least 1 (an even share)")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    def deployment(self, max_batch: int) -> dict:
        """``serve.deployment``'s options for replicas that batch ``max_batch`` requests each."""
        settings = dict(ray_actor_options={"num_cpus": self.cpus_per_replica},
                        max_ongoing_requests=self.max_ongoing_requests or max_batch,
                        graceful_shutdown_timeout_s=self.drain_seconds, graceful_shutdown_wait_loop_s=0.5,
                        request_router_config={"request_router_class": ROUTERS[self.router],
                                               "request_router_kwargs": {"load_factor": self.load_factor}
                                               if self.router == "scope" else {}})
        if self.max_replicas_per_node is not None:
            settings["max_replicas_per_node"] = self.max_replicas_per_node
        if self.autoscaling:
            target = self.target_ongoing_requests or max(1.0, max_batch / 2)
            least = 1 if self.min_replicas is None else self.min_replicas  # 0: down to none while idle
            settings["autoscaling_config"] = {"min_replicas": least, "max_replicas": self.max_replicas,
                                              "initial_replicas": max(1, least), "target_ongoing_requests": target}
            for name in ("upscale_delay_s", "downscale_delay_s"):
                if getattr(self, name) is not None:
                    settings["autoscaling_config"][name] = getattr(self, name)
        else:
            settings["num_replicas"] = self.replicas
        return settings


def application(artifact: str | Path, ray: RayOptions | None = None, model: str | None = None,
                threads: int | None = None, options: dict | None = None, config: dict | None = None,
                pipeline: dict | None = None):
    """A Ray Serve application of replicas serving ``artifact``, run as ``ray`` says.

    ``options`` go to each replica's ``Scheduler`` (max_batch, max_queue, prefill_chunk, seed), plus ``context``
    and ``create_app``'s settings (``APP_SETTINGS``: default_max_tokens, api_key, suffix_scope, ...); ``config`` to its
    ``GenerationConfig`` (k, policy, drafter); ``pipeline`` to ``Pipeline.load`` (provider, draft_provider,
    prefix_cache_bytes, and suffix_tokens: what each scope's suffix index keeps).
    """
    from ray import serve

    ray = ray or RayOptions()
    artifact = str(Path(artifact).resolve())
    model = model or Path(artifact).name
    options, config, loading = dict(options or {}), dict(config or {}), dict(pipeline or {})

    def build():  # runs in each replica: its own engines, scheduler and thread
        from .. import GenerationConfig, Pipeline
        from ..runtime.suffix_store import SuffixStore
        from .app import create_app
        from .scheduler import Scheduler, context_slots

        settings, load = dict(options), dict(loading)
        if "suffix_tokens" in load:
            load["suffix_store"] = SuffixStore(max_tokens=load.pop("suffix_tokens"))
        pipeline = Pipeline.load(artifact, threads=threads, **load)
        context = context_slots(pipeline, settings.pop("context", None))
        app_settings = {name: settings.pop(name) for name in APP_SETTINGS if name in settings}
        scheduler = Scheduler(pipeline, GenerationConfig(**config), context, **settings)
        scheduler.start()
        where = replica_identity()
        app = create_app(pipeline, scheduler, model, identity=where, **app_settings)
        if ray.metrics_port is not None:
            serve_metrics(app, where, ray.metrics_port)
        return app

    @serve.deployment(**ray.deployment(options.get("max_batch", 8)))
    @serve.ingress(build)
    class SpecdeployReplica:
        pass

    return SpecdeployReplica.bind()


BUILDER_ARGS = ("artifact", "ray", "model", "threads", "options", "config", "pipeline")


def app_builder(args: dict):
    """Ray Serve's application builder (``import_path: specdeploy.serve.ray_app:app_builder`` in a Serve config, or
    ``serve run specdeploy.serve.ray_app:app_builder artifact=DIR``): ``args`` name ``application``'s arguments,
    ``ray`` as a mapping of ``RayOptions``' fields. ConfigError naming an argument it does not take."""
    args = dict(args)
    unknown = sorted(set(args) - set(BUILDER_ARGS))
    if unknown or "artifact" not in args:
        raise ConfigError(f"specdeploy's Ray Serve args: got {', '.join(unknown) or 'no artifact'}; expected artifact "
                          f"and any of {', '.join(BUILDER_ARGS[1:])}")
    ray = dict(args.get("ray") or {})
    fields = set(RayOptions.__dataclass_fields__)
    if set(ray) - fields:
        raise ConfigError(f"specdeploy's Ray Serve args: ray: got {', '.join(sorted(set(ray) - fields))}; expected any "
                          f"of {', '.join(RayOptions.__dataclass_fields__)}")
    threads = args.get("threads")
    return application(args["artifact"], RayOptions(**ray), args.get("model"),
                       int(threads) if threads is not None else None, args.get("options"), args.get("config"),
                       args.get("pipeline"))


def replica_identity() -> dict[str, str]:
    """Who answers, in a replica: its Ray Serve replica id, its node's id (the first 12 hex digits, as ``ray status``
    lists nodes) and address, and its rank among the deployment's replicas on that node."""
    import ray
    from ray import serve

    context = serve.get_replica_context()
    rank = getattr(context, "rank", None)
    return {"replica": context.replica_tag, "node": ray.get_runtime_context().get_node_id()[:12],
            "node_ip": ray.util.get_node_ip_address(), "local_rank": str(getattr(rank, "local_rank", 0) or 0)}


def serve_metrics(app, where: dict[str, str], base_port: int) -> None:
    """This replica's /metrics also at http://NODE_IP:(base_port + its rank on the node)/metrics, for a Prometheus
    that scrapes every replica (docs/serving.md); the address goes into ``where`` (its /health shows it)."""
    from prometheus_client import start_http_server

    port = base_port + int(where["local_rank"])
    try:
        start_http_server(port, addr="0.0.0.0", registry=app.state.metrics.served)
    except OSError as exc:  # another process holds it: the replica serves on, its /health says why
        where["metrics"] = f"not served: port {port} on {socket.gethostname()}: {exc}"
        return
    where["metrics"] = f"http://{where['node_ip']}:{port}/metrics"
