"""What each actor is built with: one small frozen bundle of typed sections per actor kind.

The driver builds every section once (:func:`agentloop.config.resolve_config`) and hands each
actor the bundle of the sections it reads (:meth:`SectionBundle.of`): a server gets
:class:`ServerSections`, a worker :class:`WorkerSections`, a gateway :class:`GatewaySections`.
No actor reads an omegaconf slice; the worker's ``trainer_config`` (what verl loops receive) is
the one DictConfig an actor holds.  :meth:`SectionBundle.from_slices` is the one alternate path
for code that holds only the ``actor_rollout_ref.rollout`` / ``.model`` slices (tests,
benchmarks): absent keys take the YAML's values, without ``resolve_config``'s start-up checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agentloop.config.schema import (
    AgentConfig,
    AsyncConfig,
    DataConfig,
    EngineConfig,
    EnvConfig,
    GatewayConfig,
    ModelConfig,
    MultiTurnConfig,
    RewardConfig,
    RouterConfig,
    SamplingConfig,
    ServerConfig,
    TraceConfig,
)

_B = TypeVar("_B", bound="SectionBundle")

SECTION_BUILDERS: dict[str, Callable[[Any], Any]] = {
    "agent": AgentConfig.from_root, "engine": EngineConfig.from_root,
    "model_config": ModelConfig.from_root, "sampling": SamplingConfig.from_root,
    "val_sampling": SamplingConfig.validation_from_root, "server": ServerConfig.from_root,
    "router": RouterConfig.from_root, "multi_turn": MultiTurnConfig.from_root,
    "gateway": GatewayConfig.from_root, "trace": TraceConfig.from_root,
    "reward": RewardConfig.from_root, "async_training": AsyncConfig.from_root,
    "data": DataConfig.from_root, "env": EnvConfig.from_root,
}
"""Attribute name (as on ``AgentLoopConfig``) -> its builder from a trainer-shaped config."""


class SectionBundle:
    """Base of the bundles: frozen dataclasses whose fields are named like the sections of
    ``AgentLoopConfig``."""

    @classmethod
    def of(cls: type[_B], cfg: Any) -> _B:
        """This bundle's sections picked from ``cfg`` (an ``AgentLoopConfig``; nothing is
        rebuilt)."""
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: getattr(cfg, name) for name in names})

    @classmethod
    def from_root(cls: type[_B], root: Any) -> _B:
        """Build this bundle's sections from a trainer-shaped config (DictConfig or mapping).

        Raises:
            ConfigError: a value is mistyped or out of range (the start-up check's message).
        """
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: SECTION_BUILDERS[name](root) for name in names})

    @classmethod
    def from_slices(cls: type[_B], rollout: Any = None, model: Any = None) -> _B:
        """Build from the ``actor_rollout_ref.rollout`` and ``.model`` slices alone.

        Raises:
            ConfigError: as :meth:`from_root`.
        """
        slices = {
            "rollout": {} if rollout is None else rollout,
            "model": {} if model is None else model,
        }
        return cls.from_root({"actor_rollout_ref": slices})


@dataclass(frozen=True)
class ServerSections(SectionBundle):
    """What a server actor (``VLLMServer``, ``SGLangServer``) is built with."""

    engine: EngineConfig
    server: ServerConfig
    model_config: ModelConfig


@dataclass(frozen=True)
class WorkerSections(SectionBundle):
    """What an ``AgentLoopWorker`` is built with (besides verl's ``trainer_config``)."""

    agent: AgentConfig
    engine: EngineConfig
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    router: RouterConfig
    multi_turn: MultiTurnConfig
    trace: TraceConfig
    reward: RewardConfig
    model_config: ModelConfig


@dataclass(frozen=True)
class GatewaySections(SectionBundle):
    """What a ``GatewayActor`` is built with (``router``: the same section the workers use)."""

    gateway: GatewayConfig
    engine: EngineConfig
    sampling: SamplingConfig
    multi_turn: MultiTurnConfig
    router: RouterConfig
    model_config: ModelConfig
