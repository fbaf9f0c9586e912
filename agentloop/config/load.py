"""resolve_config and AgentLoopConfig: loading and slicing the config.

Users pass either a trainer-shaped config (``actor_rollout_ref.rollout`` /
``actor_rollout_ref.model``, as in verl) or just the rollout subtree plus a model path.
:func:`resolve_config` turns either into :class:`AgentLoopConfig`; each actor then receives a bundle
of its typed sections (:mod:`agentloop.config.sections`), and verl-style agent loops the whole
trainer config (``root``). Missing keys are filled from ``configs/rollout.yaml`` so a partial config
works.

Nothing is ignored silently: after merging, :mod:`agentloop.configcheck` rejects unknown keys (a
ConfigError with a did-you-mean, as verl's Hydra struct configs do), names unsupported verl features
set to non-default values (one warning), and raises on values of the wrong type;
``rollout.agent.strict_config`` makes the warning an error too (``true``) or both only warnings
(``false``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentloop.config.paths import default_config
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
    weight_update_mode,
)
from agentloop.config.sections import SECTION_BUILDERS
from agentloop.configcheck import check_keys, check_load_format, check_types, fill_verl_defaults
from agentloop.errors import ConfigError


def _typed() -> Any:
    return field(init=False, repr=False, compare=False)


@dataclass(frozen=True)
class AgentLoopConfig:
    """The config slices the rollout stack needs, and the whole trainer-shaped config they came
    from.

    Besides the omegaconf slices it holds one typed, frozen section per component (built from
    ``root`` when the object is made, so a mistyped value fails here): ``engine``, ``sampling``,
    ``val_sampling``, ``model_config``, ``server``, ``router``, ``agent``, ``multi_turn``,
    ``gateway``, ``trace``, ``reward``, ``async_training``, ``data``.  They do not follow later
    edits of the omegaconf slices; build a new object (``dataclasses.replace(cfg)``) or a new
    section (``dataclasses.replace(cfg.server, ...)``).
    """

    rollout: DictConfig
    """``actor_rollout_ref.rollout`` with defaults filled in and interpolations resolved."""
    model: DictConfig
    """``actor_rollout_ref.model`` (``path``, ``trust_remote_code``)."""
    root: DictConfig
    """The whole trainer-shaped config (``actor_rollout_ref``, ``data``, ...), defaults filled in:
    what verl-style agent loops receive as ``trainer_config`` (wrapped in ``DictConfigWrap``)."""
    engine: EngineConfig = _typed()
    sampling: SamplingConfig = _typed()
    val_sampling: SamplingConfig = _typed()
    """Sampling for validation batches (``val_kwargs``)."""
    model_config: ModelConfig = _typed()
    server: ServerConfig = _typed()
    router: RouterConfig = _typed()
    agent: AgentConfig = _typed()
    multi_turn: MultiTurnConfig = _typed()
    gateway: GatewayConfig = _typed()
    env: EnvConfig = _typed()
    trace: TraceConfig = _typed()
    reward: RewardConfig = _typed()
    async_training: AsyncConfig = _typed()
    data: DataConfig = _typed()

    def __post_init__(self) -> None:
        for name, section in build_sections(self.root).items():
            object.__setattr__(self, name, section)

    @property
    def model_path(self) -> str:
        """Local model directory, ``~`` expanded."""
        return os.path.expanduser(str(self.model.path))


def build_sections(root: Any) -> dict[str, Any]:
    """Every typed section of a trainer-shaped config, by its :class:`AgentLoopConfig` attribute
    name.

    Raises:
        ConfigError: a value is mistyped or out of range.
    """
    return {name: build(root) for name, build in SECTION_BUILDERS.items()}


def _merge_defaults(config: DictConfig) -> tuple[DictConfig, dict[str, Any], dict[str, Any]]:
    """The merged config (resolved), the same unresolved as a plain dict, and the defaults as a
    dict."""
    defaults = default_config()
    merged = OmegaConf.merge(defaults, config)
    raw = OmegaConf.to_container(merged, resolve=False)
    OmegaConf.resolve(merged)
    return merged, raw, OmegaConf.to_container(defaults, resolve=False)  # type: ignore[return-value]


def resolve_config(
    config: DictConfig | dict[str, Any], model_path: str | None = None
) -> AgentLoopConfig:
    """Accept a trainer-shaped config or a rollout subtree and return its slices.

    Args:
        config: either a root config with ``actor_rollout_ref`` or the rollout subtree itself.
        model_path: required when ``config`` is a rollout subtree; overrides the model path
        otherwise.
    """
    if not isinstance(config, DictConfig):
        config = OmegaConf.create(config)
    if "actor_rollout_ref" in config:
        root, raw, defaults = _merge_defaults(config)
    else:
        if model_path is None:
            raise ConfigError(
                "got a rollout-only config but no model path: pass model_path=... or a "
                "trainer-shaped config "
                "with actor_rollout_ref.model.path"
            )
        rollout = OmegaConf.to_container(config, resolve=False)
        root, raw, defaults = _merge_defaults(
            OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
        )
    if model_path is not None:
        root.actor_rollout_ref.model.path = model_path
    check_types(root)
    check_keys(raw, root, defaults)
    check_load_format(root)
    fill_verl_defaults(root)  # verl loops read verl keys agentloop itself has no use for
    _resolve_weight_update(root)
    cfg = AgentLoopConfig(
        rollout=root.actor_rollout_ref.rollout, model=root.actor_rollout_ref.model, root=root
    )
    validate(cfg)
    return cfg


def _resolve_weight_update(root: DictConfig) -> None:
    """``rollout.server.weight_update: null`` becomes ``abort`` (verl's fully-async default,
    ``partial_rollout: true``), or ``drain`` where ``async_training.partial_rollout`` is false:
    without partial rollouts verl's parameter sync waits for the running requests instead of cutting
    them."""
    server = root.actor_rollout_ref.rollout.server
    partial = OmegaConf.select(root, "async_training.partial_rollout", default=None)
    server.weight_update = weight_update_mode(server.weight_update, partial)


def validate(cfg: AgentLoopConfig) -> None:
    """Check the values that would otherwise fail late, inside an engine or actor (the sections
    checked their own values when ``cfg`` was made).

    Raises:
        ConfigError: weight_update keep with SGLang, or a model path that is not a local HF model
        directory.
    """
    if cfg.engine.name == "sglang" and cfg.server.weight_update == "keep":
        raise ConfigError(
            "actor_rollout_ref.rollout.server.weight_update: keep is "
            "implemented for vLLM only; set it "
            "to abort (the default) or drain with rollout.name: sglang"
        )
    path = Path(cfg.model_path)
    if not path.is_dir():
        raise ConfigError(
            f"actor_rollout_ref.model.path {str(cfg.model.path)!r} is not a directory on "
            f"this machine. "
            "agentloop loads models from local paths only; build the tiny test model with "
            "`python scripts/make_tiny_model.py` or point model.path at a downloaded checkpoint."
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"actor_rollout_ref.model.path {str(path)!r} has no config.json; is it a HF model dir?"
        )


def sampling_params_from_config(rollout: DictConfig, validate: bool = False) -> dict[str, Any]:
    """verl's per-batch sampling params: ``val_kwargs`` replace them when ``validate`` is set.

    Args:
        rollout: the ``actor_rollout_ref.rollout`` subtree (absent keys take the YAML's values).
        validate: use ``val_kwargs``.

    Raises:
        ConfigError: a sampling value is mistyped or out of range.
    """
    root = {"actor_rollout_ref": {"rollout": rollout}}
    sampling = (
        SamplingConfig.validation_from_root(root) if validate else SamplingConfig.from_root(root)
    )
    return sampling.params()
