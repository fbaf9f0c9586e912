"""Typed, frozen config sections, built once from the merged trainer-shaped config.

Each section names the YAML key of every field (``SECTION`` + field name, or ``key(...)`` metadata)
and has no default of its own: :func:`agentloop.config.resolve_config` builds them from the merged
config, whose defaults come from ``agentloop/configs/rollout.yaml`` only.
``Section.from_root(root)`` builds one from any trainer-shaped config (absent keys take the YAML's
value), ``Section.from_rollout(rollout)`` from the ``actor_rollout_ref.rollout`` subtree alone.  A
section rejects a mistyped or unknown value, at build time or when constructed directly, with the
start-up check's one-line ConfigError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from omegaconf import OmegaConf

from agentloop.config.build import build_section, check_fields, read_value
from agentloop.config.checks import (
    check_balancer_mode,
    check_context_window,
    check_engine_name,
    check_env_max_turns,
    check_env_step_timeout,
    check_gateway_reward_to,
    check_max_context_edits,
    check_prompt_truncation,
    check_result_channel,
    check_reward_block,
    check_reward_gamma,
    check_reward_to,
    check_routing_mode,
    check_tool_executor,
    check_tool_max_workers,
)
from agentloop.errors import ConfigError

_R = "actor_rollout_ref.rollout"
_S = f"{_R}.server"
_A = f"{_R}.agent"
_T = TypeVar("_T", bound="Section")


def key(path: str) -> Any:
    """A field read from the full config key ``path`` instead of ``SECTION.<field name>``."""
    return field(metadata={"key": path})


class Section:
    """Base of every section dataclass: where it lives (``SECTION``) and how to build one."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_root(cls: type[_T], root: Any) -> _T:
        """Build from a trainer-shaped config (DictConfig or mapping); absent keys take the YAML's
        value.

        Raises:
            ConfigError: a value is mistyped or out of range (the start-up check's one-line
            message).
        """
        return build_section(cls, root)  # type: ignore[no-any-return]

    @classmethod
    def from_rollout(cls: type[_T], rollout: Any) -> _T:
        """Build from the ``actor_rollout_ref.rollout`` subtree alone (other sections: the YAML's
        values)."""
        return cls.from_root(
            {"actor_rollout_ref": {"rollout": rollout if rollout is not None else {}}}
        )


@dataclass(frozen=True)
class ModelConfig(Section):
    """``actor_rollout_ref.model``: the checkpoint and its tokenizer."""

    SECTION: ClassVar[str] = "actor_rollout_ref.model"
    path: str
    tokenizer_path: str | None
    trust_remote_code: bool
    custom_chat_template: str | None

    @property
    def local_path(self) -> str:
        """``path`` with ``~`` expanded."""
        return os.path.expanduser(self.path)

    @property
    def local_tokenizer_path(self) -> str | None:
        """``tokenizer_path`` with ``~`` expanded (None when unset)."""
        return os.path.expanduser(self.tokenizer_path) if self.tokenizer_path else None


@dataclass(frozen=True)
class EngineConfig(Section):
    """The engine keys of ``actor_rollout_ref.rollout`` (what a server passes to vLLM / SGLang)."""

    SECTION: ClassVar[str] = _R
    name: str
    prompt_length: int
    response_length: int
    dtype: str
    gpu_memory_utilization: float
    enforce_eager: bool
    cudagraph_capture_sizes: tuple[int, ...] | None
    free_cache_engine: bool
    tensor_model_parallel_size: int
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    disable_log_stats: bool
    seed: int
    scheduling_policy: str
    load_format: str
    logprobs_mode: str
    normal_priority: bool
    gc_freeze: bool
    gc_threshold: int | None
    enable_rollout_routing_replay: bool
    """Routing replay (R3): the servers return the experts each token was routed to (MoE models
    only; docs/porting-from-verl.md#routing-replay-r3)."""
    engine_kwargs: dict[str, Any]
    """``{"vllm": {...}, "sglang": {...}}``: extra engine arguments per backend (values may be
    None)."""

    PRECHECKS: ClassVar[dict[str, Callable[[Any], None]]] = {"name": check_engine_name}

    @property
    def context_length(self) -> int:
        """``max_model_len``, or ``prompt_length + response_length`` when it is null."""
        return self.max_model_len or self.prompt_length + self.response_length

    def backend_kwargs(self) -> dict[str, Any]:
        """``engine_kwargs.<name>`` of the selected backend as a dict (empty when null)."""
        return dict(self.engine_kwargs.get(self.name) or {})


