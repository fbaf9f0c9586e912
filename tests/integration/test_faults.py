"""Fault injection on local Ray with the fake engine (ScriptedServer actors the manager owns and
restarts): a worker killed mid-batch, a worker whose event loop hangs, a server actor killed
mid-batch, an engine process that dies inside a live server.  Each case: every row comes back, and
the next batch is clean."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.cluster.placement import ServerGroup
from agentloop.loops.base import AgentLoopBase, register
from agentloop.testing import ScriptedServer
from agentloop.testing.kill import kill_and_wait
from agentloop.types import AgentLoopOutput

pytestmark = pytest.mark.integration

IM_END = 2


class BlockingLoop(AgentLoopBase):
    """Blocks its worker's whole event loop (a synchronous sleep) when the prompt says so."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        text = kwargs["raw_prompt"][0]["content"]
        if text == "block":
            time.sleep(float(os.environ.get("AGENTLOOP_TEST_BLOCK_S", "20")))
        ids = [5, 6, 7]
        out = await self.server_manager.generate(
            request_id=f"r{kwargs.get('index')}", prompt_ids=ids, sampling_params=sampling_params
        )
        return AgentLoopOutput(
            prompt_ids=ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids)
        )


class ExplodingLoop(AgentLoopBase):
    """Raises before generating anything: its samples are error rows without the columns
    generation adds."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise RuntimeError("the tool exploded")


async def one_call_agent(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> float:
    """An external agent: one chat completion through its session's gateway."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=raw_prompt)
    return 1.0


