"""Config loading, checking and the typed sections built from it.

Users pass either a trainer-shaped config (``actor_rollout_ref.rollout`` /
``actor_rollout_ref.model``, as in verl) or just the rollout subtree plus a model path.
:func:`resolve_config` merges it over ``configs/rollout.yaml`` (the one place defaults live), runs
the start-up check (:mod:`agentloop.configcheck`: unknown keys with a did-you-mean, unsupported verl
features, value types) and returns an :class:`AgentLoopConfig`: the omegaconf slices (``rollout``,
``model``, ``root``; verl loops receive ``root``) plus one frozen, typed section per component
(``cfg.server``, ``cfg.router``, ``cfg.agent``, ...; :mod:`agentloop.config.schema`).  Actors
receive small bundles of those sections (:mod:`agentloop.config.sections`: ``ServerSections``,
``WorkerSections``, ``GatewaySections``).
"""

from agentloop.config.load import (
    AgentLoopConfig,
    build_sections,
    resolve_config,
    sampling_params_from_config,
    validate,
)
from agentloop.config.paths import CONFIG_DIR, default_config
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
    Section,
    ServerConfig,
    TraceConfig,
    weight_update_mode,
)
from agentloop.config.sections import GatewaySections, SectionBundle, ServerSections, WorkerSections

__all__ = [
    "CONFIG_DIR", "AgentConfig", "AgentLoopConfig", "AsyncConfig", "DataConfig", "EngineConfig",
    "EnvConfig", "GatewayConfig", "ModelConfig", "MultiTurnConfig", "RewardConfig", "RouterConfig",
    "SamplingConfig", "Section", "ServerConfig", "TraceConfig", "build_sections", "default_config",
    "resolve_config", "sampling_params_from_config", "validate", "weight_update_mode",
    "SectionBundle", "ServerSections", "WorkerSections", "GatewaySections",
]
