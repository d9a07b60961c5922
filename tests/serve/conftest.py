"""A server on 127.0.0.1, started by the test, over a tiny artifact; the official openai client talks to it."""

from __future__ import annotations

import contextlib

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.chat import ChatTemplate

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3 {% endif %}")


APP_OPTIONS = ("default_max_tokens", "max_body_bytes", "api_key", "allowed_origins", "template_seconds", "suffix_scope")


@contextlib.contextmanager
def serving(pipeline, start_scheduler: bool = True, model: str = "tiny", ready: bool = True, **options):
    """Yield (base URL, scheduler) of a running server; ``options`` go to the Scheduler (max_batch, ...) and to
    ``create_app`` (APP_OPTIONS; by default 16 max_tokens and a 1 MiB body limit)."""
    from specdeploy.serve.app import create_app
    from specdeploy.serve.background import serve_in_thread
    from specdeploy.serve.scheduler import Scheduler

    # drafting at a known K, so that speculation is exercised on these tiny models, where a draft call costs what a
    # target call does (the default, the cost policy, would find drafting by the model does not pay)
    config = options.pop("config", GenerationConfig(k=3, policy="fixed", drafter="model"))
    capacity = options.pop("capacity", 96)
    app_options = {"default_max_tokens": 16, "max_body_bytes": 2**20}
    app_options.update({name: options.pop(name) for name in APP_OPTIONS if name in options})
    scheduler = Scheduler(pipeline, config, capacity, **options)
    app = create_app(pipeline, scheduler, model, **app_options)
    if start_scheduler:
        scheduler.start()
    try:
        with serve_in_thread(app) as url:
            if start_scheduler and ready:
                wait_ready(url)
            yield url, scheduler
    finally:
        scheduler.stop()


def wait_ready(url: str, limit: float = 60.0) -> None:
    """Until /health says the server is ready (its engines warm, its chat template compiled)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + limit
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as error:
            if error.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.02)


@contextlib.contextmanager
def slowed(pipeline, seconds: float):
    """Each target call of ``pipeline`` takes ``seconds`` more while the block runs: requests that last."""
    import time

    infer_impl = pipeline.target.infer_impl

    def slow(*args):
        time.sleep(seconds)
        return infer_impl(*args)

    pipeline.target.infer_impl = slow
    try:
        yield
    finally:
        del pipeline.target.infer_impl  # the class's method again


def metrics(url: str) -> dict[str, float]:
    """/metrics as {series with its labels: value}."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"}


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    loaded = Pipeline.load(pair_dir)
    loaded.codec.template = ChatTemplate({"chat_template": CHAT_TEMPLATE})
    return loaded


@pytest.fixture(scope="module")
def server(pipeline):
    with serving(pipeline, max_batch=8, max_queue=32, prefill_chunk=3) as (url, scheduler):  # chunks: 2 cycles or more
        yield url, scheduler


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=60)