@dataclass(frozen=True)
class SamplingConfig(Section):
    """verl's per-batch sampling keys (``cfg.sampling``; ``cfg.val_sampling`` reads
    ``val_kwargs.*``)."""

    SECTION: ClassVar[str] = _R
    temperature: float
    top_k: int
    top_p: float
    do_sample: bool
    n: int
    repetition_penalty: float
    ignore_eos: bool
    calculate_log_probs: bool

    VAL_KEYS: ClassVar[dict[str, str]] = {k: f"{_R}.val_kwargs.{k}" for k in
                                           ("temperature", "top_k", "top_p", "do_sample", "n")}
    """Field -> key for validation sampling (the others stay on the rollout section, as in verl)."""

    @classmethod
    def validation_from_root(cls, root: Any) -> SamplingConfig:
        """The validation sampling (``val_kwargs`` replace the sampling keys) of a trainer-shaped
        config."""
        return build_section(cls, root, cls.VAL_KEYS)  # type: ignore[no-any-return]

    def params(self) -> dict[str, Any]:
        """The engine's sampling params (``do_sample: false`` means temperature 0)."""
        params: dict[str, Any] = {
            "temperature": self.temperature if self.do_sample else 0.0,
            "top_p": self.top_p, "top_k": self.top_k, "repetition_penalty": self.repetition_penalty,
            "logprobs": self.calculate_log_probs,
        }
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params


def weight_update_mode(value: str | None, partial_rollout: bool | None) -> str:
    """``rollout.server.weight_update``; null means ``abort``, or ``drain`` where
    ``async_training.partial_rollout`` is false (verl's sync then waits for running requests)."""
    if value is not None:
        return value
    return "drain" if partial_rollout is False else "abort"


@dataclass(frozen=True)
class ServerConfig(Section):
    """``actor_rollout_ref.rollout.server``: server placement, supervision and weight updates."""

    SECTION: ClassVar[str] = _S
    num_servers: int | None
    num_cpus_per_server: float
    placement_strategy: str
    device: str
    max_cache_size: int
    balancer: str
    """``shared`` (one GlobalBalancer actor) | ``local`` (each worker's router on its own)."""
    routing: str
    """``sticky`` (verl's sticky least-in-flight) | ``prefix`` (KV-cache-aware prefix affinity)."""
    batch_calls: bool
    max_failovers: int | None
    restart_dead: bool
    weight_update_timeout: float | None
    stall_timeout: float | None
    priority: str | None
    weight_update: str
    """Resolved: ``abort`` | ``drain`` | ``keep`` (see :func:`weight_update_mode`)."""

    PRECHECKS: ClassVar[dict[str, Callable[[Any], None]]] = {
        "balancer": check_balancer_mode, "routing": check_routing_mode,
    }

    @classmethod
    def from_root(cls, root: Any) -> ServerConfig:
        """See :meth:`Section.from_root`; a null ``weight_update`` is resolved with
        :func:`weight_update_mode`."""
        partial = read_value(root, "async_training.partial_rollout")
        return build_section(cls, root, adjust=lambda v: {  # type: ignore[no-any-return]
            **v, "weight_update": weight_update_mode(v["weight_update"], partial)})


@dataclass(frozen=True)
class RouterConfig(Section):
    """What every router (worker or gateway) is built with:
    :func:`agentloop.routing.factory.build_router`."""

    max_cache_size: int = key(f"{_S}.max_cache_size")
    batch_calls: bool = key(f"{_S}.batch_calls")
    max_failovers: int | None = key(f"{_S}.max_failovers")
    routing: str = key(f"{_S}.routing")
    """``sticky`` | ``prefix`` (:func:`agentloop.routing.prefix_affinity.build_balancer`)."""
    priority: str | None = key(f"{_S}.priority")
    """The policy name (``null`` | ``fcfs`` | ``context``); ``make_priority`` turns it into a
    policy."""
    partial_rollout: bool = key("async_training.partial_rollout")
    """True only when ``async_training.partial_rollout`` is true (null reads as false)."""
    restart_preempted: bool = key(f"{_A}.restart_preempted")

    @classmethod
    def from_root(cls, root: Any) -> RouterConfig:
        """See :meth:`Section.from_root`; a null ``async_training.partial_rollout`` reads as
        false."""
        return build_section(
            cls,
            root,
            adjust=lambda v: {  # type: ignore[no-any-return]
                **v,
                "partial_rollout": v["partial_rollout"]
                if v["partial_rollout"] is not None
                else False,
            },
        )


