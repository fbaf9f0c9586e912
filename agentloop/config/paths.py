"""Where the defaults file lives, and loading it."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
"""``agentloop/configs``: ``rollout.yaml`` (every default) and the example configs."""


def default_config() -> DictConfig:
    """The full default config (``agentloop/configs/rollout.yaml``), unresolved."""
    return OmegaConf.load(CONFIG_DIR / "rollout.yaml")  # type: ignore[return-value]
