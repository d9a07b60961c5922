"""Replicas of the server under Ray Serve: the same OpenAI API, with Ray's proxy spreading requests.

Each replica is a Ray actor that loads the artifact and runs its own scheduler (continuous batching
within the replica); Ray Serve routes requests across replicas. Nothing here balances load itself.

    from ray import serve
    from specdeploy.serve.ray_app import application
    serve.run(application("art", replicas=2, options={"max_batch": 8}))
"""

from __future__ import annotations

from pathlib import Path


def application(artifact: str | Path, replicas: int = 2, model: str | None = None, threads: int | None = None,
                cpus_per_replica: float = 1.0, options: dict | None = None, config: dict | None = None):
    """A Ray Serve application of ``replicas`` servers over ``artifact``.

    ``options`` go to each replica's ``Scheduler`` (max_batch, max_queue, prefill_chunk, seed), plus ``context``
    and ``create_app``'s settings (default_max_tokens, max_body_bytes, api_key, allowed_origins, template_seconds);
    ``config`` to its ``GenerationConfig`` (k, policy, drafter).
    """
    from ray import serve

    artifact = str(Path(artifact).resolve())
    model = model or Path(artifact).name
    options, config = dict(options or {}), dict(config or {})

    def build():  # runs in each replica: its own engines, scheduler and thread
        from .. import GenerationConfig, Pipeline
        from .app import create_app
        from .scheduler import Scheduler, context_slots

        pipeline = Pipeline.load(artifact, threads=threads)
        settings = dict(options)
        context = context_slots(pipeline, settings.pop("context", None))
        app_settings = {name: settings.pop(name) for name in ("default_max_tokens", "max_body_bytes", "api_key",
                                                              "allowed_origins", "template_seconds") if name in settings}
        scheduler = Scheduler(pipeline, GenerationConfig(**config), context, **settings)
        scheduler.start()
        return create_app(pipeline, scheduler, model, **app_settings)

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": cpus_per_replica})
    @serve.ingress(build)
    class SpecdeployReplica:
        pass

    return SpecdeployReplica.bind()
