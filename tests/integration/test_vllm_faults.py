"""Server faults on the real engine (2 vLLM CPU servers, tiny model): an engine process SIGKILLed and a server
actor killed mid-batch.  Each time every row comes back (the dead server's requests fail over to the other one
with their tokens), the dead server is restarted in its slot, and after a weight update made the initial weights
stale, the restarted engine rejoins only once the next update loaded the current weights into it."""

from __future__ import annotations

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
    from agentloop.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "data.max_prompt_length": 128, "data.max_response_length": 48,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": 2,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()


def make_batch(n: int):
    from agentloop.data import rows_to_batch

    return rows_to_batch([{"prompt": [{"role": "user", "content": f"Tell me about item {i}."}],
                           "extra_info": {"index": i}} for i in range(n)])


def engine_pids(server_pid: int) -> list[int]:
    """The engine-core processes a server actor spawned (its children)."""
    import psutil

    return [c.pid for c in psutil.Process(server_pid).children(recursive=True)]


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
    timer = threading.Timer(0.3, lambda: [os.kill(p, signal.SIGKILL) for p in children])
    timer.start()
    out = manager.generate_sequences(make_batch(8))
    timer.join()
    status = out.non_tensor_batch["status"].tolist()
    assert len(out) == 8 and set(status) <= {"stop", "length"}, out.non_tensor_batch["error"].tolist()
    assert faults(out)["servers_down"] == 1
    old = manager.server_handles[0]
    state = wait_recovered(manager)
    assert state["servers_down"] == 0 and manager.server_handles[0] is not old
    nxt = manager.generate_sequences(make_batch(8))
    assert set(nxt.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert faults(nxt)["servers_restarted"] == 1
    assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]


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
    assert state["servers_down"] == 1 and state["servers_awaiting_weights"] == 1  # initial weights: held out
    assert manager.update_weights(weights, global_steps=8) == 8
    assert manager.recover()["servers_down"] == 0 and manager.server_handles[1] is not victim
    nxt = manager.generate_sequences(make_batch(8))
    assert set(nxt.non_tensor_batch["max_global_steps"].tolist()) == {8}
    assert set(nxt.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert ray.get(manager.balancer.stats.remote())["healthy"] == [1, 1]
