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

from omegaconf import DictConfig, OmegaConf

from agentloop.compat.loop_helpers import VerlLoopHelpers
from agentloop.compat.wrappers import DictConfigWrap, ToolListWrap
from agentloop.config import AgentConfig, DataConfig, EngineConfig
from agentloop.errors import ConfigError, UnknownAgentError
from agentloop.types import AgentLoopOutput, MultiTrajectoryAgentLoopOutput
from agentloop.utils.imports import load_yaml_entries
from agentloop.utils.registry import (
    TARGET_KEYS,
    EntryDictView,
    Registry,
    did_you_mean,
    entry_target,
)

__all__ = ["AgentLoopBase", "DictConfigWrap", "ToolListWrap", "register"]


def register(agent_name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make an AgentLoopBase subclass selectable as ``agent_name`` (verl's
    spelling).

    Raises:
        ConfigError: not an AgentLoopBase subclass, or the name is taken by another user loop.
    """

    def decorator(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        # agentloop's own loops register when first imported, which can be after a user's loop
        # took the name (a ported verl `tool_agent`): a user's registration always wins over a
        # built-in one.
        builtin = isinstance(cls, type) and cls.__module__.startswith("agentloop.")
        (BUILTIN_AGENT_LOOPS if builtin else AGENT_LOOPS).add(agent_name, cls)
        return cls

    return decorator


_settings_memo: dict[tuple[int, str], tuple[Any, dict[str, Any]]] = {}


def config_values(
    config: DictConfig, key: str, read: Callable[[DictConfig], dict[str, Any]]
) -> dict[str, Any]:
    """``read(config)``, computed once per config object and ``key``.

    Loop instances are built once per sample; reading a DictConfig costs ~25 µs an attribute, which
    at hundreds of samples per batch showed up in ``scripts/bench_overhead.py``.  The memo holds the
    config object itself, so an id is never confused with a later object's.  A config mutated after
    its first loop was built is not re-read.
    """
    memo_key = (id(config), key)
    hit = _settings_memo.get(memo_key)
    if hit is None or hit[0] is not config:
        if len(_settings_memo) > 256:  # configs are few per process; bound it anyway
            _settings_memo.clear()
        hit = (config, read(config))
        _settings_memo[memo_key] = hit
    return hit[1]


def _base_values(rollout: DictConfig) -> dict[str, Any]:
    engine = EngineConfig.from_rollout(rollout)
    return {
        "prompt_length": engine.prompt_length, "response_length": engine.response_length,
        "prompt_truncation": AgentConfig.from_rollout(rollout).prompt_truncation,
    }


def _thread_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    # none yet (or asyncio.run closed it): one for this thread, reused by later loops
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


def _root_parts(root: DictConfig) -> dict[str, Any]:
    return {
        "rollout": root.actor_rollout_ref.rollout,
        "data": root.get("data") or OmegaConf.create({}),
    }


def _data_kwargs(data: Any) -> dict[str, Any]:
    section = DataConfig.from_root({"data": data})
    return {"apply_chat_template_kwargs": dict(section.apply_chat_template_kwargs or {}),
            "mm_processor_kwargs": dict(section.mm_processor_kwargs or {})}


def _root_of_slice(rollout: DictConfig) -> dict[str, Any]:
    return {"root": OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "data": {}})}


def _root_or_wrapped(config: DictConfig) -> dict[str, Any]:
    return {"root": config} if "actor_rollout_ref" in config else _root_of_slice(config)


def trainer_config_of(config: Any) -> DictConfig:
    """The whole trainer-shaped config from what a loop or ``init_class`` was given: verl's
    ``DictConfigWrap``, a trainer-shaped DictConfig, or (agentloop's older form) the rollout slice
    alone."""
    if isinstance(config, DictConfigWrap):
        config = config.config
    if not isinstance(config, DictConfig):  # a fresh object each call: nothing to remember
        return _root_or_wrapped(OmegaConf.create(config))["root"]
    # decided (and built) once per config object
    return config_values(config, "root", _root_or_wrapped)["root"]


def rollout_config_of(config: Any) -> DictConfig:
    """``actor_rollout_ref.rollout`` of any form :func:`trainer_config_of` accepts."""
    return trainer_config_of(config).actor_rollout_ref.rollout


def registered_agent_names() -> list[str]:
    """Names registered in code so far (YAML entries are added per worker)."""
    return AGENT_LOOPS.names()


class AgentLoopBase(VerlLoopHelpers, ABC):
    """Base class of agent loops; the constructor is verl's (0.6–0.9).

    Args:
        trainer_config: ``DictConfigWrap`` over the whole trainer-shaped config (verl's form; the
        worker
            passes this).  A DictConfig (whole config, or agentloop's older rollout slice) is
            accepted too.
        server_manager: an :class:`agentloop.routing.AsyncLLMServerManager` (verl:
        ``LLMServerClient``). tokenizer: a HF tokenizer of the served model. processor: a HF
        processor for multimodal models, else None. dataset_cls: verl's dataset class hook
        (``process_multi_modal_info``); None here unless given. data_config: ``DictConfigWrap`` over
        ``data`` (default: the trainer config's ``data``). **kwargs: extra keys from the YAML
        registry entry, and what verl 0.9 passes (``tools``,
            ``hf_model_type``); ignored by the base class.

    Attributes read by loops (verl names): ``config`` (whole config), ``rollout_config``,
    ``data_config``, ``server_manager``, ``tokenizer``, ``processor``,
    ``apply_chat_template_kwargs``, ``loop``; agentloop adds ``prompt_length``, ``response_length``
    and ``prompt_truncation``.
    """

    requires_gateway: ClassVar[bool] = False
    """Declared by loops that talk to the OpenAI gateway (the manager then starts gateway actors and
    passes ``gateway_manager=`` to :meth:`init_class`)."""
    init_class_takes_tools: ClassVar[bool] = False
    """Declared by loops whose :meth:`init_class` accepts ``tools=`` (the worker's loaded tools)."""
    _class_initialized: ClassVar[bool] = False
    """verl's flag: set once :meth:`init_class` ran for the class (the worker sets it after
    calling it)."""

    def __init__(
        self, trainer_config: Any, server_manager: Any, tokenizer: Any,
        processor: Any | None = None, dataset_cls: Any = None, data_config: Any = None,
        **kwargs: Any,
    ) -> None:
        root = trainer_config_of(trainer_config)
        # built outside a worker: verl's constructor runs init_class
        if not type(self)._class_initialized:
            type(self).init_class(
                config=root, tokenizer=tokenizer, processor=processor,
                **{k: v for k, v in kwargs.items() if k not in LOOP_CONTRACT_KWARGS},
            )
        # DictConfig reads cost ~25 µs each: once per config
        parts = config_values(root, "parts", _root_parts)
        self.config = root
        self.rollout_config: DictConfig = parts["rollout"]
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        data = data_config.config if isinstance(data_config, DictConfigWrap) else data_config
        self.data_config = data if data is not None else parts["data"]
        kwargs_of = config_values(self.data_config, "data_kwargs", _data_kwargs)
        self.apply_chat_template_kwargs: dict[str, Any] = dict(
            kwargs_of["apply_chat_template_kwargs"]
        )
        self.mm_processor_kwargs: dict[str, Any] = dict(kwargs_of["mm_processor_kwargs"])
        values = config_values(self.rollout_config, "base", _base_values)
        self.prompt_length: int = values["prompt_length"]
        self.response_length: int = values["response_length"]
        self.prompt_truncation: str = values["prompt_truncation"]
        try:
            self.loop = asyncio.get_running_loop()
        # built outside an event loop (a test): the thread's loop, made once (verl's semantics)
        except RuntimeError:
            self.loop = _thread_loop()

    @classmethod
    def init_class(
        cls, config: Any, tokenizer: Any, processor: Any | None = None, **kwargs: Any
    ) -> None:
        """Once-per-worker set-up shared by all instances (load tools, parsers...).

        ``config`` is the whole trainer-shaped config (verl's form).  The worker calls this once
        when it starts, with the registry entry's kwargs, then sets ``_class_initialized``; a loop
        class whose ``init_class`` raises is reported by name and only its samples fail.  Default:
        verl's flag only.
        """
        cls._class_initialized = True

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any
                  ) -> AgentLoopOutput | list[AgentLoopOutput] | MultiTrajectoryAgentLoopOutput:
        """Roll out one sample.

        Args:
            sampling_params: verl-style sampling params for this batch.
            **kwargs: the sample's non-tensor fields (``raw_prompt``, ``extra_info``, ``index``,
            ...).

        Returns:
            One trajectory, or several of one episode (a list, or a
            :class:`MultiTrajectoryAgentLoopOutput`, final trajectory last): each becomes a row with
            this sample's fields plus ``trajectory_index``, ``num_trajectories`` and ``session_id``
            (docs/context.md).
        """


LOOP_CONTRACT_KWARGS = frozenset(
    {"dataset_cls", "data_config", "tools", "hf_model_type", "gateway_manager"}
)
"""Keywords the worker passes to every loop constructor (verl 0.9's contract), beside the
registry entry's."""

_HOW = ("Register it with @register(name) in a module the worker imports, or list it in "
        "actor_rollout_ref.rollout.agent.agent_loop_config_path.")
BUILTIN_AGENT_LOOPS = Registry("agent loop", decorator="register", how=_HOW, base=AgentLoopBase,
                               where="agent_name")
"""agentloop's own loops (registered when their modules are imported)."""
AGENT_LOOPS = Registry("agent loop", decorator="register", how=_HOW, base=AgentLoopBase,
                       where="agent_name", fallback=BUILTIN_AGENT_LOOPS)
"""Every agent loop registered in code: users' registrations over the built-in ones."""
_agent_loop_registry = EntryDictView(AGENT_LOOPS)
"""verl's registry name: name -> ``{"_target_": path, "_class_": cls, **kwargs}``; writes
register."""
_builtin_registry = EntryDictView(BUILTIN_AGENT_LOOPS)

BUILTIN_LOOP_TARGETS = {
    "single_turn_agent": "agentloop.loops.single_turn.SingleTurnAgentLoop",
    "tool_agent": "agentloop.loops.tool_agent.ToolAgentLoop",
    "openai_agent": "agentloop.loops.openai_agent.OpenAIAgentLoop",
    "env_agent": "agentloop.loops.env_agent.EnvAgentLoop",
    "textarena_selfplay": "agentloop.loops.textarena_selfplay.TextArenaSelfPlayLoop",
}
"""agentloop's own loops by import path: registered by name here and imported when first resolved,
so this module never imports them (they import it); their ``@register`` then fills in the class."""


def _register_builtin_loops() -> None:
    for name, target in BUILTIN_LOOP_TARGETS.items():
        BUILTIN_AGENT_LOOPS.add(name, target)


_register_builtin_loops()


@dataclass
class ResolvedAgentLoop:
    """A registry entry with its class imported: ``name``, ``cls`` and the YAML entry's extra
    ``kwargs``.

    The worker calls ``cls.init_class`` once per worker, then builds one instance per sample as
    ``cls(*loop_args, **kwargs)`` (verl's constructor contract; :class:`LoopInstances`).
    """

    name: str
    cls: type[AgentLoopBase]
    kwargs: dict[str, Any] = field(default_factory=dict)


class LoopInstances:
    """The worker's one loop instance per sample, as ``entry.cls(*args, **{**kwargs,
    **entry.kwargs})`` builds it (verl's constructor contract).

    A class that keeps :class:`AgentLoopBase`'s constructor (and ``object.__new__``) gets a copy of
    an instance built once in the running event loop: the same attributes, with its keyword dicts
    (``apply_chat_template_kwargs``, ``mm_processor_kwargs``) copied as the constructor copies them
    (~1.1 µs a sample instead of ~2.1 µs).  A class with its own ``__init__`` is constructed every
    time.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs
        self._built: dict[int, tuple[ResolvedAgentLoop, AgentLoopBase]] = {}
        """The instance copied for each entry (by identity: a replaced entry is built afresh)."""

    def new(self, entry: ResolvedAgentLoop) -> AgentLoopBase:
        """A fresh instance of ``entry``'s class for one sample."""
        cls = entry.cls
        running = asyncio._get_running_loop()
        if (
            running is None or cls.__init__ is not AgentLoopBase.__init__
            or cls.__new__ is not object.__new__
        ):
            return self._construct(entry)
        held = self._built.get(id(entry))
        # built afresh for a replaced entry (or class) or a new batch's event loop
        if (
            held is None or held[0] is not entry or type(held[1]) is not cls
            or held[1].loop is not running
        ):
            held = self._built[id(entry)] = (entry, self._construct(entry))
        built = held[1]
        fresh = object.__new__(cls)
        state = fresh.__dict__
        state.update(built.__dict__)
        state["apply_chat_template_kwargs"] = dict(built.apply_chat_template_kwargs)
        state["mm_processor_kwargs"] = dict(built.mm_processor_kwargs)
        return fresh

    def _construct(self, entry: ResolvedAgentLoop) -> AgentLoopBase:
        return entry.cls(*self.args, **{**self.kwargs, **entry.kwargs})


def load_registry_file(path: str) -> dict[str, dict[str, Any]]:
    """Read an ``agent_loop_config_path`` YAML: a list of ``{name, _target_, **kwargs}``.

    ``_target_`` is an import path or a registered loop name (``class_name`` is accepted as its
    alias). Returns name -> ``{"_target_": ..., **kwargs}``.  Raises ConfigError naming the file and
    entry.
    """
    entries = load_yaml_entries(path, None, "agent_loop_config_path")
    out: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(entries):
        bad = f"entry {i} must have 'name' and '_target_', got {entry!r}"
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"{path}: {bad}")
        target = entry_target(entry, str(path), bad)
        kwargs = {k: v for k, v in entry.items() if k not in ("name", *TARGET_KEYS)}
        out[str(entry["name"])] = {"_target_": target, **kwargs}
    return out


def resolve_registry(agent_loop_config_path: str | None = None) -> dict[str, ResolvedAgentLoop]:
    """Import every registered loop class once; YAML entries override code registrations.

    A YAML ``_target_`` that is a registered name takes that loop's class and kwargs (the entry's
    own kwargs over them).  Raises ConfigError for an unknown name or a bad import path.
    """
    entries = {**_builtin_registry, **_agent_loop_registry}
    if agent_loop_config_path:
        entries.update(load_registry_file(agent_loop_config_path))
    resolved = {}
    for name, entry in entries.items():
        entry = dict(entry)
        target = entry.pop("_target_")
        cls = entry.pop("_class_", None)
        named = AGENT_LOOPS.find(target) if cls is None else None
        if named is not None:
            entry = {**named.kwargs, **entry}
        cls = cls or AGENT_LOOPS.resolve(target, f"agent loop {name!r} _target_")
        resolved[name] = ResolvedAgentLoop(name=name, cls=cls, kwargs=entry)
    return resolved


def lookup(registry: dict[str, ResolvedAgentLoop], agent_name: str) -> ResolvedAgentLoop:
    """Registry lookup with an error that lists what exists."""
    try:
        return registry[agent_name]
    except KeyError:
        raise UnknownAgentError(
            f"agent_name {agent_name!r} is not registered; "
            f"{did_you_mean(agent_name, list(registry))}"
            f"registered agent loops: {sorted(registry)}. {_HOW}"
        ) from None
