"""One vLLM CPU engine (the tiny model) shared by adjacent integration modules.

A module that only reads from the engine (no kill, pause or weight update) asks for
``shared_tiny_engine`` and builds its own managers over the handles
(``AgentLoopManager(cfg, LLMServerClient(handles))``: none started, none stopped by them).  Those
modules run one after the other (``pytest_collection_modifyitems``, at the first one's place), and
the engine and its Ray session stay up while the next test asks for the fixture too, so
``test_gateway_clients``, ``test_vllm_context_window`` and ``test_vllm_envs`` pay for one engine
start instead of one each; otherwise both are stopped when the module ends, as a module-scoped
engine would be.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from omegaconf import OmegaConf

from agentloop.cluster.placement import start_standalone_servers, stop_servers
from agentloop.config import default_config, resolve_config
from agentloop.testing.tiny_model import ensure_tiny_model

SHARED_ENGINE = "shared_tiny_engine"
SHARED_MAX_MODEL_LEN = 2560
"""The shared engine's context: the largest user's prompt + response (test_vllm_envs' self-play:
512 + 2048)."""

_state: dict[str, Any] = {"next": None, "group": None}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Remember the test that runs next while this one's fixtures are torn down."""
    _state["next"] = nextitem
    yield
    _state["next"] = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that use the shared engine one after the other, where the first of them
    would run (each module's tests keep their order; the other modules keep theirs)."""
    users = {item.path for item in items if SHARED_ENGINE in getattr(item, "fixturenames", ())}
    if len(users) < 2:
        return
    moved = [item for item in items if item.path in users]
    first = next(i for i, item in enumerate(items) if item.path in users)
    rest = [item for item in items if item.path not in users]
    items[:] = rest[:first] + moved + rest[first:]


def _next_test_uses(fixture: str) -> bool:
    nxt = _state["next"]
    return nxt is not None and fixture in getattr(nxt, "fixturenames", ())


def shared_engine_config(model_path: str) -> Any:
    """The config the shared engine starts with (1 CPU server, fp32, eager, log-probs)."""
    cfg = default_config()
    for key, value in {
        "actor_rollout_ref.model.path": model_path,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.max_model_len": SHARED_MAX_MODEL_LEN,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        # eager: ~10 s less per CPU engine start (compiled, the default: test_vllm_envs CLI test)
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.max_num_seqs": 64,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
    }.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def shared_tiny_engine() -> Iterator[list[Any]]:
    """The shared engine's server handles (Ray initialised with 4 CPUs); started by the first
    module that asks, stopped with Ray after the last of a run of adjacent modules that ask."""
    if _state["group"] is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        cfg = shared_engine_config(str(ensure_tiny_model()))
        try:
            _state["group"] = start_standalone_servers(resolve_config(cfg))
        except BaseException:
            ray.shutdown()
            raise
    yield list(_state["group"].handles)
    if not _next_test_uses(SHARED_ENGINE):
        _stop_shared_engine()


@pytest.fixture
def shared_engine_stopped() -> None:
    """Stops the shared engine and its Ray session now if they are up (for a test that must run
    without a Ray session in this process, e.g. one starting the CLI, after the module's last user
    of the engine)."""
    _stop_shared_engine()


def _stop_shared_engine() -> None:
    group, _state["group"] = _state["group"], None
    if group is None:
        return
    try:
        stop_servers(group)
    finally:
        ray.shutdown()
