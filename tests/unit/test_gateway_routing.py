"""Gateway placement and routing: least-active gateways, sticky routing per conversation root,
session limits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gateway_helpers import FakePolicy

from agentloop.gateway.actor import GatewayManager
from agentloop.gateway.service import GatewayService, SessionHandle
from agentloop.parsers import get_tool_parser
from agentloop.routing import AsyncLLMServerManager
from agentloop.routing.strategies import make_balancer
from agentloop.testing import ScriptedServer


class SlowGateway:
    """Stands in for a GatewayActor: opening a session takes a moment, so concurrent opens
    overlap."""

    def __init__(self, name: str) -> None:
        self.name, self.opened = name, 0

    async def create_session(
        self, session_id: Any, metadata: Any, sampling_params: Any
    ) -> SessionHandle:
        await asyncio.sleep(0.01)
        self.opened += 1
        return SessionHandle(
            session_id=f"{self.name}-{self.opened}", base_url="http://x", api_key="k"
        )

    async def finalize(self, session_id: str, longest_only: bool = False) -> dict:
        return {"session_id": session_id, "trajectories": []}


def test_sessions_spread_over_gateways_by_least_active():
    gateways = [SlowGateway("a"), SlowGateway("b"), SlowGateway("c")]
    manager = GatewayManager(gateways)

    async def go() -> list[SessionHandle]:
        return list(await asyncio.gather(*(manager.create_session() for _ in range(6))))

    handles = asyncio.run(go())
    assert [g.opened for g in gateways] == [2, 2, 2]  # slots reserved before the await
    asyncio.run(manager.finalize(handles[0].session_id))
    assert manager.active == [1, 2, 2]
    again = asyncio.run(manager.create_session())
    assert again.session_id.startswith("a-")  # the freed slot is the least active one


class DeadGateway:
    """A gateway whose actor died: every call raises Ray's actor error."""

    def __init__(self) -> None:
        self.calls = 0

    async def create_session(self, *args: Any) -> SessionHandle:
        import ray.exceptions

        self.calls += 1
        raise ray.exceptions.ActorDiedError()


def test_a_dead_gateway_gets_no_more_sessions_and_all_dead_says_what_happens():
    from agentloop.errors import ServerError

    dead, live = DeadGateway(), SlowGateway("b")
    manager = GatewayManager([dead, live])

    async def go() -> list[SessionHandle]:
        return list(await asyncio.gather(*(manager.create_session() for _ in range(4))))

    handles = asyncio.run(go())
    assert all(h.session_id.startswith("b-") for h in handles) and live.opened == 4
    assert manager.dead == {0} and dead.calls <= 4 and manager.active == [0, 4]
    asyncio.run(manager.create_session())
    assert dead.calls <= 4  # marked dead: not tried again
    lonely = GatewayManager([DeadGateway()])
    with pytest.raises(ServerError, match="gateway actor.*died.*before its next batch"):
        asyncio.run(lonely.create_session())


def test_continuations_stick_to_the_server_of_their_conversation(tokenizer):
    policy = FakePolicy(tokenizer)
    servers = [
        ScriptedServer(policy, eos_token_id=tokenizer.eos_token_id, name=f"s{i}") for i in range(2)
    ]
    router = AsyncLLMServerManager(servers, make_balancer(2, tie_break="rotate"))
    service = GatewayService(
        tokenizer, router, get_tool_parser("hermes", tokenizer), max_length=1024
    )

    async def conversation(sid: str, opening: str) -> None:
        msgs = [{"role": "user", "content": opening}]
        for _ in range(3):  # best-of-3 on the same context
            await service.chat(sid, {"model": "m", "messages": msgs})
        reply = await service.chat(sid, {"model": "m", "messages": msgs})
        msgs = [*msgs, reply["choices"][0]["message"], {"role": "user", "content": "another word"}]
        await service.chat(sid, {"model": "m", "messages": msgs})

    async def go() -> None:
        handle = service.create_session()
        for i in range(6):
            await conversation(handle.session_id, f"a word please ({i})")

    asyncio.run(go())
    by_root: dict[str, set[str]] = {}
    for server in servers:
        for call in server.calls:
            opening = tokenizer.decode(call["prompt_ids"]).split("a word please (")[1][0]
            by_root.setdefault(opening, set()).add(server.name)
    assert len(by_root) == 6
    # every turn of a conversation on one server
    assert all(len(names) == 1 for names in by_root.values())
    assert all(server.calls for server in servers)  # while different conversations do spread
    assert sum(len(s.calls) for s in servers) == 30


def test_max_concurrent_sessions_caps_open_sessions_per_worker(tokenizer):
    from omegaconf import OmegaConf

    from agentloop.gateway.framework import OpenAIAgentLoop

    open_now, peak = 0, 0

    class CountingManager:
        async def create_session(self, **kwargs: Any) -> SessionHandle:
            nonlocal open_now, peak
            open_now += 1
            peak = max(peak, open_now)
            return SessionHandle(session_id=f"s{open_now}", base_url="http://x", api_key="k")

        async def finalize(self, session_id: str, longest_only: bool = False) -> dict:
            nonlocal open_now
            open_now -= 1
            return {"session_id": session_id, "trajectories": [], "reward_info": None}

        async def abort(self, session_id: str) -> dict:
            return {}

    async def runner(**kwargs: Any) -> None:
        await asyncio.sleep(0.02)

    config = OmegaConf.create({"prompt_length": 64, "response_length": 64,
                               "gateway": {"max_concurrent_sessions": 2}})

    async def go() -> list:
        OpenAIAgentLoop.reset_class()
        OpenAIAgentLoop.init_class(config, tokenizer, gateway_manager=CountingManager())
        loops = [OpenAIAgentLoop(config, None, tokenizer, runner=runner) for _ in range(6)]
        return await asyncio.gather(
            *(
                loop.run({}, raw_prompt=[{"role": "user", "content": "x"}], index=i)
                for i, loop in enumerate(loops)
            )
        )

    try:
        outs = asyncio.run(go())
    finally:
        OpenAIAgentLoop.reset_class()
    assert peak == 2
    assert all(
        o.trajectories[0].status == "error" and "no chat request" in o.trajectories[0].error
        for o in outs
    )
