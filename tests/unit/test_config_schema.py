"""The typed config sections (agentloop.config.schema): built once from the YAML-shaped config,
defaults only in ``agentloop/configs/rollout.yaml``, the start-up check's one-line errors, one
router factory for workers and gateways."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import agentloop
from agentloop.config import (
    AgentLoopConfig,
    GatewayConfig,
    GatewaySections,
    RewardConfig,
    RouterConfig,
    SamplingConfig,
    ServerConfig,
    WorkerSections,
    build_sections,
    default_config,
    resolve_config,
)
from agentloop.config.build import section_keys
from agentloop.configcheck import check_types
from agentloop.errors import ConfigError
from agentloop.gateway.actor import GatewayActor
from agentloop.loops.base import resolve_registry
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing.tail import ContextPriority
from agentloop.testing import ScriptedServer

_ABSENT = object()


def _yaml() -> dict[str, Any]:
    cfg = default_config()
    OmegaConf.resolve(cfg)
    return OmegaConf.to_container(cfg)  # type: ignore[return-value]


def _at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _keys_of(name: str, section: Any) -> dict[str, str]:
    return {
        **section_keys(type(section)),
        **(SamplingConfig.VAL_KEYS if name == "val_sampling" else {}),
    }


def _resolved_default(name: str, field: str, value: Any) -> Any:
    """The documented meaning of a null the YAML ships: weight_update null -> abort (partial_rollout
    null); the router's partial_rollout null -> false."""
    if value is None and (name, field) == ("server", "weight_update"):
        return "abort"
    if value is None and (name, field) == ("router", "partial_rollout"):
        return False
    return value


def test_every_section_builds_from_the_defaults_and_is_frozen():
    sections = build_sections(default_config())
    assert set(sections) == {f.name for f in dataclasses.fields(AgentLoopConfig) if not f.init}
    for name, section in sections.items():
        assert dataclasses.is_dataclass(section), name
        first = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, first, None)


def test_every_field_is_a_yaml_key_and_takes_the_yaml_value():
    yaml = _yaml()
    for name, section in build_sections(default_config()).items():
        for field, key in _keys_of(name, section).items():
            expected = _at(yaml, key)
            assert expected is not _ABSENT, f"{name}.{field}: {key} is not in configs/rollout.yaml"
            got = getattr(section, field)
            got = list(got) if isinstance(got, tuple) else got
            assert got == _resolved_default(name, field, expected), f"{name}.{field} ({key})"


def test_no_section_field_has_a_default_of_its_own():
    for name, section in build_sections(default_config()).items():
        if isinstance(section, RewardConfig):
            continue  # constructible by hand; its defaults read the YAML (next test)
        for f in dataclasses.fields(section):
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (
                f"{name}.{f.name}"
            )


def test_reward_config_by_hand_takes_the_yaml_defaults():
    assert RewardConfig() == RewardConfig.from_root(default_config()) == RewardConfig.from_root({})


def test_a_key_the_config_lacks_takes_the_yaml_value():
    server = ServerConfig.from_rollout({"server": {"max_cache_size": 7}})
    assert server.max_cache_size == 7 and server.restart_dead is _at(
        _yaml(), "actor_rollout_ref.rollout.server.restart_dead"
    )


def test_values_are_cast_once():
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "server": {"stall_timeout": 5, "num_cpus_per_server": 2},
                    "cudagraph_capture_sizes": [1, 2],
                }
            }
        }
    )
    sections = build_sections(cfg)
    assert (
        isinstance(sections["server"].stall_timeout, float)
        and sections["server"].num_cpus_per_server == 2.0
    )
    assert sections["engine"].cudagraph_capture_sizes == (1, 2)


def _trainer(model_dir: Any, key: str, value: Any) -> Any:
    cfg = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(model_dir)}}})
    OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


BAD = [
    ("actor_rollout_ref.rollout.server.priority", "fastest", ServerConfig, "priority"),
    ("actor_rollout_ref.rollout.max_num_seqs", "many", None, "max_num_seqs"),
    ("actor_rollout_ref.rollout.multi_turn.tool_timeout", -1, None, "tool_timeout"),
    ("actor_rollout_ref.rollout.server.weight_update", "later", ServerConfig, "weight_update"),
    ("actor_rollout_ref.rollout.top_p", 0, SamplingConfig, "top_p"),
]


@pytest.mark.parametrize(("key", "value", "cls", "field"), BAD)
def test_a_mistyped_or_unknown_value_gives_the_start_up_checks_one_line_error(
    model_dir, key, value, cls, field
):
    with pytest.raises(ConfigError) as today:
        check_types(_trainer(model_dir, key, value))  # the start-up check as it was
    with pytest.raises(ConfigError) as resolved:
        resolve_config(_trainer(model_dir, key, value))
    message = str(today.value)
    assert str(resolved.value) == message and "\n" not in message
    assert message.startswith(f"invalid config values: {key}=")
    sections = build_sections(default_config())
    owner = next(
        s
        for s in sections.values()
        if type(s) is (cls or type(s)) and field in section_keys(type(s))
    )
    with pytest.raises(ConfigError) as direct:
        dataclasses.replace(owner, **{field: value})  # a section rejects it when constructed, too
    assert str(direct.value) == message