@dataclass(frozen=True)
class AgentConfig(Section):
    """``actor_rollout_ref.rollout.agent``: workers, loops, per-sample and per-batch limits."""

    SECTION: ClassVar[str] = _A
    num_workers: int
    default_agent_loop: str
    agent_loop_config_path: str | None
    prompt_truncation: str
    sample_timeout: float | None
    batch_timeout: float | None
    max_sample_retries: int
    stall_timeout: float | None
    record_timing: bool | None
    restart_preempted: bool
    strict_config: bool | None
    max_failure_fraction: float | None
    result_channel: str

    PRECHECKS: ClassVar[dict[str, Callable[[Any], None]]] = {
        "prompt_truncation": check_prompt_truncation, "result_channel": check_result_channel,
    }


@dataclass(frozen=True)
class MultiTurnConfig(Section):
    """``actor_rollout_ref.rollout.multi_turn``: turn limits, tools, context window, reward
    spreading."""

    SECTION: ClassVar[str] = f"{_R}.multi_turn"
    max_assistant_turns: int | None
    max_user_turns: int | None
    max_parallel_calls: int
    max_tool_response_length: int
    tool_response_truncate_side: str
    format: str
    tool_config_path: str | None
    interaction_config_path: str | None
    function_tool_path: str | None
    tool_timeout: float | None
    tool_executor: str
    tool_max_workers: int
    return_messages: bool
    context_window: int | None
    max_context_edits: int | None
    reward_to: str | None
    """all | last | discounted (null: all; :class:`agentloop.rewards.EpisodeRewardConfig` applies
    it)."""
    reward_gamma: float | None

    PRECHECKS: ClassVar[dict[str, Callable[[Any], None]]] = {
        "tool_executor": check_tool_executor, "tool_max_workers": check_tool_max_workers,
        "context_window": check_context_window, "max_context_edits": check_max_context_edits,
        "reward_to": check_reward_to, "reward_gamma": check_reward_gamma,
    }
    """The components' own messages (tool executor, context window, episode reward) for direct
    builds; ``resolve_config``'s start-up check reports the same values first, in its one-line form.
    """


@dataclass(frozen=True)
class EnvConfig(Section):
    """``actor_rollout_ref.rollout.env``: the ``env_agent`` loop's environments
    (docs/environments.md)."""

    SECTION: ClassVar[str] = f"{_R}.env"
    default: str | None
    """The environment of a sample that names none: a registered name or an import path."""
    config_path: str | None
    """A YAML list of ``{name, _target_, **config}`` entries: environments by name."""
    max_turns: int | None
    step_timeout: float | None

    PRECHECKS: ClassVar[dict[str, Callable[[Any], None]]] = {
        "max_turns": check_env_max_turns, "step_timeout": check_env_step_timeout,
    }


@dataclass(frozen=True)
class GatewayConfig(Section):
    """``actor_rollout_ref.rollout.gateway``: the OpenAI-compatible gateway actors."""

    SECTION: ClassVar[str] = f"{_R}.gateway"
    num_gateways: int
    host: str
    max_body_bytes: int
    max_image_bytes: int
    reasoning_parser: str | None
    """A registered :class:`~agentloop.parsers.reasoning.ReasoningParser` name (null: no
    reasoning split)."""
    session_timeout: float | None
    max_concurrent_sessions: int
    trajectories: str
    reward_to: str | None
    """null (follow ``multi_turn.reward_to``) | all | last | discounted | longest."""

    PRECHECKS: ClassVar[dict[str, Callable[[Any], None]]] = {"reward_to": check_gateway_reward_to}
    OVERRIDABLE: ClassVar[tuple[str, ...]] = ("session_timeout", "trajectories", "reward_to")
    """Keys an ``openai_agent`` loop entry may override (its kwargs)."""


