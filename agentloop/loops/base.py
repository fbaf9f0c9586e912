"""AgentLoopBase and the agent-loop registry.

An agent loop is a small state machine that turns one sample into one trajectory (or several) by
calling the router.  Loops are selected per sample by the ``agent_name`` non-tensor field.

Registration, two ways (as in verl):

* in code: ``@register("my_agent")`` on an :class:`AgentLoopBase` subclass;
* in YAML: ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` points at a list of
  ``{name: my_agent, _target_: pkg.module.MyAgentLoop, **kwargs}``; the kwargs are passed to the
  constructor of every instance.

Each AgentLoopWorker resolves the registry once (:func:`resolve_registry`) into classes and kwargs,
then builds one cheap loop instance per sample, without Hydra in the per-sample path.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig

from agentloop.errors import ConfigError, UnknownAgentError
from agentloop.imports import import_subclass, load_yaml_entries
from agentloop.types import AgentLoopOutput

_agent_loop_registry: dict[str, dict[str, Any]] = {}


def register(agent_name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make an AgentLoopBase subclass selectable as ``agent_name``."""

    def decorator(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise ConfigError(f"@register({agent_name!r}) must decorate an AgentLoopBase subclass, got {cls!r}")
        _agent_loop_registry[agent_name] = {"_target_": f"{cls.__module__}.{cls.__qualname__}", "_class_": cls}
        return cls

    return decorator


_settings_memo: dict[tuple[int, str], tuple[Any, dict[str, Any]]] = {}


def config_values(config: DictConfig, key: str, read: Callable[[DictConfig], dict[str, Any]]) -> dict[str, Any]:
    """``read(config)``, computed once per config object and ``key``.

    Loop instances are built once per sample; reading a DictConfig costs ~25 µs an attribute, which at
    hundreds of samples per batch showed up in ``scripts/bench_overhead.py``.  The memo holds the config
    object itself, so an id is never confused with a later object's.  A config mutated after its first
    loop was built is not re-read.
    """
    memo_key = (id(config), key)
    hit = _settings_memo.get(memo_key)
    if hit is None or hit[0] is not config:
        if len(_settings_memo) > 256:  # configs are few per process; bound it anyway
            _settings_memo.clear()
        hit = (config, read(config))
        _settings_memo[memo_key] = hit
    return hit[1]


def _base_values(config: DictConfig) -> dict[str, Any]:
    return {
        "prompt_length": int(config.prompt_length),
        "response_length": int(config.response_length),
        "prompt_truncation": str((config.get("agent") or {}).get("prompt_truncation", "left")),
    }


def registered_agent_names() -> list[str]:
    """Names registered in code so far (YAML entries are added per worker)."""
    return sorted(_agent_loop_registry)


class AgentLoopBase(ABC):
    """Base class of agent loops.

    Args:
        config: the rollout config slice (``actor_rollout_ref.rollout``).
        server_manager: an :class:`agentloop.routing.AsyncLLMServerManager`.
        tokenizer: a HF tokenizer of the served model.
        processor: a HF processor for multimodal models, else None.
        **kwargs: extra keys from the YAML registry entry.
    """

    requires_gateway: ClassVar[bool] = False
    """Declared by loops that talk to the OpenAI gateway (the manager then starts gateway actors and
    passes ``gateway_manager=`` to :meth:`init_class`)."""

    def __init__(
        self,
        config: DictConfig,
        server_manager: Any,
        tokenizer: Any,
        processor: Any | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        values = config_values(config, "base", _base_values)
        self.prompt_length: int = values["prompt_length"]
        self.response_length: int = values["response_length"]
        self.prompt_truncation: str = values["prompt_truncation"]
        self.loop = asyncio.get_running_loop()

    @classmethod
    def init_class(cls, config: DictConfig, tokenizer: Any, processor: Any | None = None, **kwargs: Any) -> None:
        """Once-per-worker set-up shared by all instances (load tools, parsers...). Default: nothing."""
        return None

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Roll out one sample.

        Args:
            sampling_params: verl-style sampling params for this batch.
            **kwargs: the sample's non-tensor fields (``raw_prompt``, ``extra_info``, ``index``, ...).

        Returns:
            One trajectory, or a list of them (each becomes a row with this sample's fields).
        """


@dataclass
class ResolvedAgentLoop:
    """A registry entry with its class imported: build instances with :meth:`create`."""

    name: str
    cls: type[AgentLoopBase]
    kwargs: dict[str, Any] = field(default_factory=dict)


def load_registry_file(path: str) -> dict[str, dict[str, Any]]:
    """Read an ``agent_loop_config_path`` YAML: a list of ``{name, _target_, **kwargs}``."""
    entries = load_yaml_entries(path, None, "agent_loop_config_path")
    out: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or "_target_" not in entry:
            raise ConfigError(f"{path}: entry {i} must have 'name' and '_target_', got {entry!r}")
        entry = dict(entry)
        out[str(entry.pop("name"))] = entry
    return out


def resolve_registry(agent_loop_config_path: str | None = None) -> dict[str, ResolvedAgentLoop]:
    """Import every registered loop class once; YAML entries override code registrations."""
    # Importing the built-in loops registers them.
    import agentloop.gateway.framework  # noqa: F401
    import agentloop.loops.single_turn  # noqa: F401
    import agentloop.loops.tool_agent  # noqa: F401

    entries = dict(_agent_loop_registry)
    if agent_loop_config_path:
        entries.update(load_registry_file(agent_loop_config_path))
    resolved = {}
    for name, entry in entries.items():
        entry = dict(entry)
        target = entry.pop("_target_")
        cls = entry.pop("_class_", None) or import_subclass(target, AgentLoopBase, f"agent loop {name!r} _target_")
        resolved[name] = ResolvedAgentLoop(name=name, cls=cls, kwargs=entry)
    return resolved


def lookup(registry: dict[str, ResolvedAgentLoop], agent_name: str) -> ResolvedAgentLoop:
    """Registry lookup with an error that lists what exists."""
    try:
        return registry[agent_name]
    except KeyError:
        raise UnknownAgentError(
            f"agent_name {agent_name!r} is not registered; registered agent loops: {sorted(registry)}. "
            "Register it with @register(name) in a module the worker imports, or list it in "
            "actor_rollout_ref.rollout.agent.agent_loop_config_path."
        ) from None
