"""serve/prompts.py: a prompt job that outlives its request, and even the server's event loop, ends quietly."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specdeploy.serve.prompts import PromptTimeout, PromptWorkers


def test_a_job_that_ends_after_the_loop_closed_raises_nothing_in_its_thread(monkeypatch):
    release, failures = threading.Event(), []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    workers = PromptWorkers(seconds=0.05, workers=1)

    def slow_job():
        release.wait(10)
        raise RuntimeError("the template failed after its request was answered")

    loop = asyncio.new_event_loop()
    with pytest.raises(PromptTimeout):
        loop.run_until_complete(workers.run(slow_job))
    loop.close()  # the server stops while the job still runs
    (thread,) = [t for t in threading.enumerate() if t.name == "specdeploy-prompt"]
    release.set()
    thread.join(10)
    assert not thread.is_alive() and failures == []


def test_a_jobs_result_and_exception_reach_the_request():
    workers = PromptWorkers(seconds=5, workers=2)

    def fails():
        raise ValueError("bad messages")

    async def both():
        assert await workers.run(lambda: 42) == 42
        with pytest.raises(ValueError, match="bad messages"):
            await workers.run(fails)

    asyncio.run(both())
