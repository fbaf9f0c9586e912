"""The gateway's fast path (agentloop/gateway/fastpath.py): the dialect routes are served by it,
and every answer equals the FastAPI route's for the same request (success in each dialect, each
error, streaming, a client that disconnects mid-stream), on one live gateway (real uvicorn, fake
engine) with the fast path switched on and off between requests."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import LiveGateway

from agentloop.gateway.actor import GatewayActor, GatewayManager
from agentloop.gateway.dialects import DIALECTS
from agentloop.gateway.fastpath import FastPath, GatewayApp
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.service import GatewayService
from agentloop.testing import ScriptedServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
RESPONSES = {"model": "m", "input": "hello"}
MESSAGES = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "hello"}]}
VOLATILE = re.compile(r'"(id|created|created_at|item_id|response_id)":\s*("[^"]*"|\d+)')
"""Fields that differ between two identical requests (ids, timestamps)."""


class Counting:
    """A fast path that counts the requests it served."""

    def __init__(self, inner: FastPath) -> None:
        self.inner = inner
        self.served = 0

    def match(self, scope: Any) -> Any:
        return self.inner.match(scope)

    async def __call__(self, *args: Any) -> None:
        self.served += 1
        await self.inner(*args)


@pytest.fixture
def gateway(tokenizer: Any) -> Iterator[LiveGateway]:
    gw = LiveGateway(tokenizer, max_body_bytes=4096)
    yield gw
    gw.close()


def _app(gw: LiveGateway) -> GatewayApp:
    assert isinstance(gw.actor.app, GatewayApp)
    return gw.actor.app


def _normal(text: str, rid: str = "") -> str:
    """``text`` with the request id (``rid`` or any), session ids, other ids and timestamps
    masked."""
    if rid:
        text = text.replace(rid, "REQ")
    text = re.sub(r"req_[0-9a-f]{24}", "REQ", text)
    text = re.sub(r"\b[0-9a-f]{32}\b", "SID", text)
    return VOLATILE.sub(r'"\1":"X"', text)


def _send(gw: LiveGateway, handle: Any, path: str, body: Any, *, key: str | None = "bearer",
          raw: bytes | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    sent = dict(headers or {})
    if key == "bearer":
        sent["Authorization"] = f"Bearer {handle.api_key}"
    elif key == "x-api-key":
        sent["x-api-key"] = handle.api_key
    content: Any = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{gw.url}/sessions/{handle.session_id}{path}", content=content,
                      headers=sent, timeout=30)


def _view(r: httpx.Response) -> tuple[int, dict[str, str], str]:
    """What must be equal between the two paths: status, headers (bar the date, the id's value),
    the body with ids and timestamps masked."""
    rid = r.headers["x-request-id"]
    assert rid.startswith("req_")
    if "content-length" in r.headers:
        assert int(r.headers["content-length"]) == len(r.content)
    headers = {k: v for k, v in r.headers.items()
               if k not in ("date", "x-request-id", "content-length")}
    return r.status_code, headers, _normal(r.text, rid)


def _both(gw: LiveGateway, request: Any) -> tuple[Any, Any]:
    """``request(handle)`` on a fresh session through the fast path, then on another fresh session
    through FastAPI; the two views."""
    app = _app(gw)
    counting = Counting(app.fast_path)  # type: ignore[arg-type]
    app.fast_path = counting  # type: ignore[assignment]
    try:
        fast = _view(request(gw.session()))
        assert counting.served == 1
        app.fast_path = None
        slow = _view(request(gw.session()))
    finally:
        app.fast_path = counting.inner
    return fast, slow


def test_match_takes_exactly_the_dialect_posts() -> None:
    fast = FastPath(None, 10)  # type: ignore[arg-type]

    def scope(path: str, method: str = "POST", **extra: Any) -> dict[str, Any]:
        return {"type": "http", "method": method, "path": path, **extra}

    for dialect in DIALECTS.values():
        assert fast.match(scope(f"/sessions/s1/v1{dialect.path}")) == ("s1", dialect)
        assert fast.match(scope(f"/sessions/v1/v1/v1{dialect.path}")) == ("v1", dialect)
    for path in ("/sessions/s1/v1/messages/count_tokens", "/sessions/s1/v1/models",
                 "/sessions/s1/complete", "/sessions//v1/chat/completions", "/health",
                 "/sessions/s1/v1/chat/completions/", "/sessions/a/b/v1/chat/completions",
                 "/sessions/s1/v2/chat/completions", "/docs", "/sessions/s1"):
        assert fast.match(scope(path)) is None, path
    assert fast.match(scope("/sessions/s1/v1/chat/completions", "GET")) is None
    assert fast.match(scope("/sessions/s1/v1/chat/completions", root_path="/x")) is None
    assert fast.match({"type": "lifespan"}) is None


@pytest.mark.parametrize(("path", "body", "key"), [
    ("/v1/chat/completions", CHAT, "bearer"),
    ("/v1/v1/chat/completions", CHAT, "bearer"),
    ("/v1/responses", RESPONSES, "bearer"),
    ("/v1/messages", MESSAGES, "x-api-key"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, "bearer"),
])
def test_replies_equal_fastapis(gateway: LiveGateway, path: str, body: Any, key: str) -> None:
    fast, slow = _both(gateway, lambda h: _send(gateway, h, path, body, key=key))
    assert fast[0] == 200 and fast == slow


@pytest.mark.parametrize(("path", "body", "key", "raw", "status"), [
    ("/v1/chat/completions", CHAT, None, None, 401),
    ("/v1/messages", MESSAGES, "wrong", None, 401),
    ("/v1/chat/completions", None, "bearer", b"", 400),
    ("/v1/chat/completions", None, "bearer", b"  \n", 400),
    ("/v1/messages", None, "x-api-key", b"{not json", 400),
    ("/v1/responses", None, "bearer", b'{"model": "m", "input": 3}', 400),
    ("/v1/messages", {"model": "m", "messages": []}, "x-api-key", None, 400),
    ("/v1/chat/completions", {**CHAT, "pad": "x" * 5000}, "bearer", None, 413),
])
def test_errors_equal_fastapis(gateway: LiveGateway, path: str, body: Any, key: str | None,
                               raw: bytes | None, status: int) -> None:
    fast, slow = _both(gateway, lambda h: _send(gateway, h, path, body, key=key, raw=raw))
    assert fast[0] == status and fast == slow
    assert '"request_id":"REQ"' in fast[2]


def test_a_chunked_body_over_the_limit_is_413(gateway: LiveGateway) -> None:
    def chunked(handle: Any) -> httpx.Response:
        parts = iter([b'{"model": "m", "pad": "', b"x" * 3000, b"x" * 3000, b'"}'])
        return httpx.post(
            f"{gateway.url}/sessions/{handle.session_id}/v1/chat/completions", content=parts,
            headers={"Authorization": f"Bearer {handle.api_key}"}, timeout=30,
        )

    fast, slow = _both(gateway, chunked)
    assert fast[0] == 413 and fast == slow and "over the limit of 4096 bytes" in fast[2]


def test_unknown_session_and_finished_session_equal_fastapis(gateway: LiveGateway) -> None:
    def unknown(handle: Any) -> httpx.Response:
        return httpx.post(f"{gateway.url}/sessions/nope/v1/messages", json=MESSAGES,
                          headers={"x-api-key": handle.api_key}, timeout=30)

    def completed(handle: Any) -> httpx.Response:
        gateway.run(gateway.actor.complete(handle.session_id))
        return _send(gateway, handle, "/v1/chat/completions", CHAT)

    for request, status in ((unknown, 404), (completed, 409)):
        fast, slow = _both(gateway, request)
        assert fast[0] == status and fast == slow


def test_a_gateway_bug_is_the_same_500_and_log_line(gateway: LiveGateway, caplog: Any) -> None:
    class BrokenParser:
        tool_call_start = "<tool_call>"

        async def extract_tool_calls(self, ids: Any, tools: Any) -> Any:
            raise ZeroDivisionError("secret internal state at 0xdeadbeef")

    gateway.actor.service.parser = BrokenParser()  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="agentloop.gateway"):
        fast, slow = _both(gateway, lambda h: _send(gateway, h, "/v1/chat/completions", CHAT))
    assert fast[0] == 500 and fast == slow and "deadbeef" not in fast[2]
    lines = [rec.getMessage() for rec in caplog.records if rec.exc_info]
    assert len(lines) == 2 and _normal(lines[0]) == _normal(lines[1])
    assert lines[0].startswith("request req_") and "unhandled error in POST /sessions/" in lines[0]


@pytest.mark.parametrize(("path", "body", "key"), [
    ("/v1/chat/completions", {**CHAT, "stream": True}, "bearer"),
    ("/v1/responses", {**RESPONSES, "stream": True}, "bearer"),
    ("/v1/messages", {**MESSAGES, "stream": True}, "x-api-key"),
])
def test_streams_equal_fastapis(gateway: LiveGateway, path: str, body: Any, key: str) -> None:
    fast, slow = _both(gateway, lambda h: _send(gateway, h, path, body, key=key))
    assert fast[0] == 200 and fast == slow
    assert fast[1]["content-type"] == "text/event-stream; charset=utf-8"
    assert fast[1]["cache-control"] == "no-cache" and fast[1]["x-accel-buffering"] == "no"


def test_other_routes_stay_on_fastapi(gateway: LiveGateway) -> None:
    app = _app(gateway)
    counting = Counting(app.fast_path)  # type: ignore[arg-type]
    app.fast_path = counting  # type: ignore[assignment]
    handle = gateway.session()
    auth = {"Authorization": f"Bearer {handle.api_key}"}
    base = f"{gateway.url}/sessions/{handle.session_id}/v1"
    assert httpx.get(f"{base}/chat/completions", headers=auth).status_code == 405
    assert httpx.get(f"{base}/models", headers=auth).status_code == 200
    count = httpx.post(f"{base}/messages/count_tokens", json=MESSAGES, headers=auth)
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    assert httpx.get(f"{gateway.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{gateway.url}/openapi.json").status_code == 200
    assert counting.served == 0


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_client_that_disconnects_mid_stream_aborts_the_engine(
    tokenizer: Any, fast_path: bool
) -> None:
    server = ScriptedServer(lambda p, s, r: [11, 12, 13], eos_token_id=tokenizer.eos_token_id,
                            delay=20.0)
    gw = LiveGateway(tokenizer, server)
    try:
        if not fast_path:
            _app(gw).fast_path = None
        handle = gw.session()
        with httpx.stream(
            "POST", f"{handle.base_url}/chat/completions", json={**CHAT, "stream": True},
            headers={"Authorization": f"Bearer {handle.api_key}"}, timeout=30,
        ) as r:
            assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
            _wait_for(lambda: len(server.calls) == 1)  # the engine request is running
        _wait_for(lambda: server.counts["abort"] == 1)  # the client left: aborted
        service: GatewayService = gw.actor.service
        state = gw.run(gw.actor.get_state(handle.session_id))
        assert state["in_flight"] == 0 and state["stats"]["num_pending"] == 0
        assert service.sessions[handle.session_id].state == "active"
        assert gw.finalize(handle.session_id)["trajectories"] == []
    finally:
        gw.close()


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class CountedActor:
    """An in-process gateway actor that counts the calls of each of its session methods."""

    def __init__(self, actor: GatewayActor) -> None:
        self.actor = actor
        self.calls: Counter[str] = Counter()

    async def create_session(self, *args: Any) -> Any:
        self.calls["create_session"] += 1
        return await self.actor.create_session(*args)

    async def create_sessions(self, calls: list[Any]) -> Any:
        self.calls["create_sessions"] += 1
        return await self.actor.create_sessions(calls)

    async def finalize(self, *args: Any) -> Any:
        self.calls["finalize"] += 1
        return await self.actor.finalize(*args)

    async def finalize_sessions(self, calls: list[Any]) -> Any:
        self.calls["finalize_sessions"] += 1
        return await self.actor.finalize_sessions(calls)


def test_the_manager_opens_and_closes_concurrent_sessions_in_one_call(
    gateway: LiveGateway,
) -> None:
    counted = CountedActor(gateway.actor)
    manager = GatewayManager([counted])

    async def scenario() -> None:
        handles = await asyncio.gather(
            *(manager.create_session(metadata={"i": i}) for i in range(20))
        )
        assert len({h.session_id for h in handles}) == 20 and manager.active == [20]
        assert counted.calls == {"create_sessions": 1}
        with pytest.raises(GatewayHTTPError) as taken:  # the single call's error, as before
            await manager.create_session(session_id=handles[0].session_id)
        assert taken.value.status == 409 and counted.calls["create_session"] == 1
        done = await asyncio.gather(*(manager.finalize(h.session_id) for h in handles[1:]))
        assert [d["metadata"]["i"] for d in done] == list(range(1, 20))
        assert counted.calls["finalize_sessions"] == 1 and counted.calls["finalize"] == 0
        await gateway.actor.finalize(handles[0].session_id)  # closed behind the manager's back
        with pytest.raises(GatewayHTTPError) as gone:
            await manager.finalize(handles[0].session_id)
        assert gone.value.status == 404 and counted.calls["finalize"] == 1
        assert manager.active == [0]

    gateway.run(scenario())
