"""Scale-out on Ray Serve: a local Ray instance (loopback) runs 2 replicas; requests spread over both."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest
import ray  # the dev extra installs ray[serve]


@pytest.fixture(scope="module")
def ray_server(pair_dir):
    from ray import serve

    from specdeploy.serve.ray_app import application

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(pair_dir, replicas=2, model="pair", threads=1, cpus_per_replica=0.5,
                              options={"max_batch": 4, "context": 96}, config={"k": 3}))
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_the_same_api_and_share_the_requests(ray_server, pipeline):
    from openai import OpenAI

    client = OpenAI(base_url=f"{ray_server}/v1", api_key="none", max_retries=2, timeout=60)
    expected = pipeline.generate(["w5 w6 w7"], _config())[0].text
    for _ in range(4):
        answer = client.completions.create(model="pair", prompt="w5 w6 w7", temperature=0, max_tokens=12,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="pair", prompt="w5 w6 w7", temperature=0, max_tokens=12, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == expected
    servers, deadline = set(), time.monotonic() + 60
    while len(servers) < 2 and time.monotonic() < deadline:
        with urllib.request.urlopen(f"{ray_server}/health", timeout=30) as response:
            servers.add(json.load(response)["server"])
    assert len(servers) == 2  # Ray's proxy sent requests to both replicas


def _config():
    from specdeploy import GenerationConfig

    return GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True)
