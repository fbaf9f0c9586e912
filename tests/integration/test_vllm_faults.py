"""Server faults on the real engine (2 vLLM CPU servers, tiny model): an engine process SIGKILLed,
an engine that hangs (SIGSTOP) and a server actor killed mid-batch, and an engine that died between
batches when the next weight update starts.  Each time every row comes back (the dead or hung
server's requests fail over to the other one with their tokens), the update goes on without the dead
server, the dead server is restarted in its slot, and after a weight update made the initial weights
stale, the restarted engine rejoins only once the next update loaded the current weights into it."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def manager():
    import ray

    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "data.max_prompt_length": 128, "data.max_response_length": 48,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        # eager: ~10 s less per CPU engine start (compiled, the default: test_vllm_envs CLI test)
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": 2,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        # every request decodes all 48 tokens: a kill lands mid-request
        "actor_rollout_ref.rollout.ignore_eos": True,
        # a hung engine is found in seconds, not 5 minutes
        "actor_rollout_ref.rollout.server.stall_timeout": 5,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()


def make_batch(n: int):
    from agentloop.batch.data import rows_to_batch

    return rows_to_batch([{"prompt": [{"role": "user", "content": f"Tell me about item {i}."}],
                           "extra_info": {"index": i}} for i in range(n)])


def engine_pids(server_pid: int) -> list[int]:
    """The engine-core processes a server actor spawned (its children)."""
    import psutil

    return [c.pid for c in psutil.Process(server_pid).children(recursive=True)]


def kill_engine(pids: list[int], timeout: float = 30.0) -> None:
    """SIGKILL the engine processes and wait until they are gone."""
    import psutil

    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=timeout)


def _process(pid: int) -> Any:
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def kill_when_busy(
    manager: Any, server: int, pids: list[int], sig: int = signal.SIGKILL
) -> threading.Thread:
    """SIGKILL (or send ``sig`` to) ``server``'s engine as soon as the balancer counts a request in
    flight on it (a fixed delay raced the batch: the tiny model can finish a whole batch in 0.3 s).
    """
    import ray

    def run() -> None:
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and not ray.get(manager.balancer.stats.remote())["in_flight"][server]
        ):
            time.sleep(0.005)
        if sig == signal.SIGKILL:
            kill_engine(pids)
        else:
            for pid in pids:
                os.kill(pid, sig)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def faults(out) -> dict[str, float]:
    return {k.rsplit("/", 1)[-1]: v for k, v in out.meta_info["timing"].items() if "/faults/" in k}


def wait_recovered(manager: Any, timeout: float = 240.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    state = manager.recover()
    while state["servers_restarting"] and time.monotonic() < deadline:
        state = manager.recover(timeout=5.0)
    return state


def test_a_sigkilled_engine_fails_over_and_its_server_is_restarted(manager):
    import ray

    server_pid = manager.servers.info[0]["pid"]
    children = engine_pids(server_pid)
    assert children, "the vLLM server should run its engine core in a child process"
    killer = kill_when_busy(manager, 0, children)
    out = manager.generate_sequences(make_batch(8))
    killer.join()
    status = out.non_tensor_batch["status"].tolist()
    assert len(out) == 8 and set(status) <= {"stop", "length"}, out.non_tensor_batch[
        "error"
    ].tolist()
    assert faults(out)["server_failovers"] >= 1 and faults(out)["servers_down"] == 1
    old = manager.server_handles[0]
    state = wait_recovered(manager)
    assert state["servers_down"] == 0 and manager.server_handles[0] is not old
    nxt = manager.generate_sequences(make_batch(8))
    assert set(nxt.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert faults(nxt)["servers_restarted"] == 1
    assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]


def test_a_hung_engine_is_killed_its_requests_fail_over_and_its_server_is_restarted(manager):
    """The engine stops making progress while alive (its processes SIGSTOPped mid-batch, as a hung
    collective would leave it): after ``server.stall_timeout`` (5 s here) its requests fail over,
    its processes are killed and the server is restarted; without the stall watch this batch never
    returned."""
    import psutil
    import ray

    children = engine_pids(manager.servers.info[0]["pid"])
    stopper = kill_when_busy(manager, 0, children, sig=signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = manager.generate_sequences(make_batch(8))
        took = time.monotonic() - t0
        stopper.join()
        status = out.non_tensor_batch["status"].tolist()
        assert len(out) == 8 and set(status) <= {"stop", "length"}, out.non_tensor_batch[
            "error"
        ].tolist()
        assert faults(out)["server_failovers"] >= 1 and faults(out)["servers_down"] == 1
        assert took < 120, took
        gone = psutil.wait_procs([p for p in map(_process, children) if p is not None], timeout=30)[
            1
        ]
        assert not gone, f"the hung engine's processes were left running: {gone}"
        old = manager.server_handles[0]
        state = wait_recovered(manager)
        assert state["servers_down"] == 0 and manager.server_handles[0] is not old
        nxt = manager.generate_sequences(make_batch(8))
        assert set(nxt.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
        assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]
    finally:
        for pid in children:  # never leave stopped processes behind a failed assertion
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_server_actor_rejoins_only_with_the_current_weights(manager):
    import ray
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(manager.config.model.path).state_dict()
    assert manager.update_weights(weights, global_steps=7) == 7
    victim = manager.server_handles[1]
    ray.kill(victim)  # the routers do not know yet: its requests fail and move to server 0
    out = manager.generate_sequences(make_batch(8))
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert faults(out)["servers_down"] == 1
    state = wait_recovered(manager)
    # initial weights: held out
    assert state["servers_down"] == 1 and state["servers_awaiting_weights"] == 1
    assert manager.update_weights(weights, global_steps=8) == 8
    assert manager.recover()["servers_down"] == 0 and manager.server_handles[1] is not victim
    nxt = manager.generate_sequences(make_batch(8))
    assert set(nxt.non_tensor_batch["max_global_steps"].tolist()) == {8}
    assert set(nxt.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]


def test_an_engine_dead_before_a_weight_update_is_left_out_of_it_and_restarted(manager):
    """The engine dies between batches (no batch found it yet): update_weights completes on the
    other server instead of raising the engine's error; the dead one is restarted and rejoins with
    the next update."""
    import ray
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(manager.config.model.path).state_dict()
    old = manager.server_handles[0]
    kill_engine(engine_pids(manager.servers.info[0]["pid"]))
    assert manager.update_weights(weights, global_steps=9) == 9
    assert ray.get(manager.server_handles[1].check_health.remote())["global_steps"] == 9
    state = wait_recovered(manager)
    assert state["servers_down"] == 1 and state["servers_awaiting_weights"] == 1
    out = manager.generate_sequences(make_batch(8))  # served by server 1 alone meanwhile
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert manager.update_weights(weights, global_steps=10) == 10
    assert manager.recover()["servers_down"] == 0 and manager.server_handles[0] is not old
    nxt = manager.generate_sequences(make_batch(8))
    assert set(nxt.non_tensor_batch["max_global_steps"].tolist()) == {10}
    assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]


def test_pause_resume_and_clear_kv_cache_go_on_past_a_dead_engine(manager):
    """The calls a trainer makes between batches do not raise vLLM's EngineDeadError into the
    training loop: the server whose engine died is taken out and restarted, the others are paused,
    resumed and cleared."""
    import ray
    from transformers import AutoModelForCausalLM

    kill_engine(engine_pids(manager.servers.info[1]["pid"]))
    assert manager.pause() == 0
    assert manager.recover()["servers_down"] == 1
    manager.resume()
    manager.clear_kv_cache()
    out = manager.generate_sequences(make_batch(4))  # server 0 alone meanwhile
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    state = wait_recovered(manager)
    weights = AutoModelForCausalLM.from_pretrained(manager.config.model.path).state_dict()
    # rejoins with them
    version = manager.update_weights(weights, global_steps=manager.weight_version + 1)
    assert state["servers_awaiting_weights"] == 1 and manager.recover()["servers_down"] == 0
    nxt = manager.generate_sequences(make_batch(8))
    assert set(nxt.non_tensor_batch["max_global_steps"].tolist()) == {version}
    assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]