class SleepyLoop(AgentLoopBase):
    """Sleeps the number of seconds its prompt says (``sleep 0.5``) before one generation."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        text = kwargs["raw_prompt"][0]["content"]
        await asyncio.sleep(float(text.split()[1]) if text.startswith("sleep ") else 0.0)
        ids = [5, 6, 7]
        out = await self.server_manager.generate(request_id=uuid.uuid4().hex, prompt_ids=ids,
                                                 sampling_params=sampling_params)
        versions = {k: out.extra_fields.get(k) for k in ("min_global_steps", "max_global_steps")}
        return AgentLoopOutput(
            prompt_ids=ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
            extra_fields=versions,
        )


@dataclass
class FakeServerGroup(ServerGroup):
    """Standalone-like servers made of ScriptedServer actors, which the manager may restart."""

    delay: float = 0.0

    @property
    def restartable(self) -> bool:
        return True

    def relaunch(self, index: int) -> Any:
        import ray

        return ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=1000).remote(
            delay=self.delay, name=f"restarted{index}")


@pytest.fixture(scope="module")
def ray_session():
    import ray
    import ray.cloudpickle

    from agentloop.gateway.framework import register_agent_runner
    from agentloop.loops.base import _agent_loop_registry

    register("blocking_probe")(BlockingLoop)
    register("sleepy_probe")(SleepyLoop)
    register("exploding_probe")(ExplodingLoop)
    register_agent_runner("gateway_probe")(one_call_agent)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
    _agent_loop_registry.pop("blocking_probe", None)
    _agent_loop_registry.pop("sleepy_probe", None)
    _agent_loop_registry.pop("exploding_probe", None)
    _agent_loop_registry.pop("gateway_probe", None)


def make_manager(ray: Any, *, num_servers: int, delay: float, num_workers: int = 2,
                 server_kwargs: dict[str, Any] | None = None, root: dict[str, Any] | None = None,
                 **agent: Any) -> Any:
    """A manager over ScriptedServer actors it owns (the ``servers=`` injection point: restarted,
    stopped)."""
    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    handles = [ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=1000).remote(
        delay=delay, name=f"s{i}", **(server_kwargs or {})) for i in range(num_servers)]
    group = FakeServerGroup(
        handles=handles, placement_group=None, device="cpu", info=[], delay=delay
    )
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_response_length = 8
    OmegaConf.update(cfg.actor_rollout_ref.rollout, "agent.num_workers", num_workers)
    OmegaConf.update(cfg.actor_rollout_ref.rollout, "free_cache_engine", False)
    for k, v in agent.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, f"agent.{k}", v)
    for k, v in (root or {}).items():
        OmegaConf.update(cfg, k, v, force_add=True)
    return AgentLoopManager(cfg, servers=group)


def batch(texts: list[str], agent_name: str = "single_turn_agent"):
    from agentloop.batch.data import rows_to_batch

    return rows_to_batch([{"prompt": [{"role": "user", "content": t}], "agent_name": agent_name,
                           "extra_info": {"index": i}} for i, t in enumerate(texts)])


def later(seconds: float, fn, *args) -> threading.Timer:
    """Run ``fn(*args)`` after ``seconds``: for a fault whose timing is the scenario (see
    :class:`When`)."""
    timer = threading.Timer(seconds, fn, args)
    timer.start()
    return timer


class When(threading.Thread):
    """Runs ``fn()`` as soon as ``predicate()`` holds (polled every 0.05 s, for at most ``timeout``
    s): a fault injected once the batch really is in flight, however long a loaded machine takes to
    dispatch it. ``fired`` says whether it ran; ``join`` it and assert ``fired`` after the batch."""

    def __init__(
        self, predicate: Callable[[], bool], fn: Callable[[], Any], timeout: float = 60.0
    ) -> None:
        super().__init__(daemon=True)
        self.predicate, self.fn, self.timeout, self.fired = predicate, fn, timeout, False
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.predicate():
                self.fn()
                self.fired = True
                return
            time.sleep(0.05)


def server_calls(handles: list[Any]) -> int:
    """``generate`` calls the ScriptedServer actors ``handles`` have received so far (a dead one
    counts 0)."""
    import ray
    import ray.exceptions

    total = 0
    for handle in handles:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            total += ray.get(
                handle.__ray_call__.remote(lambda server: len(server.calls)), timeout=10
            )
    return total


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` s pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def faults(out) -> dict[str, float]:
    return {k.rsplit("/", 1)[-1]: v for k, v in out.meta_info["timing"].items() if "/faults/" in k}


def test_a_worker_killed_mid_batch_loses_no_row_and_is_replaced(ray_session, monkeypatch):
    ray = ray_session
    manager = make_manager(ray, num_servers=2, delay=1.0)
    try:
        victim, servers = manager.agent_loop_workers[0], list(manager.server_handles)
        # its samples are in flight
        timer = When(lambda: server_calls(servers) > 0, lambda: ray.kill(victim))
        out = manager.generate_sequences(batch([f"q{i}" for i in range(16)]))
        timer.join()
        assert timer.fired
        assert len(out) == 16
        # re-run on the surviving worker
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 16
        assert out.non_tensor_batch["index"].tolist() == list(range(16))  # in the batch's order
        f = faults(out)
        assert (
            f["worker_restarts"] == 1
            and f["sample_retries"] == 8
            and f["samples_failed_by_faults"] == 0
        )
        # the dead worker's in-flight slots were released: nothing stays counted once the batch is
        # done
        assert wait_until(lambda: not any(ray.get(manager.balancer.stats.remote())["in_flight"]))
        assert wait_until(lambda: len(manager.agent_loop_workers) == 2)  # the replacement joined
        assert victim not in manager.agent_loop_workers
        nxt = manager.generate_sequences(batch([f"n{i}" for i in range(8)]))
        assert (
            nxt.non_tensor_batch["status"].tolist() == ["stop"] * 8
            and faults(nxt)["worker_restarts"] == 0
        )
    finally:
        manager.shutdown()


def test_without_retries_a_dead_workers_samples_are_error_rows(ray_session, monkeypatch):
    ray = ray_session
    manager = make_manager(ray, num_servers=1, delay=1.0, max_sample_retries=0)
    try:
        victim, servers = manager.agent_loop_workers[1], list(manager.server_handles)
        timer = When(lambda: server_calls(servers) > 0, lambda: ray.kill(victim))
        out = manager.generate_sequences(batch([f"q{i}" for i in range(8)]))
        timer.join()
        assert timer.fired
        status = out.non_tensor_batch["status"].tolist()
        assert status == ["stop"] * 4 + ["error"] * 4
        assert all("worker running this sample died" in e and "max_sample_retries=0" in e
                   for e in out.non_tensor_batch["error"].tolist()[4:])
        assert (
            out.batch["response_mask"][4:].sum() == 0
            and faults(out)["samples_failed_by_faults"] == 4
        )
    finally:
        manager.shutdown()


def test_a_worker_whose_event_loop_hangs_is_cut_at_the_batch_deadline(ray_session, monkeypatch):
    ray = ray_session
    monkeypatch.setenv("AGENTLOOP_TEST_BLOCK_S", "30")
    manager = make_manager(ray, num_servers=1, delay=0.0, batch_timeout=2)
    manager.workers.batch_grace_s = 1.0
    try:
        out = manager.generate_sequences(
            batch(["block", "a", "b", "c"], agent_name="blocking_probe")
        )
        assert out.non_tensor_batch["status"].tolist() == ["timeout", "timeout", "stop", "stop"]
        assert "hung past agent.batch_timeout=2" in out.non_tensor_batch["error"][0]
        assert faults(out)["workers_hung"] == 1
        assert wait_until(lambda: len(manager.agent_loop_workers) == 2)
        nxt = manager.generate_sequences(batch(["x", "y", "z", "w"], agent_name="blocking_probe"))
        assert nxt.non_tensor_batch["status"].tolist() == ["stop"] * 4
    finally:
        manager.shutdown()


def test_a_worker_whose_event_loop_hangs_is_killed_without_a_batch_deadline(
    ray_session, monkeypatch
):
    """No agent.batch_timeout (the default): before, a loop blocking its worker held the batch until
    it woke up. Now the worker is killed after agent.stall_timeout without answering a ping; its
    samples are re-run (the blocking one hangs its second worker too, then its rows are errors that
    say so) and the rest are fine."""
    ray = ray_session
    monkeypatch.setenv("AGENTLOOP_TEST_BLOCK_S", "600")
    manager = make_manager(ray, num_servers=1, delay=0.0, stall_timeout=2)
    manager.workers.tick_s = 0.2
    try:
        out = manager.generate_sequences(
            batch(["block", "a", "b", "c"], agent_name="blocking_probe")
        )
        assert out.non_tensor_batch["status"].tolist() == ["error", "error", "stop", "stop"]
        assert all(
            "hung: a ping went unanswered for 2 s (agent.stall_timeout)" in e
            and "retries were used" in e
            for e in out.non_tensor_batch["error"].tolist()[:2]
        )
        assert faults(out)["workers_hung"] == 2 and faults(out)["sample_retries"] == 2
        assert wait_until(lambda: len(manager.agent_loop_workers) == 2)
        nxt = manager.generate_sequences(batch(["x", "y", "z", "w"], agent_name="blocking_probe"))
        assert nxt.non_tensor_batch["status"].tolist() == ["stop"] * 4
    finally:
        manager.shutdown()


def test_a_server_killed_mid_batch_fails_over_and_is_restarted(ray_session, monkeypatch):
    ray = ray_session
    manager = make_manager(ray, num_servers=2, delay=1.0)
    try:
        dead = manager.server_handles[0]
        # with requests of its own
        timer = When(lambda: server_calls([dead]) > 0, lambda: ray.kill(dead))
        out = manager.generate_sequences(batch([f"q{i}" for i in range(8)]))
        timer.join()
        assert timer.fired
        # the dead server's requests moved
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 8
        f = faults(out)
        assert f["server_failovers"] >= 1 and f["servers_down"] == 1
        # restarted in the background
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        nxt = manager.generate_sequences(batch([f"n{i}" for i in range(8)]))
        assert nxt.non_tensor_batch["status"].tolist() == ["stop"] * 8
        assert faults(nxt)["servers_restarted"] == 1 and faults(nxt)["servers_down"] == 0
        assert manager.server_handles[0] is not dead
        served = {m for m in nxt.non_tensor_batch.get("server_index", []) if m is not None}
        assert served <= {0, 1}
        assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]
    finally:
        manager.shutdown()


def test_a_server_whose_event_loop_hangs_is_killed_its_requests_fail_over_and_it_is_restarted(
    ray_session, monkeypatch
):
    """The server actor itself stops answering (its event loop blocked for minutes): before, its
    requests held the batch until the loop woke up (or forever); now the mid-batch health look kills
    it after server.stall_timeout seconds, its requests fail over and it is restarted."""
    ray = ray_session
    manager = make_manager(ray, num_servers=2, delay=1.0, root={
        "actor_rollout_ref.rollout.server.stall_timeout": 2})
    manager.workers.tick_s = 0.2
    try:
        hung = manager.server_handles[0]
        timer = When(lambda: server_calls([hung]) > 0, lambda: hung.freeze.remote(600))
        out = manager.generate_sequences(batch([f"q{i}" for i in range(8)]))
        timer.join()
        assert timer.fired
        # the hung server's requests moved
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 8
        f = faults(out)
        assert f["servers_hung"] == 1 and f["server_failovers"] >= 1 and f["servers_down"] == 1
        with pytest.raises(ray.exceptions.RayActorError):  # killed, not left blocking a process
            ray.get(hung.check_health.remote(), timeout=30)
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        nxt = manager.generate_sequences(batch([f"n{i}" for i in range(8)]))
        assert nxt.non_tensor_batch["status"].tolist() == ["stop"] * 8
        assert faults(nxt)["servers_restarted"] == 1 and faults(nxt)["servers_hung"] == 0
        assert manager.server_handles[0] is not hung
    finally:
        manager.shutdown()


def test_an_engine_that_dies_inside_its_only_server_is_restarted(ray_session, monkeypatch):
    ray = ray_session
    manager = make_manager(ray, num_servers=1, delay=0.0)
    try:
        ray.get(manager.server_handles[0].kill_engine.remote())
        out = manager.generate_sequences(batch(["a", "b"]))
        # nowhere to fail over to
        assert out.non_tensor_batch["status"].tolist() == ["error", "error"]
        assert all("engine process died" in e for e in out.non_tensor_batch["error"].tolist())
        assert faults(out)["servers_down"] == 1
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        nxt = manager.generate_sequences(batch(["c", "d"]))
        assert nxt.non_tensor_batch["status"].tolist() == ["stop", "stop"]
        assert faults(nxt)["servers_restarted"] == 1
    finally:
        manager.shutdown()


def test_servers_lost_before_or_during_a_weight_update_do_not_stop_it(ray_session, monkeypatch):
    """Of three servers, one's engine died and one's actor is gone before update_weights (no batch
    found them yet), and on the next update a restarted one hangs inside it: each update completes
    on the servers left, the lost ones are restarted, get the weights at the following update and
    serve again."""
    import torch

    ray = ray_session
    # 5 s: long enough for a live server's answer while two replacement actors start beside it on 2
    # busy cores
    # (CI once saw 2 s pass), short enough to show the hung one is cut, not waited for
    manager = make_manager(ray, num_servers=3, delay=0.0,
                           root={"actor_rollout_ref.rollout.server.weight_update_timeout": 5})
    try:
        engine_dead, actor_dead, alive = manager.server_handles
        ray.get(engine_dead.kill_engine.remote())
        ray.kill(actor_dead)
        assert manager.update_weights({"w": torch.ones(2)}, global_steps=5) == 5
        assert ray.get(alive.check_health.remote())["global_steps"] == 5
        assert ray.get(manager.balancer.stats.remote())["healthy"] == [0, 0, 1]
        # restarted: old weights
        assert wait_until(lambda: manager.recover()["servers_awaiting_weights"] == 2)
        restarted = manager.supervisor.awaiting_weights()
        # this one now hangs inside the next update
        ray.get(restarted[0].stall_weight_updates.remote())
        t0 = time.monotonic()
        assert manager.update_weights({"w": torch.full((2,), 2.0)}, global_steps=6) == 6
        assert time.monotonic() - t0 < 30  # cut at weight_update_timeout (5 s), not waited for
        state = manager.recover()
        assert state["servers_down"] == 1 and manager.server_handles[1] is restarted[1]
        assert ray.get(manager.server_handles[1].check_health.remote())["global_steps"] == 6
        # the hung one, again
        assert wait_until(lambda: manager.recover()["servers_awaiting_weights"] == 1)
        assert manager.update_weights({"w": torch.full((2,), 3.0)}, global_steps=7) == 7
        assert manager.recover()["servers_down"] == 0
        out = manager.generate_sequences(batch([f"q{i}" for i in range(12)]))
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 12
        assert set(out.non_tensor_batch["max_global_steps"].tolist()) == {7}
        assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1, 1]
    finally:
        manager.shutdown()


def test_a_weight_update_with_no_server_left_raises_naming_recover(ray_session, monkeypatch):
    import torch

    from agentloop.errors import ServerError

    ray = ray_session
    manager = make_manager(ray, num_servers=1, delay=0.0)
    try:
        ray.get(manager.server_handles[0].kill_engine.remote())
        with pytest.raises(ServerError, match=r"no rollout server is left.*recover\(\)"):
            manager.update_weights({"w": torch.ones(2)}, global_steps=1)
        # no version was published, so the restarted server (initial weights) serves again as
        # version 0
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        assert manager.update_weights({"w": torch.ones(2)}, global_steps=2) == 2
        out = manager.generate_sequences(batch(["a", "b"]))
        assert out.non_tensor_batch["status"].tolist() == ["stop", "stop"]
    finally:
        manager.shutdown()


def test_a_dead_server_does_not_fail_pause_resume_sleep_wake_up_or_clear_kv_cache(
    ray_session, monkeypatch
):
    """A trainer's per-step calls (pause/resume around an update, sleep/wake_up around a colocated
    step, clear_kv_cache) go on past a server whose actor or engine died since the last batch: it is
    taken out of routing and restarted, as in a batch or an update, instead of the call raising into
    the training loop."""
    ray = ray_session
    manager = make_manager(ray, num_servers=3, delay=0.0)
    try:
        assert manager.can_sleep  # the scripted servers "can sleep"
        kill_and_wait(manager.server_handles[0], "check_health")  # an actor gone
        # an engine dead inside a live actor
        ray.get(manager.server_handles[1].kill_engine.remote())
        assert manager.pause() == 0
        assert manager.recover()["servers_down"] == 2  # found by the pause, restarting
        manager.resume()
        manager.sleep()
        assert manager.sleeping
        manager.wake_up()
        manager.clear_kv_cache()
        assert ray.get(manager.server_handles[2].check_health.remote())
        # both back (version 0: no weights due)
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        ray.get(manager.server_handles[2].kill_engine.remote())
        manager.sleep()  # the third dies while the others serve: found here
        manager.wake_up()
        assert manager.recover()["servers_down"] == 1
        out = manager.generate_sequences(batch([f"q{i}" for i in range(6)]))
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 6
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1, 1]
    finally:
        manager.shutdown()


def test_a_dead_gateway_is_replaced_before_the_next_batch(ray_session, monkeypatch):
    """External agents' gateway actors: one killed between batches is replaced before the next (the
    workers get the new set), and a restarted server is put back even while a gateway it must be
    told about is dead."""
    ray = ray_session
    manager = make_manager(ray, num_servers=2, delay=0.0,
                           root={"actor_rollout_ref.rollout.gateway.num_gateways": 2})
    try:
        ok = {"stop", "length"}
        out = manager.generate_sequences(
            batch([f"q{i}" for i in range(4)], agent_name="gateway_probe")
        )
        assert set(out.non_tensor_batch["status"].tolist()) <= ok, out.non_tensor_batch[
            "error"
        ].tolist()
        first = list(manager.gateways)
        kill_and_wait(first[0], "num_sessions")  # ray.kill returns before the actor is gone
        kill_and_wait(manager.server_handles[0], "check_health")
        out = manager.generate_sequences(
            batch([f"q{i}" for i in range(6)], agent_name="gateway_probe")
        )
        assert set(out.non_tensor_batch["status"].tolist()) <= ok, out.non_tensor_batch[
            "error"
        ].tolist()
        assert faults(out)["gateways_replaced"] == 1 and faults(out)["servers_down"] == 1
        assert manager.gateways[0] is not first[0] and manager.gateways[1] is first[1]
        # dead when the restarted server is handed to the gateways
        kill_and_wait(first[1], "num_sessions")
        assert wait_until(lambda: manager.recover()["servers_down"] == 0)
        out = manager.generate_sequences(
            batch([f"q{i}" for i in range(6)], agent_name="gateway_probe")
        )
        assert set(out.non_tensor_batch["status"].tolist()) <= ok, out.non_tensor_batch[
            "error"
        ].tolist()
        assert faults(out)["gateways_replaced"] == 1 and faults(out)["servers_restarted"] == 1
        assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]
    finally:
        manager.shutdown()


def test_a_gateway_whose_event_loop_hangs_is_killed_and_replaced(ray_session, monkeypatch):
    """A gateway actor blocked mid-batch (its HTTP server answers nothing): before, its sessions
    held the batch until the loop woke up; now it is killed after server.stall_timeout, its sessions
    are error rows saying it hung, the other gateway's are fine, and it is replaced before the next
    batch."""
    ray = ray_session
    manager = make_manager(
        ray,
        num_servers=2,
        delay=1.0,
        root={
            "actor_rollout_ref.rollout.gateway.num_gateways": 2,
            "actor_rollout_ref.rollout.server.stall_timeout": 2,
        },
    )
    manager.workers.tick_s = 0.2
    try:
        # the gateways start
        manager.generate_sequences(batch(["a", "b"], agent_name="gateway_probe"))
        hung, servers = manager.gateways[0], list(manager.server_handles)
        before = server_calls(servers)
        timer = When(lambda: server_calls(servers) > before,  # the batch's sessions are open
                     # blocks its loop
                     lambda: hung.__ray_call__.remote(lambda self: time.sleep(600)))
        out = manager.generate_sequences(
            batch([f"q{i}" for i in range(8)], agent_name="gateway_probe")
        )
        timer.join()
        assert timer.fired
        status = out.non_tensor_batch["status"].tolist()
        # sessions go to both gateways in turn
        assert status.count("stop") == 4 and status.count("error") == 4
        errors = [e for e in out.non_tensor_batch["error"].tolist() if e]
        assert len(errors) == 4 and all(
            "gateway 0 hung" in e and "stall_timeout" in e for e in errors
        ), errors
        assert faults(out)["gateways_hung"] == 1
        nxt = manager.generate_sequences(
            batch([f"n{i}" for i in range(8)], agent_name="gateway_probe")
        )
        assert nxt.non_tensor_batch["status"].tolist() == ["stop"] * 8
        assert faults(nxt)["gateways_replaced"] == 1 and manager.gateways[0] is not hung
    finally:
        manager.shutdown()


def grouped(texts_per_group: list[list[str]]):
    """Group g's rows share ``group`` g (rows of different groups interleaved on purpose)."""
    from agentloop.batch.data import rows_to_batch

    rows = [
        {
            "prompt": [{"role": "user", "content": t}], "agent_name": "sleepy_probe",
            "group": f"g{g}", "extra_info": {"index": g},
        }
        for g, texts in enumerate(texts_per_group)
        for t in texts
    ]
    rows = rows[::2] + rows[1::2]
    return rows_to_batch(rows)