@dataclass(frozen=True)
class TraceConfig(Section):
    """``actor_rollout_ref.rollout.trace``: rollout traces (verl's keys)."""

    SECTION: ClassVar[str] = f"{_R}.trace"
    backend: str | None
    token2text: bool
    max_samples_per_step_per_worker: int | None
    project_name: str | None
    experiment_name: str | None


@dataclass(frozen=True)
class AsyncConfig(Section):
    """``async_training`` (verl's fully-async trainer section): the keys agentloop reads."""

    SECTION: ClassVar[str] = "async_training"
    partial_rollout: bool | None


@dataclass(frozen=True)
class DataConfig(Section):
    """``data``: the dataset keys ``agentloop rollout`` and the loops read."""

    SECTION: ClassVar[str] = "data"
    train_files: Any
    """A path or a list of paths (null: none)."""
    val_files: Any
    prompt_key: str
    image_key: str | None
    video_key: str | None
    max_prompt_length: int
    max_response_length: int
    train_batch_size: int
    max_samples: int
    apply_chat_template_kwargs: dict[str, Any] | None
    """Extra keyword arguments for the chat template (null: none)."""
    mm_processor_kwargs: dict[str, Any] | None
    """verl's processor arguments, passed to verl-style loops (agentloop's data loading ignores
    them)."""


_REWARD = "custom_reward_function"


def _reward_default(name: str) -> Any:
    """The YAML's default of ``custom_reward_function.<name>`` (for constructing a RewardConfig
    by hand)."""
    return lambda: read_value(None, f"{_REWARD}.{name}")


@dataclass(frozen=True)
class RewardConfig:
    """``custom_reward_function`` (top level, verl's; verl 0.9's ``reward.custom_reward_function``
    when the top-level one has no path).  Fields left out when constructing one by hand take the
    YAML's defaults.

    Raises:
        ConfigError: a key has the wrong type (one line naming it).
    """

    SECTION: ClassVar[str] = _REWARD
    path: str | None = field(default_factory=_reward_default("path"))
    """A ``.py`` file or a module name; None: no custom reward function."""
    name: str = field(default_factory=_reward_default("name"))
    reward_kwargs: dict[str, Any] = field(default_factory=_reward_default("reward_kwargs"))
    timeout: float | None = field(default_factory=_reward_default("timeout"))
    """Seconds per call; None: no limit (0 in the config reads as None)."""
    add_tool_rewards: bool = field(default_factory=_reward_default("add_tool_rewards"))

    def __post_init__(self) -> None:
        check_reward_block(
            {
                "path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs,
                "timeout": self.timeout, "add_tool_rewards": self.add_tool_rewards,
            }
        )

    @classmethod
    def from_root(cls, root: Any) -> RewardConfig:
        """Read the block from a trainer-shaped config (top level first, then verl 0.9's
        ``reward.``).

        Raises:
            ConfigError: a key has the wrong type.
        """
        block = _plain_block(root, (_REWARD,)) or {}
        if not isinstance(block, dict):
            raise ConfigError(
                f"{_REWARD} must be a mapping with path / name / timeout keys, got {block!r}"
            )
        nested = _plain_block(root, ("reward", _REWARD))
        if not block.get("path") and isinstance(nested, dict) and nested.get("path"):
            block = {
                **nested,
                **{k: block[k] for k in ("timeout", "add_tool_rewards") if k in block},
            }
        full = {k: block[k] if k in block else read_value(None, f"{_REWARD}.{k}")
                for k in ("path", "name", "reward_kwargs", "timeout", "add_tool_rewards")}
        full["name"] = full["name"] or read_value(None, f"{_REWARD}.name")
        full["reward_kwargs"] = full["reward_kwargs"] or {}
        check_reward_block(full)
        return cls(
            path=full["path"] or None, name=full["name"], reward_kwargs=dict(full["reward_kwargs"]),
            timeout=float(full["timeout"]) if full["timeout"] else None,
            add_tool_rewards=full["add_tool_rewards"],
        )

    from_config = from_root
    """The name :class:`agentloop.rewards.RewardFunctionConfig` users know."""


def _plain_block(root: Any, path: tuple[str, ...]) -> Any:
    """The plain value at ``path`` of a config or mapping (None where a part is missing)."""
    node = root
    for part in path:
        if node is None or not hasattr(node, "get"):
            return None
        node = node.get(part)
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
