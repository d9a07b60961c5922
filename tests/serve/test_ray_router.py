"""Routing by scope under Ray Serve: rendezvous hashing under bounded loads (``ray_router.ranked``), and the key a
request from Ray's HTTP proxy carries."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest

from specdeploy.serve.ray_router import preference, ranked, request_key
from specdeploy.serve.scopes import key_scope

KEYS = [key_scope(f"Bearer tenant-{i}") for i in range(200)]


def test_a_key_keeps_its_replica_and_the_keys_spread_over_all():
    loads = {"r0": 0, "r1": 0, "r2": 0}
    firsts = Counter(ranked(key, loads)[0][0] for key in KEYS)
    assert all(ranked(key, loads)[0][0] == ranked(key, dict(loads))[0][0] for key in KEYS)  # the same each time
    assert set(firsts) == {"r0", "r1", "r2"} and min(firsts.values()) > len(KEYS) / 3 * 0.6, firsts


def test_a_replica_leaving_or_joining_moves_only_the_keys_it_held_or_takes():
    before = {key: preference(key, ["a", "b", "c", "d"])[0] for key in KEYS}
    without_c = {key: preference(key, ["a", "b", "d"])[0] for key in KEYS}
    with_e = {key: preference(key, ["a", "b", "c", "d", "e"])[0] for key in KEYS}
    assert all(without_c[key] == before[key] for key in KEYS if before[key] != "c")
    assert all(with_e[key] in (before[key], "e") for key in KEYS)
    assert 0 < sum(with_e[key] == "e" for key in KEYS) < len(KEYS) / 2


def test_a_replica_over_its_bound_is_passed_over_for_the_next_in_the_keys_order():
    key = KEYS[0]
    first, second = preference(key, ["r0", "r1"])
    # 3 in flight on its replica, 0 on the other: the bound is ceil(1.25 * (3 + 1) / 2) = 3, so the other first
    assert ranked(key, {first: 3, second: 0}) == [[second], [first]]
    # 2 in flight: the bound is ceil(1.25 * 3 / 2) = 2, reached; 1 in flight: ceil(1.25 * 2 / 2) = 2, under it
    assert ranked(key, {first: 2, second: 0}) == [[second], [first]]
    assert ranked(key, {first: 1, second: 0}) == [[first], [second]]
    assert ranked(key, {first: 1, second: 0}, load_factor=1.0) == [[second], [first]]  # an even share: ceil(2 / 2) = 1
    four = preference(key, ["r0", "r1", "r2", "r3"])
    loads = {four[0]: 9, four[1]: 9, four[2]: 0, four[3]: 1}  # bound ceil(1.25 * 20 / 4) = 7
    assert ranked(key, loads) == [[four[2]], [four[3]], [four[0], four[1]]]


def test_a_key_stays_where_its_last_request_went_while_that_replica_is_under_its_bound():
    key = KEYS[0]
    first, second = preference(key, ["r0", "r1"])
    assert ranked(key, {first: 0, second: 0}, home=second) == [[second], [first]]  # its state is there now
    assert ranked(key, {first: 0, second: 3}, home=second) == [[first], [second]]  # over the bound: spills again
    assert ranked(key, {first: 0, second: 0}, home="gone") == [[first], [second]]  # a replica no longer running


def test_the_router_counts_the_requests_it_sent_until_they_end_and_remembers_each_keys_replica():
    from types import SimpleNamespace

    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from specdeploy.serve.ray_router import ScopeRouter

    router = ScopeRouter.__new__(ScopeRouter)  # its bookkeeping alone: Ray builds the rest around a deployment
    router._use_replica_queue_len_cache = False  # Ray's own cache, which the base class keeps beside
    router.initialize_state(load_factor=1.5)
    a, b = SimpleNamespace(unique_id="a"), SimpleNamespace(unique_id="b")

    def sent(replica, token: str | None = None) -> None:  # as Ray calls the hooks: sent, then taken unless refused
        router.on_send_request(replica)
        if token is not None:
            request = PendingRequest(args=[_proxy_request([(b"authorization", f"Bearer {token}".encode())])],
                                     kwargs={}, metadata=RequestMetadata("id", "internal-id"))
            router.on_request_routed(request, replica, None)

    sent(a, "k1")
    sent(a, "k2")
    sent(b)  # refused by b (full): counted until Ray completes it, no key moved
    sent(b, "k1")  # k1 spilled to b: its state is there now
    assert router.loads == {"a": 2, "b": 2} and router.homes[key_scope("Bearer k1")] == "b"
    assert router.homes[key_scope("Bearer k2")] == "a" and router.load_factor == 1.5
    for replica in (a, b, b):
        router.on_request_completed(replica, "internal-id")
    assert router.loads == {"a": 1}


def test_a_load_factor_below_an_even_share_is_refused():
    with pytest.raises(ValueError, match="load_factor: got 0.5; expected at least 1"):
        ranked(KEYS[0], {"r0": 0}, load_factor=0.5)


def _proxy_request(headers: list[tuple[bytes, bytes]]) -> bytes:
    """What Ray's HTTP proxy sends a replica: its ASGI scope in a StreamingHTTPRequest, pickled."""
    from ray.serve._private.common import StreamingHTTPRequest

    return pickle.dumps(StreamingHTTPRequest({"type": "http", "path": "/v1/completions", "headers": headers},
                                             proxy_actor_name="proxy"))


def test_the_key_of_a_request_from_rays_proxy_is_its_bearer_tokens_scope():
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    def pending(headers: list[tuple[bytes, bytes]] | None, raw=None) -> PendingRequest:
        argument = raw if raw is not None else _proxy_request(headers)
        return PendingRequest(args=[argument], kwargs={}, metadata=RequestMetadata("id", "internal-id"))

    assert request_key(pending([(b"authorization", b"Bearer k1")])) == key_scope("Bearer k1")
    assert request_key(pending([(b"content-type", b"application/json")])) == "anonymous"
    assert request_key(pending(None, raw={"a": "handle's own argument"})) is None  # a Python handle's request
    assert request_key(pending(None, raw=b"not a pickle")) is None
    assert request_key(None) is None