def test_stream_yields_each_complete_group_once_in_completion_order(ray_session, monkeypatch):
    ray = ray_session
    manager = make_manager(ray, num_servers=2, delay=0.0)
    try:
        groups = [
            ["sleep 3", "sleep 0"], ["sleep 0", "sleep 0.2"], ["sleep 1.5", "sleep 0"],
            ["sleep 0", "sleep 0"],
        ]
        got = list(manager.generate_sequences_stream(grouped(groups), group_by="group"))
        uids = [set(part.non_tensor_batch["group"].tolist()) for part in got]
        # whole groups
        assert all(len(u) == 1 for u in uids) and [len(p) for p in got] == [2, 2, 2, 2]
        order = [u.pop() for u in uids]
        assert sorted(order) == ["g0", "g1", "g2", "g3"]  # each exactly once
        assert order.index("g0") == 3 and order.index("g2") == 2  # the slow groups come last
        assert all(set(p.non_tensor_batch["status"].tolist()) == {"stop"} for p in got)
        widths = {tuple(p.batch["input_ids"].shape[1:]) for p in got}
        assert len(widths) == 1  # same padded layout: the parts concatenate
        assert (
            "agent_loop/wall" in got[0].meta_info["timing"]
            and len(got[0].meta_info["metrics"]) == 2
        )
    finally:
        manager.shutdown()


