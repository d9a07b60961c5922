"""``specdeploy serve``: an OpenAI-compatible HTTP server over an artifact, with continuous batching."""

from __future__ import annotations

from pathlib import Path

import click

from ..engines.ort import PROVIDERS
from .common import speculation_options, threads_option


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--model-name", default=None, help="The model id clients send (default: the artifact directory's name).")
@click.option("--provider", type=click.Choice(list(PROVIDERS)), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@threads_option
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together at most; more wait in the queue.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a row at most; beyond it the server answers 429 with Retry-After.")
@click.option("--context", type=click.IntRange(min=2), default=None,
              help="Cache slots per request: prompt + max_tokens + k + 1 (default: the artifact's capacity, at most 2048).")
@click.option("--max-cache-bytes", type=click.IntRange(min=1), default=None,
              help="Refuse to start if --max-batch rows of --context slots need more KV-cache memory than this.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True,
              help="Prompt tokens a joining request prefills between two cycles of the running batch.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens of a request that gives none.")
@speculation_options("Draft length (the maximum, for adaptive policies); a request may ask for fewer.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 * 2**20, show_default=True,
              help="Larger request bodies are refused with 413.")
@click.option("--ray-replicas", type=click.IntRange(min=1), default=None,
              help="Run this many replicas under Ray Serve (a local Ray instance; needs ray[serve]), same API.")
def serve(directory, host, port, model_name, provider, threads, max_batch, max_queue, context, max_cache_bytes,
          prefill_chunk, default_max_tokens, k, policy, drafter, confidence_threshold, max_body_bytes, ray_replicas):
    """Serve an artifact DIRECTORY over the OpenAI API: /v1/completions, /v1/chat/completions (streamed or
    not), /v1/models, /health and /metrics."""
    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as exc:
        raise click.ClickException(f"serve needs the 'serve' extra: pip install 'specdeploy[serve]' ({exc})") from exc
    from .. import GenerationConfig, Pipeline
    from ..contract import ContractError
    from ..engines import ProviderError
    from ..runtime.config import ConfigError
    from ..serve.scheduler import Scheduler, context_slots

    try:
        config = GenerationConfig(k=k, policy=policy, drafter=drafter, confidence_threshold=confidence_threshold)
        pipeline = Pipeline.load(directory, provider=provider, threads=threads)
        pipeline.drafter_for(config)  # a drafter that needs a draft model the artifact lacks: refused now
        context = context_slots(pipeline, context)
        sizes = pipeline.cache_bytes(max_batch, context, speculative=config.speculative)
        if max_cache_bytes is not None and sizes["total"] > max_cache_bytes:
            raise ConfigError(f"--max-batch {max_batch} rows x --context {context} slots need "
                              f"{sizes['total'] / 2**20:.1f} MiB of KV cache, over --max-cache-bytes "
                              f"({max_cache_bytes / 2**20:.1f} MiB); lower one of them")
    except (ConfigError, ContractError, ProviderError) as exc:
        raise click.ClickException(str(exc)) from exc
    name = model_name or directory.resolve().name
    if ray_replicas:
        del pipeline  # each replica loads its own
        _serve_on_ray(directory, name, host, port, threads, ray_replicas, config,
                      dict(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk, context=context,
                           default_max_tokens=default_max_tokens, max_body_bytes=max_body_bytes))
        return
    scheduler = Scheduler(pipeline, config, context, max_batch=max_batch, max_queue=max_queue,
                          prefill_chunk=prefill_chunk)
    app = create_app(pipeline, scheduler, name, default_max_tokens, max_body_bytes)
    scheduler.start()
    click.echo(f"serving {directory} as {name!r} on http://{host}:{port}/v1 "
               f"(batch {max_batch}, queue {max_queue}, context {context}, KV cache up to "
               f"{sizes['total'] / 2**20:.0f} MiB)", err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        scheduler.stop()


def _serve_on_ray(directory, name, host, port, threads, replicas, config, options) -> None:
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError as exc:
        raise click.ClickException(f"--ray-replicas needs Ray Serve: pip install 'ray[serve]' ({exc})") from exc
    from ..serve.ray_app import application

    ray.init(include_dashboard=False)
    ray_serve.start(http_options={"host": host, "port": port})
    settings = dict(k=config.k, policy=config.policy, drafter=config.drafter,
                    confidence_threshold=config.confidence_threshold)
    click.echo(f"serving {directory} as {name!r} on http://{host}:{port}/v1 with {replicas} Ray Serve replicas", err=True)
    ray_serve.run(application(directory, replicas, name, threads, options=options, config=settings), blocking=True)
