"""Advertised behaviours of the manager on local Ray with the fake engine (ScriptedServer actors
through the manager's ``servers=`` injection point, no vLLM): the sticky cache grows with the batch
(generate_sequences and the Rollouter), ``server.max_failovers``, ``server.restart_dead`` and
``agent_loop/num_truncated_prompts``.

Each ScriptedServer replies with one token naming it (``100 + its index``), so a row's response
shows which server each of its turns ran on.  Nothing waits on a fixed sleep: a server is killed
once a request is seen running on it, and every wait has a generous bound.  The tests that kill no
server share two server actors (verl 0.9's ``llm_client`` form: the manager neither starts nor stops
them), so that few actors start."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.batch.protocol import DataProto
from agentloop.cluster.placement import ServerGroup
from agentloop.config import default_config
from agentloop.loops.base import AgentLoopBase
from agentloop.rollout.manager import AgentLoopManager
from agentloop.rollout.rollouter import Rollouter
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.types import AgentLoopOutput

pytestmark = pytest.mark.integration

FIRST_TOKEN = 100
"""Server ``i`` replies ``[FIRST_TOKEN + i]``."""
WAIT_S = 60.0
"""The bound on any wait for something that happens at once when the code works."""


class TwoTurnLoop(AgentLoopBase):
    """Two generate calls under one request id, as a multi-turn loop makes (the second turn should
    go back to the first turn's server: its prefix cache).  Sample ``q<i>`` waits ``i`` tenths of a
    second between its turns, so the second turns come one by one: one that lost its binding is
    routed anew, to either server."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        request_id, prompt = uuid.uuid4().hex, [5, 6, 7]
        first = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt,
                                                   sampling_params=sampling_params)
        await asyncio.sleep(0.1 * int(kwargs["raw_prompt"][0]["content"].lstrip("q")))
        second = await self.server_manager.generate(
            request_id=request_id, prompt_ids=prompt + first.token_ids,
            sampling_params=sampling_params,
        )
        response = first.token_ids + second.token_ids
        return AgentLoopOutput(
            prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response)
        )


def replies_with(index: int) -> Any:
    return lambda ids, params, request_id: [FIRST_TOKEN + index]


@dataclass
class ScriptedGroup(ServerGroup):
    """ScriptedServer actors the manager owns, as if it had started them; it may restart one
    (``relaunch``)."""

    relaunched: int = 0

    @property
    def restartable(self) -> bool:
        return True

    def relaunch(self, index: int) -> Any:
        self.relaunched += 1
        return scripted_actor(index, delay=0.0)


def scripted_actor(index: int, delay: float) -> Any:
    import ray

    return ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=1000).remote(
        replies_with(index), delay=delay, name=f"s{index}")