def test_stream_survives_a_dead_worker_and_closing_it_cancels_the_rest(ray_session, monkeypatch):
    ray = ray_session
    manager = make_manager(ray, num_servers=1, delay=0.0)
    try:
        groups = [["sleep 1", "sleep 1"] for _ in range(6)]
        timer = later(0.5, ray.kill, manager.agent_loop_workers[0])
        got = list(manager.generate_sequences_stream(grouped(groups), group_by="group"))
        timer.join()
        order = sorted(u for p in got for u in set(p.non_tensor_batch["group"].tolist()))
        assert order == [f"g{g}" for g in range(6)] and sum(len(p) for p in got) == 12
        assert {s for p in got for s in p.non_tensor_batch["status"].tolist()} == {"stop"}
        assert sum(p.meta_info["timing"]["agent_loop/faults/sample_retries"] for p in got) == 6
        stream = manager.generate_sequences_stream(
            grouped([["sleep 0"]] + [["sleep 30"]] * 3), group_by="group"
        )
        first = next(stream)
        stream.close()  # the three 30 s samples are cancelled, not waited for
        assert first.non_tensor_batch["group"].tolist() == ["g0"]
        out = manager.generate_sequences(batch(["a", "b"]))
        assert out.non_tensor_batch["status"].tolist() == ["stop", "stop"]
    finally:
        manager.shutdown()


