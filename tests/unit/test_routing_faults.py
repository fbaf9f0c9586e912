"""Router and balancer under server faults: dead servers leave routing, requests fail over with
their tokens, a dead owner's slots are released, a restarted server comes back (no Ray: in-process
fake servers).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from omegaconf import OmegaConf
from ray.exceptions import RayActorError, RayTaskError

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.errors import RoutingError, ServerError
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager, make_balancer
from agentloop.servers.base import ServerDeadError
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import FakeTokenizer


def test_balancer_never_routes_to_a_down_server_and_rebinds_its_sticky_sessions():
    bal = make_balancer(3, seed=0)
    first = bal.acquire("conv")
    bal.release(first)
    bal.mark_down(first)
    chosen = {bal.acquire(f"r{i}") for i in range(30)}
    assert first not in chosen and chosen == set(range(3)) - {first}
    # the session was bound to the dead server: bound anew to a live one
    again = bal.acquire("conv")
    assert again != first and bal.lookup("conv") == again
    bal.mark_up(first)
    assert bal.stats()["healthy"] == [1, 1, 1] and bal.in_flight[first] == 0
    for server in (0, 1, 2):
        bal.mark_down(server)
    with pytest.raises(RoutingError, match="all 3 rollout servers are marked down"):
        bal.acquire("x")


def test_release_owner_frees_only_that_owners_slots_and_late_releases_are_ignored():
    bal = make_balancer(2, seed=0)
    a = [bal.acquire(f"a{i}", owner="worker-a") for i in range(4)]
    b = bal.acquire("b0", owner="worker-b")
    assert sum(bal.in_flight) == 5
    assert bal.release_owner("worker-a") == 4
    assert sum(bal.in_flight) == 1 and bal.in_flight[b] == 1
    for server in a:  # a release the dead worker had queued arrives late: not counted twice
        bal.release(server, "worker-a")
    assert bal.in_flight[b] == 1
    bal.release(b, "worker-b")
    assert bal.in_flight == [0, 0]


def test_a_request_fails_over_to_a_live_server_with_the_same_prompt_ids():
    dead = ScriptedServer([RayActorError()], name="dead")
    live = ScriptedServer(lambda ids, params, rid: [7, 8], name="live")
    balancer = make_balancer(2, seed=0)
    balancer.in_flight[1] = 1  # least-in-flight picks the dead server first
    mgr = AsyncLLMServerManager([dead, live], balancer)
    out = asyncio.run(
        mgr.generate("turn-3", prompt_ids=[1, 2, 3, 4, 5], sampling_params={"max_tokens": 4})
    )
    assert out.token_ids == [7, 8] and out.extra_fields["server_index"] == 1
    # the accumulated tokens travel with the retry
    assert live.calls[0]["prompt_ids"] == [1, 2, 3, 4, 5]
    assert mgr.num_failovers == 1 and mgr.down == {0} and balancer.healthy == [False, True]
    assert balancer.in_flight == [0, 1]  # both slots released (1 is the one set above)
    out = asyncio.run(mgr.generate("next", prompt_ids=[1], sampling_params={}))
    assert out.extra_fields["server_index"] == 1 and len(dead.calls) == 1


def test_an_engine_death_inside_a_live_server_fails_over_too():
    broken = ScriptedServer(name="broken")
    broken.kill_engine()
    live = ScriptedServer(lambda ids, params, rid: [9], name="live")
    balancer = make_balancer(2, seed=0)
    balancer.in_flight[1] = 1
    mgr = AsyncLLMServerManager([broken, live], balancer)
    out = asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert out.token_ids == [9] and mgr.down == {0}


def test_with_every_server_dead_the_request_fails_with_a_clear_error():
    a, b = ScriptedServer(name="a"), ScriptedServer(name="b")
    a.kill_engine()
    b.kill_engine()
    mgr = AsyncLLMServerManager([a, b])
    with pytest.raises(ServerDeadError, match="engine process died"):
        asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert mgr.down == {0, 1} and mgr.num_failovers == 1
    assert isinstance(ServerDeadError("x"), ServerError)


def test_a_replaced_server_is_routed_to_again():
    dead = ScriptedServer([RayActorError()], name="dead")
    mgr = AsyncLLMServerManager([dead])
    with pytest.raises(ServerDeadError):
        asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    fresh = ScriptedServer(lambda ids, params, rid: [5], name="fresh")
    mgr.replace_server(0, fresh)
    out = asyncio.run(mgr.generate("r2", prompt_ids=[1], sampling_params={}))
    assert out.token_ids == [5] and mgr.down == set() and mgr.balancer.healthy == [True]


def test_server_dead_error_keeps_its_server_index_through_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ServerDeadError("engine gone", 3)))
    assert err.server == 3 and str(err) == "engine gone"


def ray_wrapped(cause: Exception) -> Exception:
    """``cause`` as a server actor's caller receives it: Ray's task error, an instance of the
    cause's class whose text is the remote traceback under a coloured
    ``ray::VLLMServer.generate() (pid=…, ip=…, actor_id=…)`` line."""
    trace = (
        f'Traceback (most recent call last):\n  File "vllm.py", line '
        f"1\n{type(cause).__name__}: {cause}"
    )
    return RayTaskError(
        "generate", trace, cause, proctitle="ray::VLLMServer.generate()", pid=4242, ip="10.1.2.3",
        actor_repr="VLLMServer(actor_id=abc123)", actor_id="abc123",
    ).as_instanceof_cause()


def test_a_dead_engines_error_says_what_the_server_said_not_rays_wrapper():
    said = (
        "vLLM server 0: the engine process died; the request is retried on another "
        "server and this one restarted"
    )
    dead = ScriptedServer([ray_wrapped(ServerDeadError(said, 0))], name="dead")
    mgr = AsyncLLMServerManager([dead], max_failovers=0)
    with pytest.raises(ServerDeadError) as caught:
        asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert str(caught.value) == said and caught.value.server == 0 and mgr.down == {0}
    assert not any(s in str(caught.value) for s in ("ray::", "pid=", "actor_id", "\x1b"))


def test_another_server_error_reaches_the_caller_as_the_server_raised_it():
    failing = ScriptedServer(
        [ray_wrapped(ValueError("top_k must be at least 1, got -5"))], name="failing"
    )
    mgr = AsyncLLMServerManager([failing])
    with pytest.raises(ValueError) as caught:
        asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert str(caught.value) == "top_k must be at least 1, got -5" and not isinstance(
        caught.value, RayTaskError
    )
    assert mgr.down == set()


def test_a_dead_engines_rows_carry_the_servers_message():
    said = (
        "vLLM server 0: the engine process died (EngineDeadError: boom); the request is "
        "retried on another server"
    )
    server = ScriptedServer([ray_wrapped(ServerDeadError(said, 0))])
    cfg = default_config()
    OmegaConf.resolve(cfg)
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
        tokenizer=FakeTokenizer(),
    )
    prompts = np.empty(1, dtype=object)
    prompts[:] = [[{"role": "user", "content": "hi"}]]
    batch = DataProto(
        batch=None, non_tensor_batch={"raw_prompt": prompts, "uid": np.array(["u"], dtype=object)},
        meta_info={},
    )
    out = asyncio.run(worker.generate_sequences(batch))
    assert list(out.non_tensor_batch["status"]) == ["error"]
    assert out.non_tensor_batch["error"][0] == f"ServerDeadError: {said}"
