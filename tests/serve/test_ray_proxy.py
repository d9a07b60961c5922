"""Ray's HTTP proxy, wrapped in ``ray_proxy.LostReplica``: a request whose replica was lost is answered, never cut."""

from __future__ import annotations

import asyncio
import json

from specdeploy.serve.ray_proxy import LostReplica, middlewares


def _run(app, scope_type: str = "http") -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(LostReplica(app)({"type": scope_type, "path": "/v1/completions"}, receive, send))
    return sent


def test_a_request_whose_replica_never_answered_gets_a_503_to_retry():
    async def lost(scope, receive, send):  # what Ray's proxy does when the replica died: sends nothing
        return None

    start, body = _run(lost)
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    error = json.loads(body["body"])["error"]
    assert error["code"] == "replica_lost" and "retry" in error["message"]


def test_a_stream_cut_short_ends_with_an_error_event_and_done():
    async def cut(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})

    *_, tail = _run(cut)
    events = [line.removeprefix("data: ") for line in tail["body"].decode().split("\n\n") if line]
    assert json.loads(events[0])["error"]["code"] == "replica_lost" and events[1] == "[DONE]"
    assert not tail.get("more_body", False)


def test_a_replicas_own_answers_and_other_protocols_pass_untouched():
    async def answered(scope, receive, send):
        await send({"type": "http.response.start", "status": 429, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    assert [m.get("status") for m in _run(answered)] == [429, None]
    assert _run(lambda scope, receive, send: asyncio.sleep(0), scope_type="websocket") == []
    assert [m.cls for m in middlewares()] == [LostReplica]  # what Ray's proxy callback installs
