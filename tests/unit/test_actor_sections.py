"""Actors are built from typed sections: no constructor or start-up function takes a config slice.

The worker's ``trainer_config`` is the one exception: verl loops receive the whole trainer config
(verl's contract, handed on through the compat seam).
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from agentloop.cluster import colocated, placement
from agentloop.config import GatewaySections, ServerSections, WorkerSections, resolve_config
from agentloop.gateway.actor import GatewayActor, replace_dead_gateways, start_gateways
from agentloop.rollout.worker import AgentLoopWorker, error_batch
from agentloop.servers.sglang import SGLangServer
from agentloop.servers.vllm import VLLMServer
from agentloop.testing import ScriptedServer
from agentloop.utils.process import restore_normal_priority

ACTORS: list[type] = [VLLMServer, SGLangServer, ScriptedServer, AgentLoopWorker, GatewayActor]
START_UP: list[Callable[..., Any]] = [
    placement.create_server_actor, placement.launch_servers, placement.start_standalone_servers,
    colocated.start_colocated_servers, colocated.replica_size, start_gateways,
    replace_dead_gateways, error_batch, restore_normal_priority,
]
ALLOWED = {(AgentLoopWorker.__init__, "trainer_config")}
"""verl loops receive the whole trainer config: the worker hands it on."""
SLICE_NAMES = ("rollout", "model", "root", "config")


def _slice_parameters(fn: Callable[..., Any]) -> list[str]:
    """Parameters of ``fn`` annotated with a DictConfig, left untyped, or named like a slice."""
    found = []
    for name, param in inspect.signature(fn).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name == "_ray_trace_ctx":  # added by ray.remote to a class another test made an actor
            continue
        if (fn, name) in ALLOWED:
            continue
        annotation = str(param.annotation)  # a string: `from __future__ import annotations`
        if "DictConfig" in annotation or name in SLICE_NAMES:
            found.append(f"{fn.__qualname__}({name}: {annotation})")
        elif param.annotation is inspect.Parameter.empty:
            found.append(f"{fn.__qualname__}({name}) has no annotation")
    return found


@pytest.mark.parametrize("fn", [cls.__init__ for cls in ACTORS] + START_UP,
                         ids=lambda fn: fn.__qualname__)
def test_actors_and_start_up_functions_take_no_dictconfig(fn: Callable[..., Any]) -> None:
    assert _slice_parameters(fn) == []


def test_the_scan_sees_a_slice_parameter() -> None:
    """The check itself: a constructor taking a DictConfig slice is reported."""

    class Old:
        def __init__(self, rollout: Any, model: OmegaConf, server_index: int = 0) -> None: ...

    class Typed:
        def __init__(self, sections: ServerSections, rollout_cfg: DictConfig | None,
                     index) -> None: ...  # noqa: ANN001

    assert len(_slice_parameters(Old.__init__)) == 2
    found = _slice_parameters(Typed.__init__)
    assert [line.split("Typed.")[1] for line in found] == [
        "__init__(rollout_cfg: DictConfig | None)", "__init__(index) has no annotation"]


def test_bundles_pick_resolve_configs_sections_and_pickle(tmp_path) -> None:
    """``of(cfg)`` hands on the driver's sections (nothing rebuilt); ``from_slices`` builds equal
    ones; both pickle (they travel to Ray actors)."""
    (tmp_path / "config.json").write_text("{}")
    model, rollout = {"path": str(tmp_path)}, {"prompt_length": 8, "server": {"priority": "fcfs"}}
    cfg = resolve_config({"actor_rollout_ref": {"model": model, "rollout": rollout}})
    for bundle in (ServerSections, WorkerSections, GatewaySections):
        picked = bundle.of(cfg)
        for f in dataclasses.fields(picked):
            assert getattr(picked, f.name) is getattr(cfg, f.name), (bundle.__name__, f.name)
        assert bundle.from_slices(cfg.rollout, cfg.model) == picked
        assert pickle.loads(pickle.dumps(picked)) == picked
    alone = ServerSections.from_slices(OmegaConf.create({"prompt_length": 8}))
    assert alone.engine.prompt_length == 8
