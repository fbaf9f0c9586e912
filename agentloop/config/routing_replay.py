"""Routing replay (R3) at start-up: refuse the key where it cannot work, and the routing's shape.

:func:`check_routing_replay` is called by the manager before any actor starts (a dense model or
another backend with ``actor_rollout_ref.rollout.enable_rollout_routing_replay`` on is a
:class:`~agentloop.errors.ConfigError`) and by each worker for the ``(layers, top_k)`` of the
``routed_experts`` column.  Spec: docs/porting-from-verl.md#routing-replay-r3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop.config.schema import EngineConfig, ModelConfig
from agentloop.errors import ConfigError

KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys giving the number of routed experts (Qwen-MoE, Mixtral, DeepSeek, Dbrx)."""
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token")
"""config.json keys giving the experts each token is routed to."""


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, list):  # some configs give one value per layer
            value = max(value, default=0)
        if value:
            return int(value)
    return 0


def read_model_config(model: ModelConfig) -> dict[str, Any]:
    """The model's config.json (a nested ``text_config`` merged over it, as for VL models).

    Raises:
        ConfigError: it cannot be read.
    """
    path = Path(model.local_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{KEY} needs the model's config.json to tell an MoE model from a dense one; "
            f"cannot read {path}: {e}"
        ) from e
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def moe_shape(config: dict[str, Any]) -> tuple[int, int] | None:
    """``(num_hidden_layers, top_k)`` of an MoE model's config, as vLLM shapes routed experts;
    None for a dense model (no routed-expert count)."""
    if _first(config, EXPERT_KEYS) <= 0:
        return None
    return int(config.get("num_hidden_layers") or 0), _first(config, TOP_K_KEYS)


def check_routing_replay(engine: EngineConfig, model: ModelConfig) -> tuple[int, int] | None:
    """The ``(layers, top_k)`` of the ``routed_experts`` column, or None when the key is off.

    Raises:
        ConfigError: the key is on with a backend other than vLLM or SGLang, or with a dense
            model (its config.json names no routed experts), or the config cannot be read.
    """
    if not engine.enable_rollout_routing_replay:
        return None
    if engine.name not in ("vllm", "sglang"):
        raise ConfigError(
            f"{KEY}: routing replay needs the vllm or sglang backend "
            f"(actor_rollout_ref.rollout.name is {engine.name!r}); use one of them or set it "
            "to false"
        )
    shape = moe_shape(read_model_config(model))
    if shape is None:
        raise ConfigError(
            f"{KEY} is on but the model {model.path!r} is dense: its config.json has none of "
            f"{', '.join(EXPERT_KEYS)}; routing replay needs a mixture-of-experts model, "
            "set it to false"
        )
    return shape