def prompt_batches(num_batches: int, groups: int, n: int, seconds: float):
    from agentloop.batch.data import repeat_for_rollout, rows_to_batch

    for b in range(num_batches):
        rows = [
            {
                "prompt": [{"role": "user", "content": f"sleep {seconds}"}],
                "agent_name": "sleepy_probe", "extra_info": {"index": b * groups + g},
            }
            for g in range(groups)
        ]
        yield repeat_for_rollout(rows_to_batch(rows), n)


def test_rollouter_hands_out_every_group_once_within_its_inflight_budget(ray_session, monkeypatch):
    from agentloop.rollout.rollouter import Rollouter

    manager = make_manager(ray_session, num_servers=2, delay=0.0)
    try:
        rollouter = Rollouter(
            manager, prompt_batches(3, 4, 2, 0.3), max_inflight=4, groups_per_dispatch=1
        )
        peak = []
        got = []
        while (part := rollouter.get(num_groups=3)) is not None:
            got.append(part)
            peak.append(part.meta_info["rollouter"]["rollouter/inflight_samples"])
        uids = [u for p in got for u in p.non_tensor_batch["uid"].tolist()]
        assert (
            len(uids) == 24 and len(set(uids)) == 12 and all(uids.count(u) == 2 for u in set(uids))
        )
        assert max(peak) <= 4
        m = rollouter.metrics()
        assert m["rollouter/groups_handed_out"] == 12 and m["rollouter/staleness"] == {0: 12}
        rollouter.stop()
    finally:
        manager.shutdown()


