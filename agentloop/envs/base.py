"""The environment protocol of the ``env_agent`` loop (docs/environments.md).

An environment is anything with ``reset``, ``step`` and ``close`` of the shapes below, async or
plain (a plain method runs in a thread pool, so a blocking environment never stalls the worker's
event loop). Adapters wrap environment libraries (SkyRL-gym, TextArena, reasoning-gym, ...) into it;
a user's own environment is a small class registered with :func:`register_env`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentloop.utils.registry import Registry

Message = dict[str, Any]
"""A chat message:
``{"role": "user" | "tool" | "system", "content": ..., "tool_call_id"?: ...}``."""


@dataclass
class EnvReset:
    """What an episode starts from."""

    messages: list[Message]
    """The prompt: chat messages the policy sees first (system / user)."""
    tools: list[dict[str, Any]] | None = None
    """Chat-completions function tools offered to the policy (None: none)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to keep in the row's ``extra_fields`` (strings, numbers)."""


@dataclass
class EnvStep:
    """The environment's answer to one assistant turn."""

    messages: list[Message]
    """New messages appended after the assistant turn (observations: user or tool turns); may be
    []."""
    reward: float = 0.0
    """This turn's reward (recorded in ``turn_scores``)."""
    done: bool = False
    """The episode is over: no more turns are generated."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to keep in the row's ``extra_fields``; ``info["score"]`` (when given on the last
    step) is the episode's final score instead of the sum of turn rewards (docs/environments.md)."""


@dataclass
class AssistantTurn:
    """One assistant turn as the environment sees it."""

    text: str
    """The decoded text the policy wrote (tool-call markup included)."""
    content: str
    """The text without parsed tool calls."""
    tool_calls: list[dict[str, Any]]
    """Parsed calls: ``{"id", "name", "arguments"}`` (arguments a dict), in order."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment; a new instance per sample (made by the registered factory)."""

    def reset(self, sample: dict[str, Any]) -> EnvReset:
        """Start the episode from the sample's fields (``raw_prompt``, ``extra_info``...)."""
        ...

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Answer one assistant turn."""
        ...

    def close(self) -> None:
        """Release what the episode holds (called once, also after errors)."""
        ...


ENVS: Registry = Registry(
    "environment", decorator="register_env",
    how="register one with @register_env(name) or name its class with _target_ in the env config",
    where="extra_info.env",
)
"""Environment factories by name: ``factory(**env_config) -> Environment`` (a class is a
factory)."""


def register_env(name: str) -> Any:
    """Decorator: register an environment class (or factory) under ``name``."""
    return ENVS.register(name)


BUILTIN_ENV_TARGETS: dict[str, str] = {
    "skyrl_gym": "agentloop.envs.skyrl.SkyRLGymEnv",
    "textarena": "agentloop.envs.textarena.TextArenaEnv",
    "reasoning_gym": "agentloop.envs.reasoning_gym.ReasoningGymEnv",
    "subprocess": "agentloop.envs.subprocess_env.SubprocessEnv",
    "openenv": "agentloop.envs.openenv.OpenEnvEnv",
}
"""The adapters by import path: registered by name here and imported when first resolved, so a
sample can name one without importing its module (or its optional package) first."""
for _name, _target in BUILTIN_ENV_TARGETS.items():
    ENVS.add(_name, _target)
