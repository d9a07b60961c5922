"""``specdeploy serve``: an OpenAI-compatible HTTP server over an artifact, with continuous batching.

Flags are named as ``vllm serve`` names them where it has one (``--served-model-name``, ``--max-num-seqs``,
``--max-model-len``, ``--chat-template``, ``--seed``, ``--api-key``, ``--ssl-keyfile``/``--ssl-certfile``,
``--root-path``, ``--allowed-origins``), with specdeploy's older names kept as aliases. docs/serving.md is
the operator's page.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from ..runtime.prefix_cache import DEFAULT_BYTES as DEFAULT_PREFIX_BYTES
from ..runtime.suffix_store import BYTES_PER_TOKEN_IN_MEMORY, DEFAULT_SCOPES, DEFAULT_TOKENS, max_tokens_for
from ..values import short
from .common import provider_options, speculation_options, suffix_file_option, threads_option
from .ray_serve import ray_options, serve_on_ray, serving_on_ray
from .settings import check_environment, networks_form, origins_form, root_path_form, text_setting

TEMPLATE_FILE_LIMIT = 2**20  # a chat template file larger than this is not a template


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, callback=text_setting(),
              help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on; 0 picks a free one (printed once bound).")
@click.option("--served-model-name", "--model-name", "model_name", default=None, callback=text_setting(),
              help="The model id clients send (default: the artifact directory's name).")
@provider_options(draft=True)
@threads_option
@click.option("--max-num-seqs", "--max-batch", "max_batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together at most; more wait in the queue.")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests waiting for a row at most; beyond it the server answers 429 with Retry-After.")
@click.option("--max-model-len", "--context", "context", type=click.IntRange(min=2), default=None,
              help="Cache slots per request: prompt + max_tokens + k + 1 (default: the artifact's capacity, at most 2048).")
@click.option("--max-cache-bytes", type=click.IntRange(min=1), default=None,
              help="Refuse to start if --max-num-seqs rows of --max-model-len slots need more KV-cache memory than this.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True,
              help="Prompt tokens a joining request prefills between two cycles of the running batch.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=None,
              help="max_tokens of a request that gives none (default: the room its prompt leaves in the context).")
@speculation_options("Draft length (the maximum, for adaptive policies); a request may ask for fewer.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 * 2**20, show_default=True,
              help="Larger request bodies are refused with 413, whatever their transfer encoding.")
@click.option("--api-key", envvar="SPECDEPLOY_API_KEY", default=None, callback=text_setting(secret=True),
              help="Clients must send 'Authorization: Bearer KEY' (all routes but /health* and /metrics). "
                   "Also read from SPECDEPLOY_API_KEY, which keeps it out of the process list.")
@click.option("--chat-template", default=None, callback=text_setting(free_text=True),
              help="A Jinja chat template (a file, or the template itself) in place of the artifact's.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None,
              help="Requests without a seed draw theirs from this one in turn: a sequence of requests is reproducible.")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None, help="Serve HTTPS with this key.")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve HTTPS with this certificate.")
@click.option("--root-path", default=None, callback=text_setting(root_path_form),
              help="The path prefix a proxy serves this server under (ASGI root_path), such as /llm.")
@click.option("--allowed-origins", multiple=True, callback=text_setting(origins_form),
              help="Browser origins allowed cross-origin requests (CORS): repeat it, separate with commas, or give a JSON "
                   "list, as vllm serve takes it; '*' for any.")
@click.option("--forwarded-allow-ips", default=None, callback=text_setting(networks_form),
              help="Proxies (addresses or CIDR networks, comma-separated; '*' for any) whose X-Forwarded-For and "
                   "X-Forwarded-Proto are believed; by default none are, so a client cannot choose the address logged.")
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=25.0, show_default=True,
              help="On SIGTERM: how long running requests may go on before they are ended (each with a final event).")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="One line per request on stderr, with its request id.")
@click.option("--template-seconds", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="The CPU time a chat template may use before the request fails with 500 (a busy machine's waiting is "
                   "not counted; the wall clock stops a render only at 10 times this plus 5 s).")
@click.option("--suffix-scope", type=click.Choice(["key", "global", "none"]), default="key", show_default=True,
              help="Whose earlier answers a request drafts from: those under its own API key (the bearer token it "
                   "sends), everyone's (global), or none but its own text. The texts' K/V it reuses are its key's, "
                   "everyone's under global. Neither changes a text; their speed could tell one client what another's "
                   "held (docs/serving.md).")
@suffix_file_option("Keep the suffix indexes in this file: loaded at start, written atomically when the server stops "
                    "(through a symlink, to the file it names). A corrupt, foreign or oversized file is refused in one "
                    "line, left as it is and never written: the server starts empty and saves nothing.")
@click.option("--suffix-tokens", type=click.IntRange(min=1, max=max_tokens_for(DEFAULT_SCOPES)), default=DEFAULT_TOKENS,
              show_default=True,
              help=f"Tokens each scope's suffix index keeps at most (the least recently used texts go first); an index "
                   f"takes 0.4-1.1 KB a token, and at most {DEFAULT_SCOPES} scopes are kept (the least recently used "
                   f"goes), so at most what {DEFAULT_SCOPES} indexes of {BYTES_PER_TOKEN_IN_MEMORY:,} bytes a token "
                   f"fit in half of this machine's memory.")
@click.option("--prefix-cache-bytes", type=click.IntRange(min=0), default=DEFAULT_PREFIX_BYTES, show_default=True,
              help="Memory for the K/V of finished requests' texts: a later prompt of the same scope that "
                   "starts alike (a conversation's next turn, a shared system prompt) reuses it instead of prefilling "
                   "(usage.prompt_tokens_details.cached_tokens says how much); the least recently used goes first. "
                   "0: none.")
@ray_options
def serve(directory, host, port, model_name, provider, draft_provider, threads, max_batch, max_queue, context,
          max_cache_bytes, prefill_chunk, default_max_tokens, k, policy, drafter, confidence_threshold, exact,
          max_body_bytes, api_key, chat_template, seed, ssl_keyfile, ssl_certfile, root_path, allowed_origins,
          forwarded_allow_ips, drain_seconds, access_log, template_seconds, suffix_scope, suffix_file, suffix_tokens,
          prefix_cache_bytes, ray_replicas, ray_min_replicas, ray_max_replicas, ray_target_ongoing_requests, ray_router,
          ray_address, ray_cpus_per_replica, ray_max_replicas_per_node, ray_proxy_location, ray_metrics_port):
    """Serve an artifact DIRECTORY over the OpenAI API: /v1/completions, /v1/chat/completions (streamed or
    not), /v1/models, /health (readiness), /health/live and /metrics."""
    try:
        from ..serve.app import create_app
        from ..serve.lifecycle import DrainingServer, server_config
    except ImportError as exc:
        raise click.ClickException(f"serve needs the 'serve' extra: pip install 'specdeploy[serve]' ({exc})") from exc
    from .. import GenerationConfig, Pipeline
    from ..contract import ContractError
    from ..engines import ProviderError
    from ..runtime.config import ConfigError
    from ..runtime.suffix_store import SuffixStore
    from ..serve.scheduler import Scheduler, context_slots

    check_environment("SPECDEPLOY_CACHE")
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise click.ClickException("--ssl-keyfile and --ssl-certfile: got one of them; expected both, or neither")
    root_path = root_path or ""
    origins = _origins(allowed_origins)
    try:
        config = GenerationConfig(k=k, policy=policy, drafter=drafter, confidence_threshold=confidence_threshold,
                                  exact=exact)
        store = SuffixStore(max_tokens=suffix_tokens)
        pipeline = Pipeline.load(directory, provider=provider, draft_provider=draft_provider, threads=threads,
                                 suffix_file=suffix_file, suffix_store=store,
                                 log=lambda message: click.echo(f"warning: {message}", err=True),
                                 prefix_cache_bytes=prefix_cache_bytes)
        pipeline.check_config(config)  # a drafter that needs a draft model the artifact lacks, exact mode where the
        # target cannot give it: refused now
        if chat_template is not None:
            pipeline.codec.template = _chat_template(pipeline.chat_template, chat_template)
        context = context_slots(pipeline, context, config.max_drafts)
        sizes = pipeline.cache_bytes(max_batch, context, speculative=config.speculative)
        if max_cache_bytes is not None and sizes["total"] > max_cache_bytes:
            raise ConfigError(f"--max-num-seqs {max_batch} rows x --max-model-len {context} slots need "
                              f"{sizes['total'] / 2**20:.1f} MiB of KV cache, over --max-cache-bytes "
                              f"({max_cache_bytes / 2**20:.1f} MiB); lower one of them")
    except (ConfigError, ContractError, ProviderError) as exc:
        raise click.ClickException(str(exc)) from exc
    name = model_name or directory.resolve().name
    app_settings = dict(default_max_tokens=default_max_tokens, max_body_bytes=max_body_bytes, api_key=api_key,
                        allowed_origins=origins, template_seconds=template_seconds)
    if serving_on_ray(ray_replicas, ray_max_replicas, ray_address):
        del pipeline  # each replica loads its own
        serve_on_ray(directory, name, host, port, threads, config,
                     dict(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk, context=context,
                          seed=seed, suffix_scope=suffix_scope, **app_settings),
                     dict(provider=provider, draft_provider=draft_provider, prefix_cache_bytes=prefix_cache_bytes,
                          suffix_tokens=suffix_tokens),
                     dict(replicas=ray_replicas, min_replicas=ray_min_replicas, max_replicas=ray_max_replicas,
                          target_ongoing_requests=ray_target_ongoing_requests, router=ray_router,
                          cpus_per_replica=ray_cpus_per_replica, max_replicas_per_node=ray_max_replicas_per_node,
                          drain_seconds=drain_seconds, metrics_port=ray_metrics_port, address=ray_address,
                          proxy_location=ray_proxy_location),
                     dict(chat_template=chat_template, suffix_file=suffix_file, ssl_keyfile=ssl_keyfile,
                          ssl_certfile=ssl_certfile, root_path=root_path, forwarded_allow_ips=forwarded_allow_ips))
        return
    _log_to_stderr(access_log)
    scheduler = Scheduler(pipeline, config, context, max_batch=max_batch, max_queue=max_queue,
                          prefill_chunk=prefill_chunk, seed=seed)
    app = create_app(pipeline, scheduler, name, suffix_scope=suffix_scope, **app_settings)
    settings = server_config(app, host=host, port=port, root_path=root_path, ssl_keyfile=ssl_keyfile,
                             ssl_certfile=ssl_certfile, forwarded_allow_ips=forwarded_allow_ips)
    try:
        socket = settings.bind_socket()
    except (OSError, SystemExit) as exc:  # uvicorn exits on a port in use
        raise click.ClickException(f"--host {host} --port {port}: cannot listen there ({exc})") from exc
    bound = socket.getsockname()[1]
    scheduler.start()
    scheme = "https" if ssl_certfile else "http"
    click.echo(f"serving {directory} as {name!r} on {scheme}://{host}:{bound}{root_path}/v1 "
               f"(batch {max_batch}, queue {max_queue}, context {context}, KV cache up to "
               f"{sizes['total'] / 2**20:.0f} MiB; {'an API key required' if api_key else 'no API key: any client served'}; "
               f"X-Forwarded-For {'believed from ' + forwarded_allow_ips if forwarded_allow_ips else 'ignored'}; "
               f"suffix index per { {'key': 'API key', 'global': 'server', 'none': 'request'}[suffix_scope]}); "
               f"ready once /health answers 200", err=True)
    server = DrainingServer(settings, app.state.lifecycle, drain_seconds)
    try:
        server.run(sockets=[socket])
    finally:
        scheduler.stop()
        _save_suffix_file(pipeline)
    if server.cut_short:  # a second signal: the requests still open were cut, not drained
        sys.exit(1)


def _save_suffix_file(pipeline) -> None:
    """--suffix-file: the indexes written on the way out; a failure to write is told, never a traceback."""
    try:
        path = pipeline.save_suffix_file()
    except OSError as exc:
        click.echo(f"warning: --suffix-file: not written ({exc})", err=True)
        return
    if path is not None:
        click.echo(f"suffix indexes written to {path}", err=True)


def _origins(given: tuple[str, ...]) -> list[str]:
    """--allowed-origins as given: repeated, comma-separated, or a JSON list (vllm serve's form)."""
    origins = []
    for value in given:
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise click.ClickException(f"--allowed-origins: got {short(value)}; expected a JSON list of origins") from exc
            if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
                raise click.ClickException(f"--allowed-origins: got {short(value)}; expected a JSON list of strings")
            origins += parsed
        else:
            origins += [o.strip() for o in value.split(",") if o.strip()]
    return origins


def _chat_template(artifact, value: str):
    """--chat-template: a file's template, or the template given inline; the artifact's BOS/EOS settings kept.
    A template that does not compile is refused here, not at the first request."""
    from jinja2 import TemplateSyntaxError

    from ..chat_syntax import parse
    from ..runtime.chat import ChatTemplate, ChatTemplateError
    from ..runtime.config import ConfigError

    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a name too long to be a path (ENAMETOOLONG): a template given inline
        is_file = False
    if is_file:
        if path.stat().st_size > TEMPLATE_FILE_LIMIT:
            raise ConfigError(f"--chat-template: {path} is {path.stat().st_size:,} bytes; expected a template of at most "
                              f"{TEMPLATE_FILE_LIMIT:,}")
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ConfigError(f"--chat-template: got {short(value, 80)}; expected a template file, or a Jinja template")
    try:
        parse(text)  # parsing runs none of the template: safe here, and its errors are the clearest
    except TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template: {exc} (line {exc.lineno})") from exc
    except (RecursionError, MemoryError) as exc:  # Jinja's parser recurses once per nested block
        raise ConfigError(f"--chat-template: nested too deeply to compile ({type(exc).__name__}); expected a template "
                          f"whose blocks nest at most a few hundred deep") from exc
    template = ChatTemplate({"chat_template": text, "bos_token": artifact.bos_token, "eos_token": artifact.eos_token,
                             "add_bos_token": artifact.add_bos_token})
    try:
        template.render([{"role": "user", "content": "hello"}])
    except ChatTemplateError as exc:
        raise ConfigError(f"--chat-template: {exc}") from exc
    except ConfigError:  # the template refuses this probe's message: its own choice, not a broken template
        pass
    return template


def _log_to_stderr(access: bool) -> None:
    """The server's log lines (readiness, drain, one per request unless ``access`` is off) on stderr."""
    logger = logging.getLogger("specdeploy")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logging.getLogger("specdeploy.serve.access").setLevel(logging.INFO if access else logging.WARNING)