def test_rollouter_hands_out_failed_groups_together_with_good_ones(ray_session, monkeypatch):
    """A group whose samples all failed lacks columns the others have (versions, prompt_truncated):
    get() used to raise DataProtoError into the training loop when it handed both out together."""
    from agentloop.batch.data import repeat_for_rollout, rows_to_batch
    from agentloop.rollout.rollouter import Rollouter

    manager = make_manager(ray_session, num_servers=1, delay=0.0)
    try:
        rows = [
            {
                "prompt": [{"role": "user", "content": "sleep 0.1"}], "agent_name": name,
                "extra_info": {"index": i},
            }
            for i, name in enumerate(["sleepy_probe", "exploding_probe", "single_turn_agent"])
        ]
        rollouter = Rollouter(manager, [repeat_for_rollout(rows_to_batch(rows), 2)], max_inflight=8,
                              groups_per_dispatch=1)
        out = rollouter.get(num_groups=3)
        rollouter.stop()
        by_loop = dict(
            zip(
                out.non_tensor_batch["agent_name"].tolist(),
                out.non_tensor_batch["status"].tolist(), strict=True,
            )
        )
        assert len(out) == 6 and by_loop == {"sleepy_probe": "stop", "exploding_probe": "error",
                                             "single_turn_agent": "stop"}
        failed = out.non_tensor_batch["agent_name"] == "exploding_probe"
        assert all("the tool exploded" in e for e in out.non_tensor_batch["error"][failed].tolist())
        assert out.batch["response_mask"][failed].sum() == 0  # nothing to learn from
        # not invented
        assert all(v is None for v in out.non_tensor_batch["min_global_steps"][failed].tolist())
    finally:
        manager.shutdown()


