"""Value checks of the config sections that keep their components' long-standing messages.

Each raises :class:`~agentloop.errors.ConfigError` naming the key, what it got and what to give.
The sections of :mod:`agentloop.config.schema` run them (``PRECHECKS``) before the generic type
checks; components that take a value outside a section (the tool executor, the episode reward rule)
call them too.
"""

from __future__ import annotations

from typing import Any, get_args

from agentloop.config.build import read_value
from agentloop.errors import ConfigError
from agentloop.types import RewardTo

_R = "actor_rollout_ref.rollout"
_REWARD = "custom_reward_function"


def check_engine_name(name: Any) -> None:
    """Raise the ConfigError for a ``rollout.name`` other than vllm or sglang."""
    if name not in ("vllm", "sglang"):
        raise ConfigError(
            f"actor_rollout_ref.rollout.name must be 'vllm' or 'sglang', got {name!r}"
        )


def check_prompt_truncation(value: Any) -> None:
    """Raise the ConfigError for an ``agent.prompt_truncation`` other than left or error."""
    if value not in ("left", "error"):
        raise ConfigError(
            f"actor_rollout_ref.rollout.agent.prompt_truncation must be "
            f"'left' or 'error', "
            f"got {value!r}"
        )


BALANCER_MODES: tuple[str, ...] = ("shared", "local")
"""``server.balancer``: one balancer actor for every router, or each worker's router on its own."""


def check_balancer_mode(value: Any) -> None:
    """Raise the ConfigError for a ``server.balancer`` that is not one of :data:`BALANCER_MODES`."""
    if value not in BALANCER_MODES:
        raise ConfigError(
            f"actor_rollout_ref.rollout.server.balancer must be 'shared' (one balancer actor, "
            f"verl's routing) or 'local' (each worker's router balances on its own), got {value!r}"
        )


RESULT_CHANNELS: tuple[str, ...] = ("tcp", "ray")
"""``agent.result_channel``: how a worker's rows come back to the driver."""


def check_result_channel(value: Any) -> None:
    """Raise the ConfigError for an ``agent.result_channel`` not in :data:`RESULT_CHANNELS`."""
    if value not in RESULT_CHANNELS:
        raise ConfigError(
            f"actor_rollout_ref.rollout.agent.result_channel must be 'tcp' (rows on one "
            f"authenticated TCP connection per worker, docs/faults.md#result-channel) or 'ray' "
            f"(as the items of Ray's streaming generator), got {value!r}"
        )


ROUTING_MODES: tuple[str, ...] = ("sticky", "prefix")
"""``server.routing``: verl's sticky least-in-flight, or KV-cache-aware prefix affinity."""


def check_routing_mode(value: Any) -> None:
    """Raise the ConfigError for a ``server.routing`` that is not one of :data:`ROUTING_MODES`."""
    if value not in ROUTING_MODES:
        raise ConfigError(
            f"actor_rollout_ref.rollout.server.routing must be 'sticky' (request id, else least "
            f"in flight: verl's routing) or 'prefix' (KV-cache-aware prefix affinity, "
            f"docs/routing.md), got {value!r}"
        )


REWARD_TO_MODES: tuple[str, ...] = get_args(RewardTo)
"""``multi_turn.reward_to``: all | last | discounted."""


def check_reward_to(value: Any, where: str = "multi_turn") -> None:
    """Raise the ConfigError for a ``reward_to`` that is neither null nor one of
    :data:`REWARD_TO_MODES`."""
    if value is not None and value not in REWARD_TO_MODES:
        raise ConfigError(
            f"{where}.reward_to must be one of {' | '.join(REWARD_TO_MODES)}, got {value!r}"
        )


def check_reward_gamma(value: Any, where: str = "multi_turn") -> None:
    """Raise the ConfigError for a ``reward_gamma`` that is neither null nor a number in [0, 1]."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1
    ):
        raise ConfigError(
            f"{where}.reward_gamma must be a number in [0, 1] (the discount "
            f"per trajectory "
            f"before the final one), got {value!r}"
        )


EXECUTOR_KINDS: tuple[str, ...] = ("thread", "process")
"""``multi_turn.tool_executor``: where synchronous tool code runs."""


def check_tool_executor(kind: Any) -> None:
    """Raise the ConfigError for a ``tool_executor`` that is not one of :data:`EXECUTOR_KINDS`."""
    if kind not in EXECUTOR_KINDS:
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.tool_executor={kind!r}: "
            f"expected one of "
            f"{', '.join(EXECUTOR_KINDS)} (thread is the default)"
        )


def check_tool_max_workers(max_workers: Any) -> None:
    """Raise the ConfigError for a ``tool_max_workers`` that is not a positive int."""
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        default = read_value(None, f"{_R}.multi_turn.tool_max_workers")
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.tool_max_workers={max_workers!r}: "
            f"expected a "
            f"positive int (default {default})"
        )


def check_env_max_turns(value: Any) -> None:
    """Raise the ConfigError for an ``env.max_turns`` that is neither null nor a positive int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"actor_rollout_ref.rollout.env.max_turns={value!r}: expected null "
                          "(until done or the response budget) or a positive int")


def check_env_step_timeout(value: Any) -> None:
    """Raise the ConfigError for an ``env.step_timeout`` that is neither null nor a positive
    number."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is not None and (not number or value <= 0):
        raise ConfigError(f"actor_rollout_ref.rollout.env.step_timeout={value!r}: expected null "
                          "(no limit) or a positive number of seconds")


def check_context_window(window: Any) -> None:
    """Raise the ConfigError for a ``context_window`` that is neither null nor an int >= 1."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.context_window={window!r}: "
            f"give the number of "
            "latest turns to keep whole (an integer >= 1), or null for no window"
        )


def check_max_context_edits(cap: Any) -> None:
    """Raise the ConfigError for a ``max_context_edits`` that is neither null nor an int >= 0."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.max_context_edits={cap!r}: "
            f"give the most "
            "snapshots per sample (an integer >= 0), or null for no cap"
        )


def check_gateway_reward_to(value: Any) -> None:
    """Raise the ConfigError for a ``gateway.reward_to`` that is not null, a ``multi_turn`` mode
    or longest."""
    if value is not None and value not in (*REWARD_TO_MODES, "longest"):
        raise ConfigError(f"rollout.gateway.reward_to must be null (follow multi_turn.reward_to) | "
                          f"{' | '.join(REWARD_TO_MODES)} | longest, got {value!r}")


def check_reward_block(block: dict[str, Any]) -> None:
    """Raise a ConfigError naming the first invalid key of a ``custom_reward_function`` block."""
    path, name, kwargs = block.get("path"), block.get("name"), block.get("reward_kwargs")
    if path is not None and not (isinstance(path, str) and path.strip()):
        raise ConfigError(f"{_REWARD}.path must be null, a .py file or a module name, got {path!r}")
    if not isinstance(name, str):
        raise ConfigError(f"{_REWARD}.name must be a function name, got {name!r}")
    if not isinstance(kwargs, dict):
        raise ConfigError(
            f"{_REWARD}.reward_kwargs must be a mapping of keyword arguments, got {kwargs!r}"
        )
    timeout = block.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
    ):
        raise ConfigError(
            f"{_REWARD}.timeout must be null or a number of seconds >= 0 (0: "
            f"no limit), "
            f"got {timeout!r}"
        )
    if not isinstance(block.get("add_tool_rewards"), bool):
        raise ConfigError(
            f"{_REWARD}.add_tool_rewards must be true or false, got "
            f"{block.get('add_tool_rewards')!r}"
        )
