"""Clients for the Ray tools: tenants (an API key each) sending completions one after another, each request's outcome
kept, and where each tenant's requests are routed (``placement``)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

MODEL = "pair"
PROMPTS = ("def fibonacci(n):", "Write a haiku about the sea.", "SELECT name FROM users WHERE", "The capital of France")


class Tenants:
    """``keys``' clients, each sending completions (streamed and whole in turn, ``max_tokens`` new tokens) one after
    another from ``start()`` until ``stop()``; a request refused as ``replica_lost`` is sent again once, as a client
    would. ``requests``: one record each, times in seconds from ``began``."""

    def __init__(self, url: str, keys: list[str], max_tokens: int, began: float):
        self.url, self.max_tokens, self.began = url, max_tokens, began
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(key,), daemon=True) for key in keys]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, key: str) -> None:
        import openai

        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=600)
        number = 0
        while not self._stop.is_set():
            stream, prompt = number % 2 == 0, PROMPTS[number % len(PROMPTS)]
            record = {"tenant": key, "stream": stream, **self._send(client, prompt, stream)}
            if record["outcome"] == "replica_lost":
                record["retry"] = self._send(client, prompt, stream)
            self.requests.append(record)
            number += 1

    def _send(self, client, prompt: str, stream: bool) -> dict:
        """One completion: its start and end, outcome ("ok", "replica_lost", or what else went wrong) and tokens."""
        import openai

        start, tokens = time.monotonic() - self.began, 0
        try:
            if stream:
                for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens,
                                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}):
                    tokens = chunk.usage.completion_tokens if chunk.usage else tokens
            else:
                tokens = client.completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens, temperature=0,
                                                   extra_body={"ignore_eos": True}).usage.completion_tokens
            outcome = "ok" if tokens == self.max_tokens else f"{tokens} of {self.max_tokens} tokens"
        except openai.APIError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            outcome = (body.get("error", body) or {}).get("code") or exc.code or f"{type(exc).__name__}: {exc}"
        return {"start": start, "end": time.monotonic() - self.began, "outcome": outcome, "tokens": tokens}


def accounted(requests: list[dict]) -> str:
    """Every request accounted for, in a line: answered whole, refused as lost (then answered on retry or not), failed
    otherwise (with what)."""
    lost = [r for r in requests if r["outcome"] == "replica_lost"]
    other = sorted({r["outcome"] for r in requests if r["outcome"] not in ("ok", "replica_lost")})
    return (f"requests: {len(requests)}; answered whole {sum(r['outcome'] == 'ok' for r in requests)}; refused as "
            f"replica_lost {len(lost)} ({sum(r['stream'] for r in lost)} streams ended by an error event, "
            f"{sum(not r['stream'] for r in lost)} whole requests answered 503), "
            f"{sum(r['retry']['outcome'] == 'ok' for r in lost)} of them answered on their one retry; failed "
            f"otherwise: {sum(r['outcome'] not in ('ok', 'replica_lost') for r in requests)}"
            + (f" ({', '.join(other)})" if other else ""))


def placement(url: str, keys: list[str]) -> dict[str, tuple[str, str]]:
    """Each key's (replica, node), as /health answers a request carrying it; {} while the app is not up."""
    placed = {}
    for key in keys:
        request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = json.load(response)
        except OSError:
            return {}
        placed[key] = (body["replica"], body["node"])
    return placed


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def replica_options(parser, context: int) -> None:
    """The options every Ray tool takes: the artifact its replicas serve, their threads and context, and its page."""
    from tools import arguments

    parser.add_argument("--artifact", type=arguments.artifact, required=True, help="an artifact dir")
    parser.add_argument("--threads", type=arguments.integer(1), default=1, help="ONNX Runtime threads a replica")
    parser.add_argument("--context", type=arguments.integer(16), default=context, help="--max-model-len of a replica")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json (a results page)")
