"""Soak: 1,000 concurrent sessions mixing the three dialects on one gateway (fake engine, loopback).

Session ``i`` sends its first turn in one dialect (chat completions, Responses, Messages by
``i % 3``) and its second in the next one, every session at the same time; each trajectory must be
exactly its own conversation, token for token against a full chat-template render: nothing lost,
nothing merged, and a conversation continued in another dialect still continues its own branch.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
from gateway_helpers import LiveGateway, full_render_ids

from agentloop.testing import ScriptedServer

NUM_SESSIONS = 1000
DIALECTS = ("chat", "responses", "messages")


class EchoTag:
    """Replies ``Echo <n>.`` where ``<n>`` is the tag of the last user turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        tag = re.findall(r"tag (\d+)", self.tokenizer.decode(prompt_ids[-24:]))[-1]
        reply = f"Echo {tag}."
        if reply not in self.cache:
            self.cache[reply] = list(self.tokenizer.encode(reply, add_special_tokens=False))
        return self.cache[reply] + [self.tokenizer.eos_token_id]


def request(dialect: str, handle: Any, messages: list[dict[str, str]]) -> tuple[str, dict, dict]:
    """URL, headers and body of one turn of ``messages`` (plain text turns) in ``dialect``."""
    if dialect == "chat":
        return (
            f"{handle.base_url}/chat/completions", {"Authorization": f"Bearer {handle.api_key}"},
            {"model": "m", "messages": messages},
        )
    if dialect == "responses":
        items = [{"role": m["role"], "content": m["content"]} for m in messages]
        return (
            f"{handle.base_url}/responses", {"Authorization": f"Bearer {handle.api_key}"},
            {"model": "m", "input": items, "store": False},
        )
    return (
        f"{handle.base_url}/messages",
        {"x-api-key": handle.api_key, "anthropic-version": "2023-06-01"},
        {"model": "m", "max_tokens": 64, "messages": messages},
    )


def reply_text(dialect: str, body: dict[str, Any]) -> str:
    """The assistant's text in a dialect's reply."""
    if dialect == "chat":
        return body["choices"][0]["message"]["content"]
    if dialect == "responses":
        [message] = [item for item in body["output"] if item["type"] == "message"]
        return "".join(part["text"] for part in message["content"])
    return "".join(block["text"] for block in body["content"] if block["type"] == "text")


async def turn(
    client: aiohttp.ClientSession, dialect: str, handle: Any, messages: list[dict[str, str]]
) -> None:
    url, headers, body = request(dialect, handle, messages)
    async with client.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        messages.append({"role": "assistant", "content": reply_text(dialect, await r.json())})


def test_a_thousand_sessions_mixing_dialects_keep_their_own_trajectories(tokenizer):
    policy = EchoTag(tokenizer)
    server = ScriptedServer(policy, eos_token_id=tokenizer.eos_token_id, delay=0.05)
    gw = LiveGateway(tokenizer, server, policy=policy)
    try:
        handles = [gw.session() for _ in range(NUM_SESSIONS)]
        convs = [[{"role": "user", "content": f"Hello, tag {i}"}] for i in range(NUM_SESSIONS)]

        async def drive() -> None:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
            ) as client:
                await asyncio.gather(
                    *(
                        turn(client, DIALECTS[i % 3], h, c)
                        for i, (h, c) in enumerate(zip(handles, convs, strict=True))
                    )
                )
                for i, conv in enumerate(convs):
                    conv.append({"role": "user", "content": f"Again, tag {i}"})
                await asyncio.gather(
                    *(
                        turn(client, DIALECTS[(i + 1) % 3], h, c)
                        for i, (h, c) in enumerate(zip(handles, convs, strict=True))
                    )
                )

        gw.run(drive(), timeout=300)
        sep = tokenizer.encode("\n", add_special_tokens=False)
        for i, (handle, conv) in enumerate(zip(handles, convs, strict=True)):
            assert [m["content"] for m in conv if m["role"] == "assistant"] == [f"Echo {i}."] * 2
            # one branch across two dialects
            [traj] = gw.finalize(handle.session_id)["trajectories"]
            ids = list(traj.prompt_ids) + list(traj.response_ids)
            assert ids + sep == full_render_ids(tokenizer, conv, None), (
                f"session {i} is not its own"
            )
            sampled = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m]
            assert set(re.findall(r"Echo (\d+)", tokenizer.decode(sampled))) == {str(i)}
        assert len(server.calls) == 2 * NUM_SESSIONS
    finally:
        gw.close()
