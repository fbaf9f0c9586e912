"""A worker process's once-only set-up: the rollout tools, the trace recorder, the model type.

Used by :class:`agentloop.rollout.worker.AgentLoopWorker` when it starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop.compat.rollout_trace import RolloutTraceConfig
from agentloop.config import ModelConfig, MultiTurnConfig, TraceConfig
from agentloop.tools.registry import load_all_tools


def load_rollout_tools(multi_turn: MultiTurnConfig) -> list[Any]:
    """The tools of ``multi_turn.tool_config_path`` (and ``function_tool_path``), loaded once per
    process and config (the worker hands them to verl 0.9 loops and to ``tool_agent``)."""
    key = (multi_turn.tool_config_path, multi_turn.function_tool_path)
    if key not in _TOOLS:
        _TOOLS[key] = (
            load_all_tools(tool_config_path=key[0], function_tool_path=key[1]) if any(key) else []
        )
    return _TOOLS[key]


_TOOLS: dict[tuple[Any, Any], list[Any]] = {}


def start_tracing(trace: TraceConfig) -> int | None:
    """verl's ``rollout.trace``: configure this process's trace recorder; returns how many samples a
    worker traces per step (None: all).  An unsupported backend raises ConfigError (the manager
    reports it)."""
    if trace.backend:
        RolloutTraceConfig.init(
            trace.project_name or "agentloop", trace.experiment_name or "rollout", trace.backend,
            trace.token2text, trace.max_samples_per_step_per_worker,
        )
    return trace.max_samples_per_step_per_worker


def hf_model_type(model: ModelConfig) -> str | None:
    """``model_type`` of the model's config.json (verl passes it to loops as ``hf_model_type``);
    None when it cannot be read."""
    try:
        return json.loads((Path(model.local_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
