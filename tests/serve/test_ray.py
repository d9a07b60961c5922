"""Scale-out on a Ray cluster as operators run it: a head and a worker node started with `ray start` as processes of
their own (tools/ray_cluster.py), `specdeploy serve --ray-address ...` deploying a replica on each; each client's
requests go to one replica (its prefix cache reused); the worker node killed mid-load: its requests in flight are
answered with a retryable error, new ones served by the survivor; the node restarted takes requests again."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from specdeploy import GenerationConfig
from specdeploy.runtime.config import ConfigError
from specdeploy.serve.ray_app import RayOptions
from tools.ray_cluster import LocalCluster, Node

DELAY = "0.015"  # seconds each engine call of a replica takes more, so that its requests last long enough to be cut
# every Python process of the cluster runs this at start (sitecustomize): Engine.infer made slower once imported
SLOWER = """
import importlib.abc, importlib.util, os, sys, time

class _Slower(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "specdeploy.engines.base":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            infer = module.Engine.infer

            def slower(self, *args, **kwargs):
                time.sleep(float(os.environ["SPECDEPLOY_TEST_ENGINE_DELAY"]))
                return infer(self, *args, **kwargs)

            module.Engine.infer = slower

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("SPECDEPLOY_TEST_ENGINE_DELAY"):
    sys.meta_path.insert(0, _Slower())
"""
KEYS = [f"tenant-{i}" for i in range(12)]


@dataclass
class Deployed:
    url: str
    cluster: LocalCluster
    worker: Node
    head_node: str  # Ray node ids (their first 12 hex digits, as /health gives them)
    worker_node: str


@pytest.fixture(scope="module")
def deployed(pair_dir):
    root = Path(tempfile.mkdtemp(prefix="sdray-", dir="/tmp"))  # short: Ray's socket paths live under it
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SLOWER)
    cluster = LocalCluster(root / "cluster", paths=(str(root / "site"),), variables={"SPECDEPLOY_TEST_ENGINE_DELAY": DELAY})
    server = None
    try:
        head = cluster.start()
        worker = cluster.add_worker()
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "specdeploy.cli", "serve", str(pair_dir), "--ray-address", cluster.address,
             "--ray-replicas", "2", "--ray-max-replicas-per-node", "1", "--ray-proxy-location", "HeadOnly",
             "--ray-cpus-per-replica", "0.5", "--threads", "1", "--port", str(port), "--served-model-name", "pair",
             "--max-num-seqs", "8", "--max-model-len", "96", "--k", "3", "--policy", "fixed", "--drafter", "model"],
            env=cluster.env, stdout=subprocess.DEVNULL, stderr=(root / "serve.log").open("wb"))
        url = f"http://127.0.0.1:{port}"
        head_node, worker_node = cluster.node_id(head)[:12], cluster.node_id(worker)[:12]
        # it returns once both replicas answer (a client routed meanwhile would stay where it was first sent)
        assert server.wait(timeout=300) == 0, (root / "serve.log").read_text()[-3000:]
        assert {where[1] for where in _placement(url).values()} == {head_node, worker_node}
        yield Deployed(url, cluster, worker, head_node, worker_node)
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=30)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_replicas_on_two_nodes_serve_the_api_and_keep_each_clients_requests_on_one(deployed, pipeline):
    expected = pipeline.generate(["w5 w6 w7"], GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True))[0].text
    placement = _placement(deployed.url)
    assert all(_placement(deployed.url)[key] == placement[key] for key in KEYS[:4])  # the same replica each time
    for key in KEYS[:4]:  # a conversation's second turn starts where its first ended: on the same replica, reused
        client = _client(deployed.url, key)
        first = client.completions.create(model="pair", prompt="w5 w6 w7", temperature=0, max_tokens=12,
                                          extra_body={"ignore_eos": True})
        assert first.choices[0].text == expected
        second = client.completions.create(model="pair", prompt="w5 w6 w7" + first.choices[0].text + " w9",
                                           temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
        assert second.usage.prompt_tokens_details.cached_tokens > 0, key
    streamed = "".join(c.choices[0].text for c in _client(deployed.url, KEYS[0]).completions.create(
        model="pair", prompt="w5 w6 w7", temperature=0, max_tokens=12, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == expected
    replica, node = placement[KEYS[0]]
    request = urllib.request.Request(f"{deployed.url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        metrics = response.read().decode()
    assert f'vllm:num_requests_running{{engine="0",model_name="pair",node="{node}",replica="{replica}"}}' in metrics


def test_a_killed_node_fails_its_requests_in_flight_clearly_and_the_survivor_serves_them_until_it_rejoins(deployed):
    placement = _placement(deployed.url)
    lost = [key for key in KEYS if placement[key][1] == deployed.worker_node][:2]
    kept = [key for key in KEYS if placement[key][1] == deployed.head_node][:2]
    assert lost and kept, placement
    outcomes: dict[str, str] = {}
    begun = threading.Barrier(len(lost) * 2 + len(kept) + 1, timeout=120)
    threads = [threading.Thread(target=_request, args=(deployed.url, key, stream, outcomes, begun))
               for key in lost for stream in (True, False)] + \
              [threading.Thread(target=_request, args=(deployed.url, key, True, outcomes, begun)) for key in kept]
    for thread in threads:
        thread.start()
    begun.wait()  # every request has been answered its first token (streams) or sent (the others)
    time.sleep(0.3)
    deployed.cluster.kill(deployed.worker)
    for thread in threads:
        thread.join(timeout=120)
    # each answered whole or refused as lost (a 503 to retry, an error event ending a stream): never cut silently;
    # the lost node's requests were in flight at the kill, and its clients' requests that the bounded loads sent to the
    # survivor, like the survivor's own, went on
    assert set(outcomes.values()) == {"ok", "replica_lost"} and len(outcomes) == len(threads), outcomes
    for key in lost:  # new requests of the lost replica's clients: to the survivor
        answer = _client(deployed.url, key).completions.create(model="pair", prompt="w8 w9", max_tokens=8,
                                                               temperature=0, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 8
        assert _health(deployed.url, key)[1] == deployed.head_node
    deployed.worker = deployed.cluster.restart(deployed.worker)
    rejoined = deployed.cluster.node_id(deployed.worker)[:12]
    # the clients served by the survivor stay there, where their state is now (so does one first routed while the
    # node was down); clients new since it rejoined go to it too
    newcomers = (f"newcomer-{attempt}-{i}" for attempt in itertools.count() for i in range(4))
    placed: dict[str, tuple[str, str]] = {}
    _until(lambda: rejoined in {where[1] for where in placed.update(_placement(deployed.url, [next(newcomers)])) or
                                placed.values()}, 240, lambda: "a replica on the restarted node")
    back = next(key for key, where in placed.items() if where[1] == rejoined)
    answer = _client(deployed.url, back).completions.create(model="pair", prompt="w8 w9", max_tokens=8, temperature=0,
                                                            extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 8 and _health(deployed.url, back)[1] == rejoined
    assert all(_health(deployed.url, key)[1] == deployed.head_node for key in lost)


def test_ray_options_set_autoscaling_routing_and_draining_and_refuse_what_cannot_run():
    fixed = RayOptions(replicas=3, router="default", drain_seconds=7).deployment(max_batch=8)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["graceful_shutdown_timeout_s"] == 7 and fixed["max_ongoing_requests"] == 8
    assert fixed["request_router_config"]["request_router_class"].endswith("PowerOfTwoChoicesRequestRouter")
    scaled = RayOptions(max_replicas=4, downscale_delay_s=5, max_replicas_per_node=1).deployment(8)
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                            "target_ongoing_requests": 4.0, "downscale_delay_s": 5}
    assert scaled["request_router_config"] == {"request_router_class": "specdeploy.serve.ray_router:ScopeRouter",
                                               "request_router_kwargs": {"load_factor": 1.25}}
    assert "num_replicas" not in scaled and scaled["max_replicas_per_node"] == 1
    assert RayOptions(min_replicas=0, max_replicas=2).deployment(8)["autoscaling_config"]["min_replicas"] == 0
    for bad, message in ((dict(min_replicas=3, max_replicas=2), "min_replicas: got 3; expected at most max_replicas"),
                         (dict(min_replicas=1), "min_replicas: got 1 without max_replicas"),
                         (dict(router="random"), "router: got 'random'; expected one of scope, default"),
                         (dict(load_factor=0.9), "load_factor: got 0.9; expected at least 1"),
                         (dict(replicas=0), "replicas: got 0; expected an integer >= 1")):
        with pytest.raises(ConfigError, match=message):
            RayOptions(**bad)


@pytest.mark.parametrize("args,message", [
    (["--ray-replicas", "2", "--ray-max-replicas", "3"], "--ray-replicas and --ray-max-replicas: got both"),
    (["--ray-replicas", "2", "--chat-template", "{{ messages }}"],
     "--chat-template: not applied by replicas under Ray yet"),
    (["--ray-max-replicas", "2", "--ray-min-replicas", "3"], "Ray min_replicas: got 3; expected at most max_replicas (2)"),
])
def test_serve_under_ray_refuses_what_its_replicas_cannot_run_before_ray_starts(pair_dir, args, message):
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["serve", str(pair_dir), *args])
    assert result.exit_code != 0 and message in result.output, result.output


def test_rays_application_builder_takes_the_args_of_a_serve_config_and_refuses_others(pair_dir):
    from specdeploy.serve.ray_app import app_builder

    application = app_builder({"artifact": str(pair_dir), "model": "pair", "threads": "1",
                               "ray": {"replicas": 3, "router": "default"}, "options": {"max_batch": 4}})
    assert application._bound_deployment.num_replicas == 3
    for args, message in (({"model": "pair"}, "got no artifact"), ({"artifact": "a", "replicas": 2}, "got replicas"),
                          ({"artifact": "a", "ray": {"nodes": 2}}, "ray: got nodes")):
        with pytest.raises(ConfigError, match=message):
            app_builder(args)


def _request(url: str, key: str, stream: bool, outcomes: dict, begun: threading.Barrier) -> None:
    """A 60-token completion for ``key``; its outcome ("ok", or the error's code) into ``outcomes``."""
    name = f"{key} {'stream' if stream else 'whole'}"
    client = _client(url, key)
    try:
        if stream:
            chunks = iter(client.completions.create(model="pair", prompt="w5 w6 w7", max_tokens=60, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True}))
            next(chunks)
            begun.wait()
            usage = [chunk.usage for chunk in chunks][-1]
        else:
            threading.Timer(0.2, begun.wait).start()  # sent by then
            usage = client.completions.create(model="pair", prompt="w5 w6 w7", max_tokens=60, temperature=0,
                                              extra_body={"ignore_eos": True}).usage
        outcomes[name] = "ok" if usage.completion_tokens == 60 else f"{usage.completion_tokens} tokens"
    except openai.APIError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        outcomes[name] = (body.get("error", body) or {}).get("code") or exc.code or f"{type(exc).__name__}: {exc}"


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _health(url: str, key: str) -> tuple[str, str]:
    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.load(response)
    return body["replica"], body["node"]


def _placement(url: str, keys: list[str] = KEYS) -> dict[str, tuple[str, str]]:
    """Each key's (replica, node), as /health answers a request carrying it ({} while the app is not up)."""
    try:
        return {key: _health(url, key) for key in keys}
    except OSError:
        return {}


def _until(condition, seconds: float, what) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what()}"
        time.sleep(1)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