def test_rollouter_gives_up_on_a_sample_that_hangs_every_worker_it_runs_on(
    ray_session, monkeypatch
):
    """Before, a group whose worker died was rolled out again with no limit: a sample that blocks
    its worker's event loop would have killed a worker every agent.stall_timeout, forever.  Now,
    after max_sample_retries, it is handed out as error rows saying why, and the rollout ends."""
    from agentloop.batch.data import repeat_for_rollout, rows_to_batch
    from agentloop.rollout.rollouter import Rollouter

    monkeypatch.setenv("AGENTLOOP_TEST_BLOCK_S", "600")
    manager = make_manager(ray_session, num_servers=1, delay=0.0, stall_timeout=2)
    manager.workers.tick_s = 0.2
    try:
        rows = [{"prompt": [{"role": "user", "content": text}], "agent_name": "blocking_probe",
                 # on two workers
                 "extra_info": {"index": i}} for i, text in enumerate(["block", "a"])]
        rollouter = Rollouter(manager, [repeat_for_rollout(rows_to_batch(rows), 1)], max_inflight=8,
                              groups_per_dispatch=1)
        handed = [p for p in iter(lambda: rollouter.get(num_groups=1, timeout=120), None)]
        rollouter.stop()
        status = {
            int(p.non_tensor_batch["index"][0]): p.non_tensor_batch["status"][0] for p in handed
        }
        assert status == {0: "error", 1: "stop"}
        error = next(p for p in handed if p.non_tensor_batch["index"][0] == 0).non_tensor_batch[
            "error"
        ][0]
        assert (
            "hung: a ping went unanswered for 2 s" in error
            and "max_sample_retries=1 retries were used" in error
        )
        m = rollouter.metrics()
        assert m["rollouter/groups_rerun_fault"] == 1 and m["rollouter/groups_failed_fault"] == 1
        # its first worker, then the one it was re-run on
        assert manager.workers.fault_counts["workers_hung"] == 2
    finally:
        manager.shutdown()


