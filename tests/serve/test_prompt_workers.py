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


def test_clients_take_turns_for_the_prompt_slots():
    """One client's many slow renders used to put another client's plain completion behind all of them."""
    workers, order = PromptWorkers(seconds=5, workers=1), []
    gate = threading.Event()

    def job(name):
        def run():
            if name == "a0":
                gate.wait(10)  # holds the one slot while everyone else queues
            order.append(name)
        return run

    async def clients():
        first = asyncio.ensure_future(workers.run(job("a0"), "10.0.0.1"))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(workers.run(job(f"a{i}"), "10.0.0.1")) for i in (1, 2, 3)]
        rest.append(asyncio.ensure_future(workers.run(job("b0"), "10.0.0.2")))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, *rest)

    asyncio.run(clients())
    assert order == ["a0", "b0", "a1", "a2", "a3"]


def test_a_request_that_leaves_while_waiting_gives_its_place_on():
    workers, gate, order = PromptWorkers(seconds=5, workers=1), threading.Event(), []

    async def clients():
        first = asyncio.ensure_future(workers.run(lambda: gate.wait(10), "a"))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(workers.run(lambda: order.append("gone"), "b"))
        kept = asyncio.ensure_future(workers.run(lambda: order.append("kept"), "c"))
        await asyncio.sleep(0.05)
        gone.cancel()
        gate.set()
        await asyncio.gather(first, kept)
        assert await workers.run(lambda: 7, "d") == 7 and workers._free == 1

    asyncio.run(clients())
    assert order == ["kept"]


def test_an_address_shares_its_turn_among_its_clients_and_with_other_addresses():
    """Clients behind one address (a NAT, a proxy) take turns among themselves, and all of them together take the
    address's turn: three keys from one address do not get three turns before another address's second job."""
    workers, order, gate = PromptWorkers(seconds=5, workers=1), [], threading.Event()

    def job(name):
        return lambda: (gate.wait(10) if name == "k0" else None, order.append(name))

    async def clients():
        first = asyncio.ensure_future(workers.run(job("k0"), ("10.0.0.1", "key:0")))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(workers.run(job(f"k{i}"), ("10.0.0.1", f"key:{i}"))) for i in (1, 2, 3)]
        rest += [asyncio.ensure_future(workers.run(job(f"x{i}"), ("10.0.0.2", "anonymous"))) for i in (0, 1)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, *rest)

    asyncio.run(clients())
    assert order == ["k0", "x0", "k1", "x1", "k2", "k3"]


def test_clients_behind_one_address_are_told_apart_by_key_or_connection():
    from starlette.requests import Request

    from specdeploy.serve.app import _client

    def request(port, key=None):
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        return Request({"type": "http", "headers": headers, "client": ("10.0.0.9", port)})

    alice, bob, again = _client(request(5000, "alice")), _client(request(5001, "bob")), _client(request(5002, "alice"))
    assert alice[0] == bob[0] == "10.0.0.9" and alice != bob and alice == again  # a key is one client, any connection
    assert _client(request(5003)) != _client(request(5004))  # without a key, each connection is a client
