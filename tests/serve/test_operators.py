"""What an operator and the network hand the server (issue 52): settings from the environment checked as flags are,
signals, half-closed sockets, forwarded-for headers and the access log."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time

import pytest
from click.testing import CliRunner

from specdeploy.cli import main

from .conftest import serving
from .test_process import SPECULATION, _stream, running


@pytest.mark.parametrize("env,args,message", [
    ({"SPECDEPLOY_API_KEY": ""}, [], "the environment variable SPECDEPLOY_API_KEY: got an empty value"),
    ({"SPECDEPLOY_API_KEY": "s3cret\n"}, [], "the environment variable SPECDEPLOY_API_KEY: got a value padded with whitespace"),
    ({}, ["--api-key", " s3cret"], "--api-key: got a value padded with whitespace"),
    ({"SPECDEPLOY_API_KEY": "s3c\x07ret"}, [], "SPECDEPLOY_API_KEY: got a control character (U+0007); expected printable"),
    ({}, ["--served-model-name", ""], "--served-model-name/--model-name: got an empty value"),
    ({}, ["--host", "0.0.0.0\n"], "--host: got a value padded with whitespace"),
    ({}, ["--root-path", "llm/"], "--root-path: got 'llm/'; expected a path prefix such as '/llm'"),
    ({}, ["--allowed-origins", "https://app.example/path"], "expected scheme://host[:port] without a path"),
    ({}, ["--forwarded-allow-ips", "10.0.0.0/8,proxy"], "--forwarded-allow-ips: got 'proxy'; expected IP addresses"),
    ({}, ["--chat-template", ""], "--chat-template: got an empty value"),
    ({"SPECDEPLOY_CACHE": "/var/cache/specdeploy "}, [], "the environment variable SPECDEPLOY_CACHE: got a value padded"),
])
def test_operator_settings_are_checked_wherever_they_come_from(pair_dir, env, args, message):
    """An empty secret used to start the server with no key at all, a padded one to refuse every client."""
    result = CliRunner().invoke(main, ["serve", str(pair_dir), *args], env=env)
    assert result.exit_code == 1 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "s3c" not in result.output  # one line; a secret not echoed


def test_a_deeply_nested_chat_template_is_one_line(pair_dir):
    nested = "{% if true %}" * 5000 + "x" + "{% endif %}" * 5000
    result = CliRunner().invoke(main, ["serve", str(pair_dir), "--chat-template", nested])
    assert result.exit_code == 1 and "--chat-template: nested too deeply to compile" in result.output, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)


def _raw(url: str, request: bytes, half_close: bool) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(request)
        if half_close:
            connection.shutdown(socket.SHUT_WR)  # sent all it has to say; still reading
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    while answer.startswith(b"HTTP/1.1 100 "):  # 1xx answers a client skips (the server's probes that it is there)
        answer = answer.split(b"\r\n\r\n", 1)[1]
    return answer


def test_a_client_that_half_closes_after_sending_gets_its_answer(pipeline):
    body = json.dumps({"model": "tiny", "prompt": "w5 w6", "max_tokens": 4, "temperature": 0}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with serving(pipeline) as (url, _):
        answer = _raw(url, request, half_close=True)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] >= 1
        assert _raw(url, b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n", half_close=True).startswith(b"HTTP/1.1 200")


def test_forwarded_for_is_not_believed_by_default_and_the_access_log_is_escaped(pipeline, caplog):
    forged = b'6.6.6.6" 200 0.001s request_id=forged'
    request = (b"GET /v1/nowhere%0a1.2.3.4:1%20%22GET%20/x HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: " + forged +
               b"\r\nConnection: close\r\n\r\n")
    with caplog.at_level(logging.INFO, logger="specdeploy.serve.access"), serving(pipeline) as (url, _):
        assert _raw(url, request, half_close=False).startswith(b"HTTP/1.1 404")
    line, = [r.getMessage() for r in caplog.records if r.name == "specdeploy.serve.access" and "nowhere" in r.getMessage()]
    assert line.startswith("127.0.0.1:") and "6.6.6.6" not in line and "forged" not in line
    assert "\n" not in line and "/v1/nowhere\\n1.2.3.4:1\\x20\\x22GET\\x20/x" in line


def test_a_second_sigterm_stops_at_once_with_status_1(pair_dir):
    with running([str(pair_dir), "--served-model-name", "pair", "--drain-seconds", "600", *SPECULATION],
                 delay=0.2) as server:
        assert any("no API key: any client served" in line and "X-Forwarded-For ignored" in line for line in server.lines)
        log, events = [], []
        thread = threading.Thread(target=_stream, args=(server.port, "w5 w6", 80, log, events), daemon=True)
        thread.start()
        while not events:  # streaming; at 0.2 s an engine call it has minutes to go
            assert thread.is_alive()
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        while not any("draining for up to 600 s" in line for line in server.lines):
            assert server.process.poll() is None
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=120) == 1, "".join(server.lines)  # exited by its own status, not the signal
    assert "[DONE]" not in events  # cut, not drained