def test_rollouter_bounds_staleness_across_weight_updates(ray_session, monkeypatch):
    import torch

    from agentloop.rollout.rollouter import Rollouter

    manager = make_manager(ray_session, num_servers=1, delay=0.0)
    try:
        rollouter = Rollouter(
            manager, prompt_batches(2, 6, 2, 1.0), max_inflight=8, max_staleness=0
        ).start()
        first = rollouter.get(num_groups=2)
        # groups still running started at version 0: too stale
        manager.update_weights({"w": torch.zeros(2)})
        rest = [p for p in iter(lambda: rollouter.get(num_groups=2), None)]
        handed = [first, *rest]
        assert sum(len(p) for p in handed) == 24  # every group handed out once, none lost
        assert all(set(p.non_tensor_batch["min_global_steps"].tolist()) == {1} for p in rest)
        m = rollouter.metrics()
        assert m["rollouter/groups_rerun_stale"] > 0 and set(m["rollouter/staleness"]) == {0}
        rollouter.stop()
    finally:
        manager.shutdown()


def eight_tokens(prompt_ids: list[int], params: dict, request_id: str) -> list[int]:
    """A deterministic "model": the continuation of 40..47 after what the prompt (5, 6, 7 +
    tokens) already has."""
    return [40, 41, 42, 43, 44, 45, 46, 47][len(prompt_ids) - 3:]


def test_pause_update_resume_cycles_during_a_batch_lose_nothing(ray_session, monkeypatch):
    """Three pause -> update_weights -> resume cycles while a batch runs (tokens handed out one per
    0.1 s): with partial_rollout every sample still gets its 8 tokens, exactly as uninterrupted,
    spanning several versions."""
    import torch

    manager = make_manager(ray_session, num_servers=1, delay=0.0,
                           server_kwargs={"responses": eight_tokens, "token_delay": 0.1},
                           root={"async_training.partial_rollout": True})
    try:
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(out=manager.generate_sequences(
            batch([f"sleep 0.{i}" for i in range(8)], agent_name="sleepy_probe"))))
        worker.start()
        server = manager.server_handles[0]
        # the batch is generating (then cycles 0.25 s apart)
        assert wait_until(lambda: server_calls([server]) > 0)
        cut = 0
        for version in (1, 2, 3):
            time.sleep(0.25)  # the scenario: about two tokens (0.1 s each) between cuts
            cut += manager.pause()
            manager.update_weights({"w": torch.full((2,), float(version))}, global_steps=version)
            manager.resume()
        worker.join(60)
        out = result["out"]
        assert cut > 0  # requests really were cut mid-generation
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 8  # none aborted, none failed
        assert out.batch["responses"][:, :8].tolist() == [[40, 41, 42, 43, 44, 45, 46, 47]] * 8
        assert max(out.non_tensor_batch["max_global_steps"].tolist()) == 3
        # tokens from several versions
        assert min(out.non_tensor_batch["min_global_steps"].tolist()) < 3
    finally:
        manager.shutdown()
