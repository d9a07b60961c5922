"""The Ray tools' reports, from records of the shape their runs keep: every request accounted for, the goals judged
from pooled figures (running them starts Ray clusters: tests/serve/test_ray.py does that once)."""

from __future__ import annotations

import json

import pytest

from tools.bench_ray_routing import figures
from tools.bench_ray_routing import report as routing_report
from tools.ray_failover import report as failover_report
from tools.ray_load import accounted


def _turn(tenant: int, turn: int, prompt: int, cached: int, accepted: int, tokens: int = 64) -> dict:
    speculative = {"accepted_tokens": accepted, "drafted_tokens": 2 * accepted}
    return {"tenant": tenant, "turn": turn, "ok": True, "prompt_tokens": prompt, "cached_tokens": cached,
            "completion_tokens": tokens, "speculative": speculative}


def test_routing_figures_pool_the_rounds_and_judge_both_goals():
    scope = [_turn(0, 1, 200, 0, 10), _turn(0, 2, 400, 200, 30), {"tenant": 1, "turn": 1, "ok": False, "error": "x"}]
    one = [_turn(0, 1, 200, 0, 10), _turn(0, 2, 400, 210, 30)]
    default = [_turn(0, 1, 200, 0, 10), _turn(0, 2, 400, 0, 20)]
    f = figures(scope, seconds=2.0)
    assert (f["requests"], f["failed"], f["prompt_tokens"], f["completion_tokens"]) == (3, 1, 600, 128)
    assert f["hit_rate"] == 200 / 600 and f["later_hit_rate"] == 0.5 and f["accepted_per_request"] == 20
    assert f["tok_s"] == 64.0
    runs = [{"setup": "scope", "seconds": 1.0, "requests": scope[:2]}, {"setup": "scope", "seconds": 1.0, "requests": scope[:2]},
            {"setup": "default", "seconds": 3.0, "requests": default}, {"setup": "one", "seconds": 2.0, "requests": one}]
    text = routing_report(runs)
    assert "| scope | 4/4 | 1,200 | 33.3% (50.0%) | 20.0 (40.0) | 256 | 128.00 |" in text  # two rounds pooled
    assert "scope's hit rate over one replica's: 0.95 (goal >= 0.90: met)" in text
    assert "scope's tok/s over the default router's: 3.00 (goal >= 1.2: met)" in text


def test_failover_report_accounts_for_every_request_and_the_times():
    def request(tenant, start, end, outcome, stream=True, retry=None):
        record = {"tenant": tenant, "stream": stream, "start": start, "end": end, "outcome": outcome, "tokens": 48}
        return {**record, "retry": retry} if retry else record

    requests = [request("a", 0, 5, "ok"), request("a", 9, 11, "replica_lost", retry={"outcome": "ok", "end": 12.5}),
                request("a", 12, 14, "ok"), request("b", 8, 12, "ok", stream=False), request("b", 30, 33, "ok")]
    events = {"commands": ["ray start --head", "ray start --address X"], "killed": 10.0, "restarting": 20.0,
              "restarted": 25.0, "rejoined": 29.0}
    text = failover_report({"events": events, "requests": requests, "load": 3.0})
    assert accounted(requests) in text and "failed otherwise: 0" in text
    assert "refused as replica_lost 1 (1 streams ended by an error event, 0 whole requests answered 503), 1 of them " \
           "answered on their one retry" in text
    assert "in flight at the kill (10.0 s): 2 requests, of which 1 on the killed node" in text
    assert "answered again (a retry, or its next request) 2.5 s after the kill" in text
    assert "its replica answered 4.0 s later" in text
    assert "| before the kill | 10.0 | 1 | 48 | 4.8 |" in text


def test_a_result_page_is_the_printed_text_under_its_provenance_and_the_record_beside_it(tmp_path):
    from tools.provenance import header, provenance, write_page

    facts = provenance("tools.ray_failover")
    write_page(tmp_path / "ray" / "failover", "Ray Serve: a node killed under load", facts, "| a | b |", {"requests": [1]})
    assert (tmp_path / "ray" / "failover.md").read_text() == header("Ray Serve: a node killed under load", facts) + \
        "\n| a | b |\n"
    assert json.loads((tmp_path / "ray" / "failover.json").read_text()) == {"provenance": facts, "requests": [1]}


def test_a_nodes_ports_are_free_consecutive_and_below_the_kernels_ephemeral_range(monkeypatch):
    """A port in the ephemeral range may be handed to any client's outgoing connection between the probe and Ray's
    bind (a parallel test run's clients connect all the time): a node's ports, its worker range included, lie below."""
    import socket

    from tools import ray_cluster

    ports = ray_cluster._free_ports("port", "node-manager-port", "min-worker-port", workers=ray_cluster.WORKER_PORTS)
    first = ports["port"]
    assert list(ports.values()) == [first, first + 1, first + 2]
    assert 20000 <= first and first + 2 + ray_cluster.WORKER_PORTS <= ray_cluster._ephemeral_start()
    with socket.socket() as taken:  # a port taken is never handed out
        taken.bind(("127.0.0.1", first))
        starts = iter([first - 20000, first + 1 - 20000])
        monkeypatch.setattr(ray_cluster.secrets, "randbelow", lambda _: next(starts))
        assert ray_cluster._free_ports("a", "b")["a"] == first + 1
    monkeypatch.setattr(ray_cluster, "_ephemeral_start", lambda: 20010)
    with pytest.raises(RuntimeError, match="no room for 66 ports between 20000 and the ephemeral range's start"):
        ray_cluster._free_ports("a", "b", "c", workers=64)