@pytest.fixture(scope="module")
def ray_session() -> Any:
    import ray
    import ray.cloudpickle

    # TwoTurnLoop runs in the worker actors
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def loops_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ``agent.agent_loop_config_path`` registering :class:`TwoTurnLoop` as ``two_turns``."""
    path = tmp_path_factory.mktemp("loops") / "loops.yaml"
    path.write_text(yaml.safe_dump([{"name": "two_turns", "_target_": f"{__name__}.TwoTurnLoop"}]))
    return path


@pytest.fixture(scope="module")
def shared_servers(ray_session: Any) -> Any:
    """Two ScriptedServer actors (0.05 s per reply) that managers use without owning them."""
    handles = [scripted_actor(i, delay=0.05) for i in range(2)]
    yield handles
    for handle in handles:
        ray_session.kill(handle)


def config(loops_file: Path, **keys: Any) -> Any:
    """The tiny model's config with one worker; ``keys``: dotted keys under
    ``actor_rollout_ref.rollout`` (e.g. ``server.max_failovers``)."""
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_prompt_length = 32
    cfg.data.max_response_length = 8
    rollout = {
        "agent.num_workers": 1, "agent.agent_loop_config_path": str(loops_file),
        "free_cache_engine": False, **keys,
    }
    for key, value in rollout.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
    return cfg


def owning_manager(
    delays: list[float], loops_file: Path, **keys: Any
) -> tuple[AgentLoopManager, ScriptedGroup]:
    """A manager over ScriptedServer actors it owns and may restart (``delays[i]``: server i's
    delay)."""
    handles = [scripted_actor(i, delay) for i, delay in enumerate(delays)]
    group = ScriptedGroup(handles=handles, placement_group=None, device="cpu", info=[])
    return AgentLoopManager(config(loops_file, **keys), servers=group), group


def sharing_manager(servers: list[Any], loops_file: Path, **keys: Any) -> AgentLoopManager:
    """A manager over the shared servers (a balancer of its own: its sticky cache starts at
    max_cache_size)."""
    return AgentLoopManager(
        config(loops_file, **keys), llm_client=AsyncLLMServerManager(list(servers))
    )


@pytest.fixture(scope="module")
def manager(shared_servers: list[Any], loops_file: Path) -> Any:
    """A manager over the shared servers with ``server.max_cache_size: 1``."""
    manager = sharing_manager(shared_servers, loops_file, **{"server.max_cache_size": 1})
    yield manager
    manager.shutdown()


def batch(texts: list[str], agent_name: str) -> DataProto:
    return rows_to_batch([{"prompt": [{"role": "user", "content": t}], "agent_name": agent_name}
                          for t in texts])


def turn_servers(out: DataProto) -> list[tuple[int, int]]:
    """Per row: the servers its two turns ran on."""
    responses = out.batch["responses"].tolist()
    return [(row[0] - FIRST_TOKEN, row[1] - FIRST_TOKEN) for row in responses]


def assert_every_second_turn_went_back(out: DataProto, rows: int) -> None:
    servers = turn_servers(out)
    assert out.non_tensor_batch["status"].tolist() == ["stop"] * rows
    # both servers served: a lost binding could move a turn
    assert {first for first, _ in servers} == {0, 1}
    assert all(first == second for first, second in servers), servers


def test_the_sticky_cache_grows_with_the_batch(manager: AgentLoopManager) -> None:
    """``server.max_cache_size: 1`` is a floor: a batch of 16 samples, each turn interleaved with
    the others', keeps every binding, so every second turn goes back to its first turn's server."""
    out = manager.generate_sequences(batch([f"q{i}" for i in range(16)], "two_turns"))
    assert_every_second_turn_went_back(out, 16)


def test_the_rollouter_grows_the_sticky_cache_to_its_samples_in_flight(shared_servers: list[Any],
                                                                       loops_file: Path) -> None:
    """The same through the Rollouter, on a manager that never ran ``generate_sequences``."""
    manager = sharing_manager(shared_servers, loops_file, **{"server.max_cache_size": 1})
    rollouter = Rollouter(
        manager, [batch([f"q{i}" for i in range(16)], "two_turns")], max_inflight=16, group_by=None
    )
    try:
        out = rollouter.start().get(num_groups=16, timeout=WAIT_S)
        assert out is not None
        assert_every_second_turn_went_back(out, 16)
    finally:
        rollouter.stop()
        manager.shutdown()


def kill_once_busy(server: Any) -> threading.Thread:
    """Kill ``server``'s engine (ScriptedServer.kill_engine) as soon as a request is running on
    it."""
    import ray

    def kill() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and ray.get(server.busy_seconds.remote()) <= 0:
            time.sleep(0.02)
        ray.get(server.kill_engine.remote())

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def run_with_server_0_dying(
    loops_file: Path, **keys: Any
) -> tuple[DataProto, AgentLoopManager, ScriptedGroup]:
    """8 single-turn samples on two servers; server 0 holds its requests until its engine is killed
    (once it runs one), server 1 answers after 0.2 s."""
    manager, group = owning_manager([3600.0, 0.2], loops_file, **keys)
    try:
        killer = kill_once_busy(group.handles[0])
        out = manager.generate_sequences(batch([f"q{i}" for i in range(8)], "single_turn_agent"))
        killer.join(WAIT_S)
    except BaseException:
        manager.shutdown()  # the caller shuts it down only once it has it
        raise
    return out, manager, group


def test_requests_fail_over_and_the_dead_server_is_restarted_by_default(
    ray_session: Any, loops_file: Path
) -> None:
    """Defaults: ``server.max_failovers: null`` (once to every other server),
    ``server.restart_dead: true``."""
    out, manager, group = run_with_server_0_dying(loops_file)
    try:
        timing = out.meta_info["timing"]
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 8
        assert timing["agent_loop/faults/server_failovers"] >= 1
        state = manager.recover(timeout=WAIT_S)
        assert group.relaunched == 1 and state["servers_down"] == 0
    finally:
        manager.shutdown()


def test_max_failovers_0_and_restart_dead_false(ray_session: Any, loops_file: Path) -> None:
    """``server.max_failovers: 0``: a request on the dead server is not moved (an ``error`` row
    naming the dead server); ``server.restart_dead: false``: the server is only taken out of
    routing."""
    out, manager, group = run_with_server_0_dying(loops_file, **{"server.max_failovers": 0,
                                                               "server.restart_dead": False})
    try:
        status, errors = (
            out.non_tensor_batch["status"].tolist(),
            out.non_tensor_batch["error"].tolist(),
        )
        failed = [e for s, e in zip(status, errors, strict=True) if s == "error"]
        assert failed and all("died" in e for e in failed), errors
        assert status.count("stop") + len(failed) == 8
        assert out.meta_info["timing"]["agent_loop/faults/server_failovers"] == 0
        state = manager.recover(timeout=2.0)
        assert (
            group.relaunched == 0
            and state["servers_down"] == 1
            and state["servers_restarting"] == 0
        )
        # server 1 serves the rest
        again = manager.generate_sequences(batch(["q"] * 4, "single_turn_agent"))
        assert again.non_tensor_batch["status"].tolist() == ["stop"] * 4
    finally:
        manager.shutdown()


def test_truncated_prompts_are_counted(manager: AgentLoopManager) -> None:
    """Prompts longer than ``data.max_prompt_length`` (32 here) are left-truncated and counted in
    ``agent_loop/num_truncated_prompts``."""
    out = manager.generate_sequences(batch(["short", "word " * 200, "also short", "more " * 100],
                                           "single_turn_agent"))
    assert out.meta_info["timing"]["agent_loop/num_truncated_prompts"] == 2.0
    assert [bool(n) for n in out.non_tensor_batch["prompt_truncated"].tolist()] == [
        False, True, False, True,
    ]
    assert out.non_tensor_batch["status"].tolist() == ["stop"] * 4
