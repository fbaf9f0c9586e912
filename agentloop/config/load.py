"""Config loading and slicing.

Users pass either a trainer-shaped config (``actor_rollout_ref.rollout`` / ``actor_rollout_ref.model``,
as in verl) or just the rollout subtree plus a model path.  :func:`resolve_config` turns either into
:class:`AgentLoopConfig`, and each component then receives only its own slice: servers get
``rollout`` + ``model``, workers get ``rollout`` + ``model``, agent loops get ``rollout``.
Missing keys are filled from ``configs/rollout.yaml`` so a partial config works.

Nothing is ignored silently: after merging, :mod:`agentloop.configcheck` rejects unknown keys (a ConfigError
with a did-you-mean, as verl's Hydra struct configs do), names unsupported verl features set to non-default
values (one warning), and raises on values of the wrong type; ``rollout.agent.strict_config`` makes the
warning an error too (``true``) or both only warnings (``false``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentloop.configcheck import check_keys, check_load_format, check_types, fill_verl_defaults
from agentloop.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def default_config() -> DictConfig:
    """The full default config (``agentloop/configs/rollout.yaml``), unresolved."""
    return OmegaConf.load(CONFIG_DIR / "rollout.yaml")  # type: ignore[return-value]


@dataclass(frozen=True)
class AgentLoopConfig:
    """The config slices the rollout stack needs, and the whole trainer-shaped config they came from."""

    rollout: DictConfig
    """``actor_rollout_ref.rollout`` with defaults filled in and interpolations resolved."""
    model: DictConfig
    """``actor_rollout_ref.model`` (``path``, ``trust_remote_code``)."""
    root: DictConfig
    """The whole trainer-shaped config (``actor_rollout_ref``, ``data``, ...), defaults filled in: what
    verl-style agent loops receive as ``trainer_config`` (wrapped in ``DictConfigWrap``)."""

    @property
    def model_path(self) -> str:
        """Local model directory, ``~`` expanded."""
        return os.path.expanduser(str(self.model.path))


def _merge_defaults(config: DictConfig) -> tuple[DictConfig, dict[str, Any], dict[str, Any]]:
    """The merged config (resolved), the same unresolved as a plain dict, and the defaults as a dict."""
    defaults = default_config()
    merged = OmegaConf.merge(defaults, config)
    raw = OmegaConf.to_container(merged, resolve=False)
    OmegaConf.resolve(merged)
    return merged, raw, OmegaConf.to_container(defaults, resolve=False)  # type: ignore[return-value]


def resolve_config(config: DictConfig | dict[str, Any], model_path: str | None = None) -> AgentLoopConfig:
    """Accept a trainer-shaped config or a rollout subtree and return its slices.

    Args:
        config: either a root config with ``actor_rollout_ref`` or the rollout subtree itself.
        model_path: required when ``config`` is a rollout subtree; overrides the model path otherwise.
    """
    if not isinstance(config, DictConfig):
        config = OmegaConf.create(config)
    if "actor_rollout_ref" in config:
        root, raw, defaults = _merge_defaults(config)
    else:
        if model_path is None:
            raise ConfigError(
                "got a rollout-only config but no model path: pass model_path=... or a trainer-shaped config "
                "with actor_rollout_ref.model.path"
            )
        rollout = OmegaConf.to_container(config, resolve=False)
        rollout.setdefault("prompt_length", 512)  # type: ignore[union-attr]
        rollout.setdefault("response_length", 512)  # type: ignore[union-attr]
        root, raw, defaults = _merge_defaults(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}}))
    if model_path is not None:
        root.actor_rollout_ref.model.path = model_path
    check_types(root)
    check_keys(raw, root, defaults)
    check_load_format(root)
    fill_verl_defaults(root)  # verl loops read verl keys agentloop itself has no use for
    _resolve_weight_update(root)
    cfg = AgentLoopConfig(rollout=root.actor_rollout_ref.rollout, model=root.actor_rollout_ref.model, root=root)
    validate(cfg)
    return cfg


def _resolve_weight_update(root: DictConfig) -> None:
    """``rollout.server.weight_update: null`` becomes ``abort`` (verl's fully-async default, ``partial_rollout:
    true``), or ``drain`` where ``async_training.partial_rollout`` is false: without partial rollouts verl's
    parameter sync waits for the running requests instead of cutting them."""
    server = root.actor_rollout_ref.rollout.server
    if server.get("weight_update") is None:
        partial = OmegaConf.select(root, "async_training.partial_rollout", default=None)
        server.weight_update = "drain" if partial is False else "abort"


def validate(cfg: AgentLoopConfig) -> None:
    """Check the values that would otherwise fail late, inside an engine or actor."""
    r = cfg.rollout
    if r.agent.prompt_truncation not in ("left", "error"):
        raise ConfigError(
            f"actor_rollout_ref.rollout.agent.prompt_truncation must be 'left' or 'error', "
            f"got {r.agent.prompt_truncation!r}"
        )
    if r.name not in ("vllm", "sglang"):
        raise ConfigError(f"actor_rollout_ref.rollout.name must be 'vllm' or 'sglang', got {r.name!r}")
    if r.name == "sglang" and (r.get("server") or {}).get("weight_update") == "keep":
        raise ConfigError("actor_rollout_ref.rollout.server.weight_update: keep is implemented for vLLM only; set it "
                          "to abort (the default) or drain with rollout.name: sglang")
    path = Path(cfg.model_path)
    if not path.is_dir():
        raise ConfigError(
            f"actor_rollout_ref.model.path {str(cfg.model.path)!r} is not a directory on this machine. "
            "agentloop loads models from local paths only; build the tiny test model with "
            "`python scripts/make_tiny_model.py` or point model.path at a downloaded checkpoint."
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"actor_rollout_ref.model.path {str(path)!r} has no config.json; is it a HF model dir?")


def sampling_params_from_config(rollout: DictConfig, validate: bool = False) -> dict[str, Any]:
    """verl's per-batch sampling params: ``val_kwargs`` replace them when ``validate`` is set."""
    src = rollout.val_kwargs if validate else rollout
    params: dict[str, Any] = {
        "temperature": float(src.temperature),
        "top_p": float(src.top_p),
        "top_k": int(src.top_k),
        "repetition_penalty": float(rollout.get("repetition_penalty", 1.0)),
        "logprobs": bool(rollout.calculate_log_probs),
    }
    if not src.get("do_sample", True):
        params["temperature"] = 0.0
    if rollout.ignore_eos:
        params["ignore_eos"] = True
    return params
