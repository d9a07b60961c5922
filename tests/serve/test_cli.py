"""`specdeploy serve` as a user starts it: a process that answers, and clear refusals before it listens."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from specdeploy.cli import main


def test_serve_answers_from_its_own_process(pair_dir):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "specdeploy.cli", "serve", str(pair_dir), "--port", str(port),
                                "--max-batch", "2", "--model-name", "pair"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    assert json.load(response)["status"] == "ok"
                break
            except OSError:
                assert process.poll() is None, process.stderr.read()
                assert time.monotonic() < deadline, "serve did not start listening"
                time.sleep(0.2)
        body = json.dumps({"model": "pair", "prompt": "w5 w6", "max_tokens": 5, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] <= 5 and answer["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "serving" in process.stderr.read()


@pytest.mark.parametrize("args,message", [
    (["--context", "5000"], "--max-model-len/--context: got 5000; the artifact was exported with capacity 96"),
    (["--max-cache-bytes", "1000"], "over --max-cache-bytes"),
    (["--k", "-1"], "k: got -1; expected an integer >= 0"),
])
def test_serve_refuses_bad_settings_before_listening(pair_dir, args, message):
    result = CliRunner().invoke(main, ["serve", str(pair_dir), *args])
    assert result.exit_code != 0 and message in result.output, result.output


def test_serve_refuses_exact_mode_on_a_target_that_cannot_give_it_before_listening(pair_dir, tmp_path):
    """An explicit graph from before slot attention (its manifest lacks ``slot_attention``; here taken out of a new
    one's) scores a call's own keys apart from the cache's."""
    import shutil

    older = shutil.copytree(pair_dir, tmp_path / "older")
    manifest = json.loads((older / "manifest.json").read_text())
    for model in manifest["models"].values():
        del model["slot_attention"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["serve", str(older), "--exact"])
    assert result.exit_code != 0 and "exact: the target's graph is an older exporter's explicit form" in result.output, \
        result.output


@pytest.mark.parametrize("args,message", [
    (["--max-queue", "0"], "0 is not in the range x>=1"),
    (["--context", "2"], "--max-model-len/--context: got 2; expected at least 11"),
    (["--max-model-len", "5", "--k", "3"], "--max-model-len/--context: got 5; expected at least 6"),
    (["--ssl-keyfile", __file__], "expected both, or neither"),
    (["--chat-template", "no-such-template"], "--chat-template: got 'no-such-template'; expected a template file"),
    (["--chat-template", "{% for m in messages %}{{ m }}"], "--chat-template: Unexpected end of template"),
    (["--allowed-origins", "[not json"], "--allowed-origins: got '[not json'; expected a JSON list"),
])
def test_serve_refuses_settings_that_would_fail_every_request(pair_dir, args, message):
    result = CliRunner().invoke(main, ["serve", str(pair_dir), *args])
    assert result.exit_code != 0 and message in result.output, result.output


def test_a_suffix_token_bound_beyond_memory_is_refused_in_one_line(pair_dir):
    """--suffix-tokens 10**12 made the loader's byte bound none; it is bounded by what 16 full indexes of the worst
    case a token fit in half of this machine's memory."""
    from specdeploy.runtime.suffix_store import max_tokens_for

    result = CliRunner().invoke(main, ["serve", str(pair_dir), "--suffix-tokens", str(10**12)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"--suffix-tokens': 1000000000000 is not in the range 1<=x<={max_tokens_for(16)}" in result.output
