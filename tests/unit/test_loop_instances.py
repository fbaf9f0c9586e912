"""Each sample gets its own loop instance, equal to what the constructor builds (verl's contract),
whether the worker constructs it or copies one it built in the same event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, resolve_registry
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import FakeTokenizer
from agentloop.types import AgentLoopOutput

SEEN: list[dict[str, Any]] = []


class StatefulLoop(AgentLoopBase):
    """Keeps state on its instance, as loops do: a second sample on the same instance would see
    it."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        SEEN.append({
            "id": id(self), "had_state": hasattr(self, "turns"), "loop": self.loop,
            "running": asyncio.get_running_loop(), "kwargs": dict(self.apply_chat_template_kwargs),
            "state": {k: dict(v) if type(v) is dict else v for k, v in vars(self).items()},
        })
        self.turns = 1
        self.apply_chat_template_kwargs["leaked"] = True
        self.mm_processor_kwargs["leaked"] = True
        return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], num_turns=2)


class OwnInitLoop(StatefulLoop):
    inits = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        type(self).inits += 1


def worker_with(cls: type[AgentLoopBase]) -> AgentLoopWorker:
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 32
    cfg.data.apply_chat_template_kwargs = {"enable_thinking": False}
    registry = resolve_registry()
    registry["stateful"] = ResolvedAgentLoop(name="stateful", cls=cls, kwargs={"extra": 1})
    return AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, [ScriptedServer()],
        registry=registry, tokenizer=FakeTokenizer(), trainer_config=cfg,
    )


def batch(n: int) -> DataProto:
    prompts = np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"q{i}"}] for i in range(n)]
    return DataProto(non_tensor_batch={
        "raw_prompt": prompts, "agent_name": np.array(["stateful"] * n, dtype=object),
    })


def test_every_sample_gets_a_fresh_instance_equal_to_a_constructed_one():
    SEEN.clear()
    worker = worker_with(StatefulLoop)
    for _ in range(2):  # two batches: two event loops
        out = asyncio.run(worker.generate_sequences(batch(4)))
        assert list(out.non_tensor_batch["status"]) == ["stop"] * 4
    assert len(SEEN) == 8
    assert not any(s["had_state"] for s in SEEN)  # nothing a sample set is seen by another
    assert all(s["kwargs"] == {"enable_thinking": False} for s in SEEN)
    assert all(s["loop"] is s["running"] for s in SEEN)  # self.loop: the batch's event loop
    constructed = StatefulLoop(*worker._loop_args, **worker._loop_kwargs, extra=1)
    want = {k: v for k, v in vars(constructed).items() if k != "loop"}
    for s in SEEN:
        assert {k: v for k, v in s["state"].items() if k != "loop"} == want


def test_a_loop_with_its_own_constructor_is_constructed_for_every_sample():
    SEEN.clear()
    OwnInitLoop.inits = 0
    worker = worker_with(OwnInitLoop)
    asyncio.run(worker.generate_sequences(batch(5)))
    assert OwnInitLoop.inits == 5 and not any(s["had_state"] for s in SEEN)
