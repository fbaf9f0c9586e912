"""Weight sync without an engine: bucketing, the manager's streaming protocol against
ScriptedServers, and weight versions on outputs and trajectories (no Ray: actor calls are run
in-process)."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import ray
import torch
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.errors import ServerError
from agentloop.loops.single_turn import SingleTurnAgentLoop
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.rollout.weights import WeightSync
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager
from agentloop.servers.weight_sync import (
    SharedBucket,
    WeightBucket,
    iter_buckets,
    shared_tensors,
    tensor_view,
    tied_aliases,
)
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.types import TokenOutput

MIB = 1 << 20
TOK = FakeTokenizer()


def small_tensors(n: int, numel: int = 1000) -> dict[str, torch.Tensor]:
    # 4000 bytes each
    return {f"layer.{i}.weight": torch.full((numel,), float(i)) for i in range(n)}


# -- bucketing
# ------------------------------------------------------------------------------------------


def test_many_small_tensors_fill_buckets_in_order():
    weights = small_tensors(10)
    buckets = list(iter_buckets(weights, bucket_bytes=12_000))
    assert [b.names for b in buckets] == [list(weights)[i:i + 3] for i in range(0, 10, 3)]
    assert all(b.nbytes <= 12_000 for b in buckets)
    for bucket in buckets:
        for name, t in bucket.tensors():
            assert torch.equal(t, weights[name])


def test_a_tensor_bigger_than_the_bucket_travels_alone():
    weights = {
        "a": torch.zeros(10), "huge": torch.ones(10_000), "b": torch.zeros(10),
        "c": torch.zeros(10),
    }
    buckets = list(iter_buckets(weights, bucket_bytes=1_000))
    assert [b.names for b in buckets] == [["a"], ["huge"], ["b", "c"]]
    assert buckets[1].nbytes == 40_000


def test_iterator_input_is_read_lazily():
    seen: list[str] = []

    def stream():
        for name, t in small_tensors(6).items():
            seen.append(name)
            yield name, t

    buckets = iter_buckets(stream(), bucket_bytes=8_000)
    first = next(buckets)
    # one tensor read ahead
    assert first.names == ["layer.0.weight", "layer.1.weight"] and len(seen) == 3
    assert [len(b) for b in buckets] == [2, 2]


def test_bucket_keeps_every_dtype_and_shape_exactly_through_pickle_and_wire():
    weights = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "f32": torch.randn(2, 3, 4),
        "i64": torch.arange(7), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6).t(),
        "grad": torch.randn(3, requires_grad=True),
    }
    (bucket,) = iter_buckets(weights, bucket_bytes=MIB)
    restored = pickle.loads(pickle.dumps(bucket))  # what the object store does
    assert all(isinstance(d, np.ndarray) and d.dtype == np.uint8 for d in restored.data)
    for name, t in restored.tensors():
        assert t.dtype == weights[name].dtype and torch.equal(t, weights[name].detach()), name
    for name, dtype, shape, pieces in restored.to_wire():  # what the engine worker rebuilds
        data = b"".join(bytes(p) for p in pieces)
        assert torch.equal(tensor_view(data, dtype, shape), weights[name].detach()), name


def test_shared_bucket_round_trips_through_a_mapping_and_unlinks(monkeypatch, tmp_path):
    weights = {
        "a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.arange(5), "empty": torch.zeros(0),
    }
    (bucket,) = iter_buckets(weights, MIB)
    # a plain directory maps the same way
    monkeypatch.setattr(SharedBucket, "SHM_DIR", str(tmp_path))
    shared = SharedBucket.create(bucket)
    assert shared is not None and shared.size == bucket.nbytes
    restored = dict(shared_tensors(shared.path, shared.size, shared.layout))
    shared.close()
    assert list(tmp_path.iterdir()) == []  # the name is gone, the mapping still serves the tensors
    for name, t in weights.items():
        assert restored[name].dtype == t.dtype and torch.equal(restored[name], t), name


def test_shared_bucket_is_none_where_no_segment_can_be_made(monkeypatch, tmp_path):
    monkeypatch.setattr(SharedBucket, "SHM_DIR", str(tmp_path / "missing"))
    assert SharedBucket.create(next(iter_buckets(small_tensors(1), MIB))) is None


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        list(iter_buckets(small_tensors(1), bucket_bytes=0))


def test_tied_lm_head_is_an_alias_of_the_embeddings_only_when_missing():
    emb = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    (bucket,) = iter_buckets(emb, MIB)
    assert tied_aliases(bucket, True) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_aliases(bucket, False) == {}
    (both,) = iter_buckets({**emb, "lm_head.weight": torch.ones(4, 2)}, MIB)
    assert tied_aliases(both, True) == {}


# -- the manager's streaming protocol
# ----------------------------------------------------------------------


class _Result:
    def __init__(self, fn: Any) -> None:
        try:
            self.value, self.error = fn(), None
        except Exception as e:  # noqa: BLE001 - raised at ray.get, as Ray does
            self.value, self.error = None, e

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class LocalHandle:
    """Actor-handle shape over an in-process server: ``h.method.remote(...)`` runs the coroutine
    at once."""

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.server, name)
        return SimpleNamespace(remote=lambda *a, **k: _Result(lambda: asyncio.run(method(*a, **k))))


@pytest.fixture
def fake_ray(monkeypatch):
    puts: list[Any] = []

    def put(value: Any) -> Any:
        puts.append(value)
        return value

    def get(refs: Any) -> Any:
        return [r.get() for r in refs] if isinstance(refs, list) else refs.get()

    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setattr(ray, "get", get)
    # all answered
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    return puts


from agentloop.cluster.placement import ServerGroup  # noqa: E402
from agentloop.cluster.supervisor import ServerSupervisor  # noqa: E402


def make_manager(
    servers: list[ScriptedServer], sleeping: bool = False, mode: str = "drain"
) -> WeightSync:
    """The manager's weight-sync component (what ``manager.update_weights`` / ``pause`` / ``resume``
    / ``set_weight_update`` delegate to), over in-process servers; ``sleeping``: its wake-up hook
    wakes them."""
    handles = [LocalHandle(s) for s in servers]
    supervisor = ServerSupervisor(ServerGroup(handles, None, "cpu", []), None, lambda i, h: None)
    asleep = [sleeping]

    def wake_up() -> None:  # the manager's wake_up: sleeping servers are woken, then left awake
        if asleep[0]:
            supervisor.each("wake_up", 600)
            asleep[0] = False

    return WeightSync(supervisor, backend="vllm", mode=mode, timeout_s=600, wake_up=wake_up)


def test_buckets_are_put_once_and_shared_by_every_server(fake_ray):
    servers = [ScriptedServer(), ScriptedServer()]
    weights = small_tensors(7)
    version = make_manager(servers).update(weights, bucket_mb=10_000 / MIB)
    assert version == 1
    assert [b.names for b in fake_ray] == [list(weights)[i:i + 2] for i in range(0, 7, 2)]
    for s in servers:
        assert s.buckets == [b.names for b in fake_ray]
        assert (
            s.lifecycle == ["begin_weight_update", "finish_weight_update"] and s.global_steps == 1
        )
        assert all(torch.equal(s.weights[k], v) for k, v in weights.items())


def test_versions_default_to_previous_plus_one_and_follow_global_steps(fake_ray):
    server = ScriptedServer()
    manager = make_manager([server])
    assert server.global_steps == 0
    assert manager.update(small_tensors(1)) == 1
    assert manager.update(small_tensors(1), global_steps=10) == 10 and server.global_steps == 10
    assert manager.update(iter(small_tensors(2).items())) == 11 and server.global_steps == 11


def test_sleeping_servers_are_woken_before_the_update(fake_ray):
    servers = [ScriptedServer(), ScriptedServer()]
    manager = make_manager(servers, sleeping=True)
    manager.update(small_tensors(2))
    manager.update(small_tensors(2))  # left awake: not woken again
    for s in servers:
        assert s.lifecycle == ["wake_up"] + ["begin_weight_update", "finish_weight_update"] * 2


def test_a_failed_bucket_closes_every_update_and_keeps_the_version(fake_ray):
    good, bad = ScriptedServer(), ScriptedServer()

    async def broken(bucket: WeightBucket) -> None:
        raise ServerError("no such parameter")

    bad.load_weight_bucket = broken  # type: ignore[method-assign]
    manager = make_manager([good, bad])
    with pytest.raises(ServerError, match="no such parameter"):
        manager.update(small_tensors(3))
    assert manager.version == 0 and good.global_steps == bad.global_steps == 0
    assert good.lifecycle[-1] == bad.lifecycle[-1] == "abort_weight_update"
    del bad.load_weight_bucket
    assert manager.update(small_tensors(1)) == 1  # nothing was left open


def test_a_server_that_cannot_open_the_update_leaves_none_open(fake_ray):
    good, bad = ScriptedServer(), ScriptedServer()

    async def refuse(global_steps: int | None = None) -> None:
        raise ServerError("engine gone")

    bad.begin_weight_update = refuse  # type: ignore[method-assign]
    with pytest.raises(ServerError, match="engine gone"):
        make_manager([good, bad]).update(small_tensors(1))
    assert (
        good.lifecycle == ["begin_weight_update", "abort_weight_update"] and good.global_steps == 0
    )


def test_an_abort_update_cuts_what_runs_first_and_resumes_after_also_when_it_fails(fake_ray):
    servers = [ScriptedServer(), ScriptedServer()]
    manager = make_manager(servers, mode="abort")
    assert manager.update(small_tensors(2)) == 1
    for s in servers:
        assert (
            s.lifecycle == ["pause", "begin_weight_update", "finish_weight_update", "resume"]
            and not s.paused
        )

    async def broken(bucket: WeightBucket) -> None:
        raise ServerError("no such parameter")

    servers[1].load_weight_bucket = broken  # type: ignore[method-assign]
    with pytest.raises(ServerError, match="no such parameter"):
        manager.update(small_tensors(1))
    assert (
        servers[0].lifecycle[-2:] == servers[1].lifecycle[-2:] == ["abort_weight_update", "resume"]
    )
    # a failed update never leaves the servers holding requests
    assert not any(s.paused for s in servers)


def test_a_server_whose_pause_takes_no_for_update_gets_a_clear_error_and_none_stays_paused(
    fake_ray,
):
    class OldProtocol(ScriptedServer):
        async def pause(self) -> int:  # type: ignore[override]  # a server class written before for_update
            return await super().pause()

    good, old = ScriptedServer(), OldProtocol()
    manager = make_manager([good, old], mode="abort")
    with pytest.raises(ServerError, match=r"pause\(for_update=\.\.\.\).*weight_update: drain"):
        manager.update(small_tensors(1))
    assert good.lifecycle == ["pause", "resume"] and not good.paused and good.global_steps == 0


def test_an_update_inside_the_callers_own_pause_leaves_the_resume_to_the_caller(fake_ray):
    server = ScriptedServer()
    manager = make_manager([server], mode="abort")
    manager.pause()
    manager.update(small_tensors(1))
    assert (
        server.lifecycle == ["pause", "begin_weight_update", "finish_weight_update"]
        and server.paused
    )
    manager.resume()
    assert not server.paused
    manager.set_mode("drain")
    assert server.weight_update == "drain"
    manager.update(small_tensors(1))
    # drain: no pause
    assert server.lifecycle[-2:] == ["begin_weight_update", "finish_weight_update"]
    with pytest.raises(ValueError, match="abort, drain, keep"):
        manager.set_mode("wait")


def test_whole_dict_path_kept_for_comparison(fake_ray):
    server = ScriptedServer()
    manager = make_manager([server])
    assert manager.update_whole({"w": torch.ones(2)}, global_steps=4) == 4
    assert len(fake_ray) == 1 and server.counts["update_weights"] == 1 and server.global_steps == 4


# -- versions on outputs and trajectories
# ------------------------------------------------------------------


def test_scripted_server_versions_its_replies():
    server = ScriptedServer()

    async def go() -> list[Any]:
        first = await server.generate([1, 2], {}, "a")
        await server.update_weights({})
        second = await server.generate([1, 2], {}, "b")
        await server.set_global_steps(7)
        chunks = [d async for d in server.generate_stream([1], {}, "c")]
        return [first.extra_fields["global_steps"], second.extra_fields["global_steps"],
                chunks[-1].extra_fields["global_steps"]]

    assert asyncio.run(go()) == [0, 1, 7]


def test_router_sets_min_and_max_only_when_the_server_reports_a_version():
    mgr = AsyncLLMServerManager([ScriptedServer()])
    out = asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert out.extra_fields == {
        "global_steps": 0, "server_index": 0, "min_global_steps": 0, "max_global_steps": 0,
    }
    bare = AsyncLLMServerManager([ScriptedServer([TokenOutput(token_ids=[1])])])
    assert (
        "min_global_steps"
        not in asyncio.run(bare.generate("r", prompt_ids=[1], sampling_params={})).extra_fields
    )

    async def stream() -> dict[str, Any]:
        return [d async for d in mgr.generate_stream("s", prompt_ids=[1, 2], sampling_params={})][
            -1
        ].extra_fields

    assert asyncio.run(stream())["max_global_steps"] == 0


def rollout_cfg(tool_config_path: str | None = None) -> Any:
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 128
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = tool_config_path
    return rollout


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def test_tool_agent_trajectory_spans_the_versions_of_its_turns(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    replies = [say(call), say("The answer is 5.")]

    def script(prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        if len(server.calls) == 2:  # a weight update lands between the two turns
            server.global_steps = 3
        return replies[len(server.calls) - 1]

    server = ScriptedServer(script, eos_token_id=IM_END)
    rollout = rollout_cfg(str(tools))

    async def go() -> Any:
        ToolAgentLoop.init_class(rollout, TOK)
        loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run(
            {"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "What is 2 + 3?"}]
        )

    out = asyncio.run(go())
    assert out.status == "stop" and out.num_turns == 4
    assert out.extra_fields["min_global_steps"] == 0 and out.extra_fields["max_global_steps"] == 3


def test_rows_carry_the_version_of_the_batch_they_were_generated_in():
    server = ScriptedServer(lambda ids, params, rid: [70, 71, IM_END], eos_token_id=IM_END)
    worker = AgentLoopWorker.from_slices(
        rollout_cfg(), OmegaConf.create({"path": "unused"}), [server], tokenizer=TOK
    )
    prompts = np.empty(2, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"question {i}"}] for i in range(2)]
    batch = DataProto(batch=None, non_tensor_batch={"raw_prompt": prompts}, meta_info={})

    async def two_batches() -> list[Any]:
        first = await worker.generate_sequences(batch)
        await server.update_weights({}, global_steps=5)
        second = await worker.generate_sequences(batch)
        return [first, second]

    first, second = asyncio.run(two_batches())
    for out, version in ((first, 0), (second, 5)):
        nt = out.non_tensor_batch
        assert (
            nt["min_global_steps"].tolist() == [version] * 2
            and nt["max_global_steps"].tolist() == [version] * 2
        )


def test_single_turn_records_none_when_the_server_has_no_version():
    server = ScriptedServer([TokenOutput(token_ids=[1])])
    loop = SingleTurnAgentLoop(rollout_cfg(), AsyncLLMServerManager([server]), TOK)
    out = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "hi"}]))
    assert (
        out.extra_fields["min_global_steps"] is None
        and out.extra_fields["max_global_steps"] is None
    )
