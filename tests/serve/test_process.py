"""`specdeploy serve` as its own process, as an operator runs it: SIGTERM drains the open streams (each ends with
a final event and [DONE], or an error event, never a silent cut) and the process exits 0; the operator's flags
(--port 0, SPECDEPLOY_API_KEY, TLS, --root-path, --allowed-origins, --served-model-name, --chat-template)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from specdeploy import GenerationConfig

# the server's engines each take DELAY more per call, so that its streams last long enough to be signalled mid-way
LAUNCHER = """
import sys, time
from specdeploy.engines.base import Engine

infer = Engine.infer

def slow(self, *args, **kwargs):
    time.sleep(float(sys.argv[1]))
    return infer(self, *args, **kwargs)

Engine.infer = slow
from specdeploy.cli import main
main(sys.argv[2:], prog_name="specdeploy")
"""
SPECULATION = ["--k", "3", "--policy", "fixed", "--drafter", "model"]


class ServerProcess:
    """A `specdeploy serve` process; its stderr lines are collected as they come."""

    def __init__(self, args: list[str], delay: float = 0.0, env: dict | None = None):
        self.process = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(delay), "serve", *args, "--port", "0"],
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.process.stderr.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 90
        while not (bound := [m for line in self.lines for m in re.findall(r"on (https?)://127.0.0.1:(\d+)(\S*)/v1", line)]):
            assert self.process.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)
        self.scheme, port, self.root = bound[0]
        self.port = int(port)

    def wait_ready(self, context=None) -> None:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.scheme}://127.0.0.1:{self.port}/health", timeout=5, context=context):
                    return
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, "".join(self.lines)
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@contextlib.contextmanager
def running(args, delay: float = 0.0, env: dict | None = None, context=None):
    server = ServerProcess(args, delay, env)
    try:
        server.wait_ready(context)
        yield server
    finally:
        server.stop()


def _stream(port: int, prompt: str, max_tokens: int, log: list, events: list) -> None:
    """A streamed completion over plain HTTP: every data line, in order, into ``events`` (and ``log``)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/v1/completions", body=json.dumps({
        "model": "pair", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True}), headers={"Content-Type": "application/json"})
    for line in connection.getresponse():
        if line.startswith(b"data: "):
            events.append(line[6:].strip().decode())
            log.append((prompt, events[-1]))
    connection.close()


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e.startswith("{") and json.loads(e).get("choices"))


PROMPTS = ["w5 w6", "w10 w11", "w20 w21 w22", "w30"]


def _four_streams(server: ServerProcess, max_tokens: int):
    log, events = [], {p: [] for p in PROMPTS}
    threads = [threading.Thread(target=_stream, args=(server.port, p, max_tokens, log, events[p])) for p in PROMPTS]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not all(_text(e) for e in events.values()):  # each has had tokens
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), events
        time.sleep(0.005)
    return log, events, threads


