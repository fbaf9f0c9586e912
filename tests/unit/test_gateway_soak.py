"""Soak: 1,000 concurrent sessions over HTTP on loopback against a fake engine.

Every session is open at the same time and sends its turns concurrently with all the others; each
session's trajectory must be exactly its own conversation (token-exact against a full chat-template
render, and only its own tag in the sampled text): nothing lost, nothing merged.  Memory held per
idle session (one finished turn, waiting for the next) is measured and printed.
"""

from __future__ import annotations

import asyncio
import gc
import re
import tracemalloc
from typing import Any

import aiohttp
from gateway_helpers import LiveGateway, full_render_ids

from agentloop.testing import ScriptedServer

NUM_SESSIONS = 1000


class EchoTag:
    """Replies ``Echo <n>.`` where ``<n>`` is the tag of the last user turn; counts peak
    concurrency."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        text = self.tokenizer.decode(prompt_ids[-24:])
        tag = re.findall(r"tag (\d+)", text)[-1]
        reply = f"Echo {tag}."
        if reply not in self.cache:
            self.cache[reply] = list(self.tokenizer.encode(reply, add_special_tokens=False))
        return self.cache[reply] + [self.tokenizer.eos_token_id]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def turn(client: aiohttp.ClientSession, handle: Any, messages: list[dict[str, Any]]) -> None:
    async with client.post(
        f"{handle.base_url}/chat/completions", json={"model": "m", "messages": messages},
        headers={"Authorization": f"Bearer {handle.api_key}"},
    ) as r:
        assert r.status == 200, await r.text()
        messages.append((await r.json())["choices"][0]["message"])


def test_a_thousand_concurrent_sessions_keep_their_own_trajectories(tokenizer):
    policy = EchoTag(tokenizer)
    gw = LiveGateway(
        tokenizer, ScriptedServer(policy, eos_token_id=tokenizer.eos_token_id, delay=0.05),
        policy=policy,
    )
    try:
        handles = [gw.session() for _ in range(NUM_SESSIONS)]
        convs: list[list[dict[str, Any]]] = [[{"role": "user", "content": f"Hello, tag {i}"}]
                                             for i in range(NUM_SESSIONS)]

        # The clients share the gateway's event loop (one thread: no GIL hand-offs between two busy
        # loops);
        # aiohttp because httpx's connection pool slows down quadratically with 1,000 concurrent
        # requests.
        async def drive() -> int:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=120)) as client:
                await asyncio.gather(
                    *(turn(client, h, c) for h, c in zip(handles, convs, strict=True))
                )
                gc.collect()
                idle_rss = rss_bytes()  # every session open, one turn done, waiting
                for i, conv in enumerate(convs):
                    conv.append({"role": "user", "content": f"Again, tag {i}"})
                await asyncio.gather(
                    *(turn(client, h, c) for h, c in zip(handles, convs, strict=True))
                )
                return idle_rss

        rss_before = rss_bytes()
        idle_rss = gw.run(drive(), timeout=300)
        assert len(gw.actor.service.sessions) == NUM_SESSIONS
        print(
            f"\nRSS growth with {NUM_SESSIONS} sessions open after one turn: "
            f"{(idle_rss - rss_before) / NUM_SESSIONS / 1024:.1f} KiB/session (HTTP "
            f"clients included)"
        )
        for i, (handle, conv) in enumerate(zip(handles, convs, strict=True)):
            assert [m["content"] for m in conv if m["role"] == "assistant"] == [
                f"Echo {i}.",
                f"Echo {i}.",
            ]
            [traj] = gw.finalize(handle.session_id)["trajectories"]
            ids = list(traj.prompt_ids) + list(traj.response_ids)
            sep = tokenizer.encode("\n", add_special_tokens=False)
            assert ids + sep == full_render_ids(tokenizer, conv, None), (
                f"session {i} is not its own conversation"
            )
            sampled = tokenizer.decode(
                [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m]
            )
            assert set(re.findall(r"Echo (\d+)", sampled)) == {str(i)}
        assert not gw.actor.service.sessions
        assert len(gw.server.calls) == 2 * NUM_SESSIONS
    finally:
        gw.close()


def test_memory_per_idle_session_is_small(tokenizer):
    """Gateway-side memory of a session holding one two-message turn (traced Python allocations)."""
    n = 300
    gw = LiveGateway(tokenizer, policy=EchoTag(tokenizer))
    try:
        service = gw.actor.service

        async def open_and_talk(k: int) -> None:
            handle = service.create_session()
            await service.chat(
                handle.session_id,
                {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": "You are helpful."},
                        {"role": "user", "content": f"Hi, tag {k}"},
                    ],
                },
            )

        # warm caches (template compilation, tokenizer) outside the measurement
        gw.run(open_and_talk(10**6))
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            async def all_sessions() -> None:
                await asyncio.gather(*(open_and_talk(k) for k in range(n)))

            gw.run(all_sessions())
            gc.collect()
            per_session = (tracemalloc.get_traced_memory()[0] - before) / n
        finally:
            tracemalloc.stop()
        print(f"\nmemory per idle session (one turn recorded): {per_session / 1024:.1f} KiB")
        # generous: a leak (e.g. keeping every request body) would blow it
        assert per_session < 256 * 1024
    finally:
        gw.close()
