"""The per-call shortcuts of the rollout's hot path do what the general code does: a one-field copy
of a model, a field set in place, the balancer's count of servers down, the pause gate's open path,
an unscored sample, and the router tagging an output it alone holds."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from agentloop.errors import RoutingError
from agentloop.rewards.loader import RewardFunctionConfig
from agentloop.rewards.scoring import TrajectoryScorer
from agentloop.routing.strategies import make_balancer
from agentloop.servers.base import PauseGate
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    RolloutStatus,
    StopReason,
    TokenOutput,
    assign_field,
    replaced,
    unchecked,
    unchecked_builder,
    with_field,
)


def _output() -> TokenOutput:
    return TokenOutput(token_ids=[5, 6], log_probs=[-0.1, -0.2], stop_reason=StopReason.STOP,
                       extra_fields={"global_steps": 3})


def test_with_field_equals_replaced_and_leaves_the_original_alone():
    out = _output()
    fields = {"global_steps": 3, "server_index": 1}
    copy = with_field(out, "extra_fields", fields)
    assert copy == replaced(out, extra_fields=fields)
    assert copy.model_fields_set == replaced(out, extra_fields=fields).model_fields_set
    assert out.extra_fields == {"global_steps": 3} and copy is not out
    assert pickle.loads(pickle.dumps(copy)) == copy
    with pytest.raises(TypeError, match="no field 'nope'"):
        with_field(out, "nope", 1)


def test_unchecked_builder_builds_what_unchecked_builds():
    build = unchecked_builder(
        AgentLoopOutput, "prompt_ids", "response_ids", "response_mask", "num_turns", "status"
    )
    values: dict[str, Any] = {"prompt_ids": [1, 2], "response_ids": [3], "response_mask": [1],
                              "num_turns": 2, "status": RolloutStatus.STOP}
    built, plain = build(**values), unchecked(AgentLoopOutput, **values)
    assert built == plain == AgentLoopOutput(**values)
    assert built.model_fields_set == plain.model_fields_set == set(values)
    assert list(built.__dict__) == list(AgentLoopOutput.model_fields)
    assert built.model_dump() == plain.model_dump()
    assert pickle.loads(pickle.dumps(built)) == built
    other = build(**values)  # fields left out: each instance gets its own factory-made value
    assert other.extra_fields is not built.extra_fields and other.metrics is not built.metrics
    metrics = unchecked_builder(AgentLoopMetrics, "generate_sequences")(generate_sequences=0.5)
    assert metrics == AgentLoopMetrics(generate_sequences=0.5)
    with pytest.raises(TypeError, match="unknown"):
        unchecked_builder(AgentLoopOutput, "prompt_ids", "nope")
    with pytest.raises(TypeError, match="required"):
        unchecked_builder(AgentLoopOutput, "prompt_ids")  # response_ids etc. are required
    with pytest.raises(TypeError):
        build(prompt_ids=[1])  # a keyword the builder was made with is missing


class _Validated(BaseModel):
    model_config = ConfigDict(validate_assignment=True)
    count: int = 0


def test_assign_field_sets_like_setattr_and_still_validates_where_the_model_does():
    out = unchecked(AgentLoopOutput, prompt_ids=[1], response_ids=[2], response_mask=[1],
                    num_turns=2, metrics=unchecked(AgentLoopMetrics), status=RolloutStatus.STOP)
    assert "reward_score" not in out.model_fields_set
    assign_field(out, "reward_score", 0.5)
    assert out.reward_score == 0.5 and "reward_score" in out.model_fields_set
    model = _Validated()
    with pytest.raises(ValueError):  # validate_assignment: the assignment goes through pydantic
        assign_field(model, "count", "not a number")
    assign_field(model, "count", "7")
    assert model.count == 7


def test_balancer_counts_servers_down_once_each():
    balancer = make_balancer(3, seed=0)
    balancer.mark_down(0)
    balancer.mark_down(0)  # twice: still one server down
    balancer.mark_down(1)
    assert {balancer.acquire(f"r{i}") for i in range(6)} == {2}
    balancer.mark_up(0)
    balancer.mark_up(0)  # up twice: one server back, not two
    chosen = [balancer.acquire(f"s{i}") for i in range(8)]
    assert set(chosen) <= {0, 2} and 0 in chosen
    balancer.mark_down(2)
    assert {balancer.acquire(f"t{i}") for i in range(4)} == {0}
    balancer.mark_down(0)
    with pytest.raises(RoutingError, match="all 3 rollout servers are marked down"):
        balancer.acquire("v")
    balancer.mark_up(1)
    assert balancer.acquire("w") == 1


def test_gate_admits_at_once_while_open_and_holds_while_closed():
    async def main() -> None:
        gate = PauseGate()
        async with gate.admitted("a") as admitted:
            assert admitted is True and gate.in_flight == {"a": 1}
        assert gate.in_flight == {}
        gate.close()
        order: list[str] = []

        async def held(rid: str) -> None:
            async with gate.admitted(rid) as ok:
                order.append(f"{rid}:{ok}")

        tasks = [asyncio.create_task(held("b")), asyncio.create_task(held("c"))]
        await asyncio.sleep(0.01)
        gate.caller_abort("c")  # aborted while held: must not reach the engine
        assert order == []
        gate.open()
        await asyncio.gather(*tasks)
        assert sorted(order) == ["b:True", "c:False"]
        async with gate.admitted("c") as again:  # a later call with that id is not dropped
            assert again is True

    asyncio.run(main())


def test_unscored_sample_keeps_its_score_as_set_and_a_reward_function_is_not_skipped():
    scorer = TrajectoryScorer(RewardFunctionConfig(), tokenizer=None)
    out = unchecked(AgentLoopOutput, prompt_ids=[1], response_ids=[2], response_mask=[1],
                    num_turns=2, metrics=unchecked(AgentLoopMetrics), status=RolloutStatus.STOP)
    assert scorer.unscored([out]) == [out] and "reward_score" in out.model_fields_set
    assert scorer.unscored([out, out]) is None  # two trajectories: the reward rule applies
    scored = asyncio.run(scorer.score([out], {}))
    assert scored == [out]

    scorer.fn = lambda **kwargs: 1.0
    assert scorer.unscored([out]) is None


class _Remote:
    """Stands for a server actor's handle: ``generate.remote(...)`` gives an awaitable of an output
    unpickled for this call alone."""

    def __init__(self, output: TokenOutput) -> None:
        self.generate = self
        self.output = output

    def remote(self, **kwargs: Any) -> Any:
        async def call() -> TokenOutput:
            return self.output

        return call()


def test_router_tags_outputs_in_place_only_when_unpickled_for_the_call(monkeypatch: Any):
    from agentloop.routing import manager as manager_module
    from agentloop.routing.manager import AsyncLLMServerManager

    shared = _output()

    class Local:
        async def generate(self, **kwargs: Any) -> TokenOutput:
            return shared  # a server that hands out one object: it must not be changed

    router = AsyncLLMServerManager([Local()])
    got = asyncio.run(router.generate("r1", prompt_ids=[1], sampling_params={}))
    assert got.extra_fields["server_index"] == 0 and "server_index" not in shared.extra_fields

    fresh = _output()
    monkeypatch.setattr(manager_module, "ActorHandle", _Remote)
    router = AsyncLLMServerManager([_Remote(fresh)], batch_calls=False)
    got = asyncio.run(router.generate("r2", prompt_ids=[1], sampling_params={}))
    assert got is fresh and "extra_fields" in got.model_fields_set
    assert fresh.extra_fields == {
        "global_steps": 3, "server_index": 0, "min_global_steps": 3, "max_global_steps": 3,
    }