def test_sigterm_lets_open_streams_finish_refuses_new_requests_and_exits_0(pair_dir, pipeline):
    with running([str(pair_dir), "--served-model-name", "pair", "--drain-seconds", "60", *SPECULATION], delay=0.02) as server:
        log, events, threads = _four_streams(server, 60)
        log.append("SIGTERM")
        server.process.send_signal(signal.SIGTERM)
        base = f"http://127.0.0.1:{server.port}"
        deadline = time.monotonic() + 10
        while _get(f"{base}/health") != 503:  # the drain begins on the server's loop
            assert time.monotonic() < deadline
        assert _get(f"{base}/health/live") == 200 and any(t.is_alive() for t in threads)  # still streaming
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps({"model": "pair", "prompt": "w5"}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503 and json.load(refused.value)["error"]["code"] == "shutting_down"
        for thread in threads:
            thread.join()
        assert server.process.wait(timeout=60) == 0, "".join(server.lines)
    config = GenerationConfig(k=3, max_new_tokens=60, ignore_eos=True)
    for prompt, got in events.items():
        assert got[-1] == "[DONE]" and json.loads(got[-2])["choices"][0]["finish_reason"] == "length"
        assert _text(got) == pipeline.generate([prompt], config)[0].text
        assert log.index((prompt, "[DONE]")) > log.index("SIGTERM")  # they were running when the signal came
    assert any("SIGTERM: draining" in line for line in server.lines)


def test_sigterm_ends_streams_still_open_after_the_drain_with_a_final_event_and_an_error(pair_dir, pipeline):
    with running([str(pair_dir), "--served-model-name", "pair", "--drain-seconds", "0.3", *SPECULATION], delay=0.02) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=120)
        seen, raised = [], []

        def official():  # the openai client reads the final chunk, then raises on the error event
            try:
                for chunk in client.completions.create(model="pair", prompt="w40 w41", max_tokens=80, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    seen.append(chunk.choices[0])
            except openai.APIError as exc:
                raised.append(exc)

        thread = threading.Thread(target=official)
        thread.start()
        log, events, threads = _four_streams(server, 80)
        while not seen:
            time.sleep(0.005)
        server.process.send_signal(signal.SIGTERM)
        for waiting in (*threads, thread):
            waiting.join()
        assert server.process.wait(timeout=60) == 0, "".join(server.lines)
    config = GenerationConfig(k=3, max_new_tokens=80, ignore_eos=True)
    for prompt, got in events.items():
        final, error = json.loads(got[-3]), json.loads(got[-2])["error"]
        assert got[-1] == "[DONE]" and final["choices"][0]["finish_reason"] == "abort"
        assert error["code"] == "shutting_down" and "--drain-seconds (0.3 s)" in error["message"]
        assert pipeline.generate([prompt], config)[0].text.startswith(_text(got)) and _text(got)  # a prefix, then the end
    assert seen[-1].finish_reason == "abort" and "shutting down" in str(raised[0])
    assert any("ending 5 requests still open" in line for line in server.lines)


def _certificate(tmp_path) -> tuple[str, str]:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    return str(key), str(cert)


def test_the_operators_flags(pair_dir, tmp_path):
    key, cert = _certificate(tmp_path)
    context = ssl.create_default_context(cafile=cert)
    context.check_hostname = False
    args = [str(pair_dir), "--served-model-name", "qwen-pair", "--ssl-keyfile", key, "--ssl-certfile", cert,
            "--root-path", "/llm", "--allowed-origins", "https://app.example,https://other.example",
            "--chat-template", "{% for m in messages %}{{ m['content'] }} {% endfor %}w15 ", "--k", "3"]
    with running(args, env={"SPECDEPLOY_API_KEY": "from-the-env"}, context=context) as server:
        assert (server.scheme, server.root) == ("https", "/llm") and server.port > 0  # --port 0: the bound port, printed
        base = f"https://127.0.0.1:{server.port}"

        def call(path, method="GET", headers=None, body=None):
            request = urllib.request.Request(f"{base}{path}", method=method, headers=headers or {}, data=body)
            try:
                with urllib.request.urlopen(request, timeout=30, context=context) as response:
                    return response.status, response.headers, response.read()
            except urllib.error.HTTPError as error:
                return error.code, error.headers, error.read()

        assert call("/v1/models")[0] == 401 and call("/health")[0] == 200  # a proxy that strips /llm sends these
        status, _, body = call("/v1/models", headers={"Authorization": "Bearer from-the-env"})
        assert status == 200 and json.loads(body)["data"][0]["id"] == "qwen-pair"
        status, headers, _ = call("/v1/chat/completions", "OPTIONS", {"Origin": "https://app.example",
                                                                     "Access-Control-Request-Method": "POST"})
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"  # preflight: no key
        assert call("/v1/models", "OPTIONS", {"Origin": "https://evil.example",
                                              "Access-Control-Request-Method": "GET"})[0] == 400
        status, _, body = call("/v1/chat/completions", "POST", {"Authorization": "Bearer from-the-env",
                                                                "Content-Type": "application/json"},
                               json.dumps({"model": "qwen-pair", "messages": [{"role": "user", "content": "w5 w6"}],
                                           "max_tokens": 3}).encode())
        assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == 3  # the template given on the command line
    assert not any("from-the-env" in line for line in server.lines)


def test_the_suffix_indexes_are_written_on_the_way_out_and_read_at_the_next_start(pair_dir, tmp_path):
    cache = tmp_path / "suffix.json"
    args = [str(pair_dir), "--suffix-file", str(cache), "--suffix-scope", "global", *SPECULATION]
    with running(args) as server:
        assert any("suffix index per server" in line for line in server.lines)
        _stream(server.port, "w5 w6 w7", 6, [], [])
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    saved = json.loads(cache.read_text())
    assert [len(texts) for texts in saved["scopes"].values()] == [1]
    with running(args) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
            tokens = [line for line in response.read().decode().splitlines()
                      if line.startswith("specdeploy_suffix_index_tokens ")]
        assert float(tokens[0].split()[1]) == len(saved["scopes"]["global"][0]) > 0
    cache.write_text("not an index")
    with running(args) as server:
        warned = [line for line in server.lines if "suffix index" in line and "not JSON" in line]
        assert len(warned) == 1 and "starting with an empty index" in warned[0]
        assert "will not be saved" in warned[0]
        _stream(server.port, "w5 w6 w7", 6, [], [])
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    assert cache.read_text() == "not an index"  # the user's file, refused at start, is never overwritten at exit
    assert not any("suffix indexes written" in line for line in server.lines)