def test_a_value_only_a_section_checks_is_refused_in_the_same_form(model_dir):
    key = "actor_rollout_ref.rollout.gateway.max_body_bytes"
    with pytest.raises(ConfigError) as resolved:
        resolve_config(_trainer(model_dir, key, "8MB"))
    with pytest.raises(ConfigError) as direct:
        GatewayConfig.from_root(_trainer(model_dir, key, "8MB"))
    assert str(resolved.value) == str(direct.value) == (
        f'invalid config values: {key}="8MB" (str): expected an int. '
        "Fix them in your config file or with key=value overrides.")


def test_a_section_keeps_its_components_own_message():
    with pytest.raises(ConfigError, match=r"rollout.name must be 'vllm' or 'sglang', got 'tgi'"):
        dataclasses.replace(build_sections(default_config())["engine"], name="tgi")
    with pytest.raises(
        ConfigError, match=r"gateway.reward_to must be null \(follow " r"multi_turn.reward_to\)"
    ):
        dataclasses.replace(build_sections(default_config())["gateway"], reward_to="first")


ROUTING = [
    ({"server": {"max_failovers": 2, "priority": "context"}}, {"partial_rollout": True}),
    ({"server": {"max_failovers": 0, "priority": None}, "agent": {"restart_preempted": True}}, {}),
]


@pytest.mark.parametrize(("rollout", "async_training"), ROUTING)
def test_gateway_and_worker_routers_get_the_same_settings_from_one_config(
    model_dir, tokenizer, rollout, async_training
):
    cfg = resolve_config(
        {
            "actor_rollout_ref": {"rollout": rollout, "model": {"path": str(model_dir)}},
            "async_training": async_training,
        }
    )
    server = ScriptedServer(eos_token_id=tokenizer.eos_token_id)

    async def build() -> tuple[Any, Any]:
        gateway = GatewayActor(GatewaySections.of(cfg), [server], tokenizer=tokenizer)
        worker = AgentLoopWorker(
            WorkerSections.of(cfg), cfg.root, [server], registry=resolve_registry(),
            tokenizer=tokenizer,
        )
        return gateway.service.router, worker.server_manager

    gateway_router, worker_router = asyncio.run(build())
    for attr in ("max_failovers", "partial_rollout", "restart_preempted"):
        assert getattr(gateway_router, attr) == getattr(worker_router, attr), attr
    assert type(gateway_router.priority) is type(worker_router.priority)
    assert gateway_router.partial_rollout is bool(async_training.get("partial_rollout"))
    assert isinstance(worker_router.priority, ContextPriority) is (
        rollout["server"]["priority"] == "context"
    )
    assert worker_router.max_failovers == rollout["server"]["max_failovers"]
    assert worker_router.restart_preempted is (
        cfg.router.restart_preempted and not cfg.router.partial_rollout
    )


def test_router_config_reads_partial_rollout_from_async_training():
    assert RouterConfig.from_root({}).partial_rollout is False
    assert (
        RouterConfig.from_root({"async_training": {"partial_rollout": True}}).partial_rollout
        is True
    )


# Reads of rollout config keys the sections hold, outside agentloop/config* and the compat seam.
_GENERIC = {
    "path", "name", "format", "timeout", "n", "seed", "dtype", "host", "backend", "device",
    "enable", "type", "data", "mode", "custom", "trace", "priority", "vllm", "sglang",
    "env",  # also a sample's field (extra_info.env, an env column) and an MCP server's variables
}


def _rollout_leaf_keys() -> set[str]:
    keys: set[str] = set()

    def walk(node: Any) -> None:
        for k, v in node.items():
            keys.add(str(k))
            if isinstance(v, dict):
                walk(v)

    walk(_yaml()["actor_rollout_ref"]["rollout"])
    return keys - _GENERIC


def test_components_read_no_rollout_config_keys_of_their_own():
    package = Path(agentloop.__file__).parent
    pattern = re.compile(
        r'OmegaConf\.select\(|\.get\(\s*"(' + "|".join(sorted(_rollout_leaf_keys())) + r')"'
    )
    found: dict[str, list[str]] = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).as_posix()
        if rel.startswith(("agentloop/config/", "agentloop/configcheck/", "agentloop/compat/")):
            continue
        if rel.startswith("agentloop/gateway/dialects/"):  # they read request bodies (temperature,
            continue  # top_p, ... are also the names of sampling keys), never the rollout config
        hits = [line.strip() for line in path.read_text().splitlines() if pattern.search(line)]
        if hits:
            found[rel] = hits
    assert not found, found
