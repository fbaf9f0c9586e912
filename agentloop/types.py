"""Value types shared by servers, the router, agent loops and postprocessing.

Field names follow verl's ``TokenOutput``, ``AgentLoopMetrics`` and ``AgentLoopOutput`` so code
written against verl reads the same attributes here.  Two additions, both data rather than log
lines:

* ``TokenOutput.stop_reason`` keeps ``stop`` (EOS / stop token), ``length`` (``max_tokens`` reached)
  and ``aborted`` apart; verl folds the first two together.
* ``AgentLoopOutput.status`` records how the rollout ended (see :class:`RolloutStatus`) and
  ``error`` carries the message when a sample failed, so a failed sample is a row in the batch,
  never a gap.
* ``TokenOutput`` / ``TokenDelta`` carry the control signals a server pause sends the router as
  typed fields (``preempted_by_pause``, ``cut_by_update``, ``max_tokens``); the older
  ``extra_fields`` form is accepted.

:class:`MultiTrajectoryAgentLoopOutput` (the name verl's context-editing loops use) is one episode
made of several trajectories; see docs/context.md.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_M = TypeVar("_M", bound=BaseModel)

_VERL_STOP_REASONS = {"completed": "stop", "finished": "stop", "eos": "stop", "abort": "aborted",
                      "max_tokens": "length"}


def _normalise_stop_reason(value: Any) -> Any:
    """verl's server reports ``completed`` / ``aborted`` / None (unknown) and sometimes vLLM's raw
    finish reason; map them onto ours (``completed`` and None become ``stop``)."""
    if value is None:
        return StopReason.STOP
    if isinstance(value, str):
        return _VERL_STOP_REASONS.get(value, value)
    return value


CACHED_TOKENS_KEY = "num_cached_tokens"
"""The ``extra_fields`` key of the prompt tokens an engine found in its prefix cache (int; absent
when the engine does not say): vLLM's ``num_cached_tokens``, SGLang's ``cached_tokens``."""

CONTROL_KEYS = ("preempted_by_pause", "cut_by_update", "max_tokens")
"""The control signals a server's pause puts on a cut output for the router: typed fields of
:class:`TokenOutput` and :class:`TokenDelta`.  Servers written against the older protocol put them
in ``extra_fields`` under the same names; they are moved to the fields when the output is built."""


def _lift_control_keys(data: Any) -> Any:
    """Move the :data:`CONTROL_KEYS` an ``extra_fields`` dict carries onto the typed fields (an
    explicit field wins); the rest of ``extra_fields`` is kept as it is."""
    if not isinstance(data, dict):
        return data
    extra = data.get("extra_fields")
    if not isinstance(extra, dict) or extra.keys().isdisjoint(CONTROL_KEYS):
        return data
    lifted = {k: v for k, v in extra.items() if k in CONTROL_KEYS}
    rest = {k: v for k, v in extra.items() if k not in CONTROL_KEYS}
    return {**lifted, **data, "extra_fields": rest}


# BaseModel's slots written through their descriptors (what object.__setattr__ finds for
# these names, without the lookup: ~0.06 µs a write less)
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__

_Spec = tuple[dict[str, Any], tuple[tuple[str, Any], ...], frozenset[str]]
_UNCHECKED_SPECS: dict[type, _Spec] = {}


def unchecked(cls: type[_M], /, **values: Any) -> _M:
    """An instance of the model ``cls`` from ``values`` that already have its field types, built
    without validation: for agentloop's own hot paths (a server's reply from engine ids, a built-in
    loop's output from a validated :class:`TokenOutput`), where pydantic's checks cost a few µs a
    call and change nothing.  Callers pass normalised values (enum members, lists of ``int``);
    fields left out get their defaults (factories called).  The result equals, dumps, copies and
    pickles like the validated instance.  Code outside agentloop uses the constructor.

    Raises:
        TypeError: a key is not a field of ``cls``, or a required field is missing.
    """
    template, factories, required = _UNCHECKED_SPECS.get(cls) or _spec(cls)
    state = {**template, **values}
    for name, factory in factories:
        if name not in values:
            state[name] = factory()
    if len(state) != len(template) or not required <= values.keys():
        unknown = sorted(set(values) - set(template))
        missing = sorted(required - values.keys())
        raise TypeError(f"{cls.__name__}: no field(s) {unknown}; required field(s) {missing}")
    model = cls.__new__(cls)
    object.__setattr__(model, "__dict__", state)
    _set_fields_set(model, set(values))
    _set_extra(model, None)
    _set_private(model, None)
    return model


def _spec(cls: type[BaseModel]) -> _Spec:
    """Every field of ``cls`` in declaration order (dumps and reprs keep it) with its default, the
    fields with a default factory, and the required fields."""
    fields = cls.model_fields
    spec = _UNCHECKED_SPECS[cls] = (
        {name: field.default for name, field in fields.items()},
        tuple((n, f.default_factory) for n, f in fields.items() if f.default_factory),
        frozenset(name for name, field in fields.items() if field.is_required()),
    )
    return spec


def unchecked_builder(cls: type[_M], *names: str) -> Callable[..., _M]:
    """A function taking exactly ``names`` as keyword arguments that returns what
    ``unchecked(cls, **those)`` returns, for a hot path that builds one model per sample: its state
    is one dict display in field order (no keyword dict, no merge, no checks per call; ~0.95 µs
    against ~1.7 for an 11-field :class:`AgentLoopOutput`).  Fields left out get their defaults,
    factories called per instance.

    Raises:
        TypeError: a name is not a field of ``cls`` (or is given twice), or a required field is
            left out.
    """
    template, factories, required = _UNCHECKED_SPECS.get(cls) or _spec(cls)
    given = set(names)
    if len(given) != len(names) or not given <= template.keys() or not required <= given:
        raise TypeError(
            f"{cls.__name__}: fields {sorted(given - template.keys())} unknown, "
            f"{sorted(required - given)} required, or a name given twice: {names}"
        )
    scope: dict[str, Any] = {
        "_new": cls.__new__, "_cls": cls, "_set_dict": object.__setattr__,
        "_set_fields_set": _set_fields_set, "_set_extra": _set_extra,
        "_set_private": _set_private, "_names": frozenset(names),
    }
    made = dict(factories)
    cells = []
    for i, (field, default) in enumerate(template.items()):
        if field in given:
            cells.append(f"{field!r}: {field}")
        elif field in made:
            scope[f"_factory{i}"] = made[field]
            cells.append(f"{field!r}: _factory{i}()")
        else:
            scope[f"_default{i}"] = default
            cells.append(f"{field!r}: _default{i}")
    source = (
        f"def build(*, {', '.join(names)}):\n"
        "    model = _new(_cls)\n"
        f"    _set_dict(model, '__dict__', {{{', '.join(cells)}}})\n"
        "    _set_fields_set(model, set(_names))\n"
        "    _set_extra(model, None)\n"
        "    _set_private(model, None)\n"
        "    return model\n"
    )
    exec(source, scope)  # noqa: S102 - the source is built from the model's own field names
    return cast("Callable[..., _M]", scope["build"])


def replaced(model: _M, /, **changes: Any) -> _M:
    """``model.model_copy(update=changes)`` (a shallow copy with these fields replaced, counted as
    set) at a fraction of its cost, for the router's per-call copy; ``changes`` must be fields of
    the model with their types, as :func:`unchecked` takes them.

    Raises:
        TypeError: a key is not a field of the model.
    """
    state = model.__dict__
    if not changes.keys() <= state.keys():
        raise TypeError(f"{type(model).__name__}: no field(s) {sorted(changes.keys() - state)}")
    return _copy(model, {**state, **changes}, model.__pydantic_fields_set__ | changes.keys())


def with_field(model: _M, name: str, value: Any, /) -> _M:
    """``replaced(model, **{name: value})`` for one field, without the keyword dict: the router's
    per-call copy (~0.35 µs less).

    Raises:
        TypeError: ``name`` is not a field of the model.
    """
    state = model.__dict__
    if name not in state:
        raise TypeError(f"{type(model).__name__}: no field {name!r}")
    copied = state.copy()
    copied[name] = value
    fields_set = set(model.__pydantic_fields_set__)
    fields_set.add(name)
    return _copy(model, copied, fields_set)


def _copy(model: _M, state: dict[str, Any], fields_set: set[str]) -> _M:
    """A new instance of ``model``'s class with this ``__dict__`` and fields set, and ``model``'s
    extra and private values."""
    copy = type(model).__new__(type(model))
    object.__setattr__(copy, "__dict__", state)
    _set_fields_set(copy, fields_set)
    _set_extra(copy, model.__pydantic_extra__)
    _set_private(copy, model.__pydantic_private__)
    return copy


_PLAIN_ASSIGNMENT: dict[type, bool] = {}


def assign_field(model: BaseModel, name: str, value: Any) -> None:
    """``setattr(model, name, value)`` for a field of ``model``: for a model whose class keeps
    pydantic's ``__setattr__`` and neither validates assignments nor is frozen, what that
    ``__setattr__`` does for a plain field (the value into ``__dict__``, the name into the fields
    set) without its dispatch, for per-sample hot paths; else ``setattr``."""
    cls = type(model)
    plain = _PLAIN_ASSIGNMENT.get(cls)
    if plain is None:
        config = cls.model_config
        plain = _PLAIN_ASSIGNMENT[cls] = (
            cls.__setattr__ is BaseModel.__setattr__
            and not config.get("validate_assignment") and not config.get("frozen")
        )
    state = model.__dict__
    if plain and name in state:
        state[name] = value
        model.__pydantic_fields_set__.add(name)
    else:
        setattr(model, name, value)


class StopReason(str, Enum):
    """Why the engine stopped one generation call."""

    STOP = "stop"  # EOS or a stop token / string was produced
    LENGTH = "length"  # max_tokens (or the context window) was reached
    ABORTED = "aborted"  # the request was aborted (abort(), sleep, shutdown)


class RolloutStatus(str, Enum):
    """How a whole rollout (one trajectory) ended."""

    STOP = "stop"  # the policy finished on its own
    LENGTH = "length"  # the response budget ran out
    MAX_TURNS = "max_turns"  # a turn limit was hit
    TOOL_ERROR = "tool_error"  # a tool failed and the loop could not continue
    PARSE_ERROR = "parse_error"  # the policy emitted a malformed tool call
    ABORTED = "aborted"  # the engine aborted the request
    TIMEOUT = "timeout"  # a per-sample or per-call timeout fired
    ERROR = "error"  # an exception escaped the agent loop (server failure, bug)


class TokenOutput(BaseModel):
    """Result of one token-in/token-out generation call."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    """Sampled token ids, exactly as the engine produced them."""
    log_probs: list[float] | None = None
    """Log-probability of each sampled token, when requested."""
    routed_experts: Any | None = None
    """MoE routing (verl's field), with ``rollout.enable_rollout_routing_replay``: the experts
    each token was routed to, [n, num_layers, top_k], for positions ``routed_experts_start ..
    routed_experts_start + n`` of ``prompt_ids + token_ids`` (docs/porting-from-verl.md)."""
    routed_experts_start: int = 0
    """The position of ``routed_experts``' first row (the request's
    ``routed_experts_prompt_start``)."""
    stop_reason: StopReason = StopReason.STOP
    """Why generation stopped: ``stop``, ``length`` or ``aborted``."""
    stop_sequence: str | None = None
    """The request's stop string that ended the generation (vLLM; None otherwise and for other
    engines)."""
    num_preempted: int = 0
    """How many times the engine preempted this request (-1 when unknown; verl's None becomes
    -1)."""
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific extras (e.g. ``server_index``, ``global_steps``, ``weight_versions``)."""
    preempted_by_pause: bool = False
    """Control signal: a server :meth:`~agentloop.servers.base.LLMServer.pause` (not the caller)
    aborted this generation; the router may resume it (``partial_rollout``)."""
    cut_by_update: bool = False
    """Control signal: the pause that cut it was a weight update's
    (``server.weight_update: abort``); the router resumes it whatever ``partial_rollout`` says."""
    max_tokens: int | None = None
    """Control signal, with ``preempted_by_pause``: the ``max_tokens`` the cut generation ran
    under."""

    @model_validator(mode="before")
    @classmethod
    def _control_keys(cls, data: Any) -> Any:
        return _lift_control_keys(data)

    @field_validator("stop_reason", mode="before")
    @classmethod
    def _stop_reason(cls, value: Any) -> Any:
        return _normalise_stop_reason(value)

    @field_validator("num_preempted", mode="before")
    @classmethod
    def _num_preempted(cls, value: Any) -> Any:
        return -1 if value is None else value


class TokenDelta(BaseModel):
    """One chunk of a streamed generation: the ids sampled since the previous chunk."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    """Ids sampled since the previous chunk (may be empty on the final chunk)."""
    log_probs: list[float] | None = None
    """Their log-probabilities, when requested."""
    finished: bool = False
    """True on the last chunk."""
    stop_reason: StopReason | None = None
    """Set on the last chunk: ``stop``, ``length`` or ``aborted``."""
    stop_sequence: str | None = None
    """On the last chunk: see :attr:`TokenOutput.stop_sequence`."""
    routed_experts: Any | None = None
    """On the last chunk, with routing replay: the whole generation's, see
    :attr:`TokenOutput.routed_experts`."""
    routed_experts_start: int = 0
    """On the last chunk: see :attr:`TokenOutput.routed_experts_start`."""
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    """Backend extras on the last chunk (e.g. ``server_index``)."""
    preempted_by_pause: bool = False
    """Control signal on the last chunk: see :attr:`TokenOutput.preempted_by_pause`."""
    cut_by_update: bool = False
    """Control signal on the last chunk: see :attr:`TokenOutput.cut_by_update`."""
    max_tokens: int | None = None
    """Control signal on the last chunk: see :attr:`TokenOutput.max_tokens`."""

    @model_validator(mode="before")
    @classmethod
    def _control_keys(cls, data: Any) -> Any:
        return _lift_control_keys(data)


class AgentLoopMetrics(BaseModel):
    """Per-sample timings; aggregated by the manager into ``meta_info['timing']``."""

    generate_sequences: float = 0.0
    """Seconds spent waiting for the engine."""
    tool_calls: float = 0.0
    """Seconds spent in tools."""
    compute_score: float = 0.0
    """Seconds spent computing the reward (verl 0.9 field)."""
    num_preempted: int = -1
    """Total preemptions over all turns (-1 when the engine does not report it)."""

    @field_validator("num_preempted", mode="before")
    @classmethod
    def _num_preempted(cls, value: Any) -> Any:
        return -1 if value is None else value


class AgentLoopOutput(BaseModel):
    """One trajectory produced by an agent loop, before padding."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    """Token ids of the prompt (chat template applied)."""
    response_ids: list[int]
    """Token ids after the prompt: sampled tokens and any tool / user turns, in order."""
    response_mask: list[int]
    """1 where the policy sampled the token, 0 for tool / user / template tokens."""
    response_logprobs: list[float] | None = None
    """Log-probabilities aligned with ``response_ids`` (0.0 on masked-out tokens)."""
    response_weight_versions: list[int] | None = None
    """The weight version (``global_steps``) that sampled each token of ``response_ids`` (-1 on
    tokens the policy did not sample); the built-in loops fill it from the router's per-token
    ``weight_versions``, which it reports with ``async_training.partial_rollout`` (a generation a
    pause cut may span versions)."""
    routed_experts: Any | None = None
    """MoE routing (verl's field): row ``i`` the experts token ``i`` of ``prompt_ids +
    response_ids`` was routed to, [n, num_layers, top_k]; rows past ``n`` are filled when padded
    (docs/porting-from-verl.md#routing-replay-r3)."""
    multi_modal_data: dict[str, Any] | None = None
    """Images / videos seen by the trajectory, for multimodal trainers."""
    reward_score: float | None = None
    """Reward computed inside the loop (e.g. by a tool); lands in ``rm_scores``."""
    num_turns: int = 0
    """User + assistant + tool turns, counting the prompt as one (verl's convention)."""
    metrics: AgentLoopMetrics = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    """Anything else; each key becomes an object column of ``non_tensor_batch``."""
    status: RolloutStatus = RolloutStatus.STOP
    """How the rollout ended."""
    error: str | None = None
    """Error message when ``status`` is ``error`` / ``timeout`` / ``tool_error``."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Processor kwargs the multimodal inputs were rendered with (verl 0.9 field; kept for the
    trainer)."""
    mm_processor_output: list[dict[str, Any]] | None = None
    """Pre-computed processor features for SGLang video input (verl 0.9 field; unused by vLLM)."""

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics(cls, value: Any) -> Any:
        """verl loops pass a plain dict of timings (``simple_timer``), possibly with extra keys."""
        if isinstance(value, dict):
            known = AgentLoopMetrics.model_fields
            return AgentLoopMetrics(**{k: v for k, v in value.items() if k in known})
        return value

    @field_validator("multi_modal_data", mode="before")
    @classmethod
    def _multi_modal_data(cls, value: Any) -> Any:
        return value or None


RewardTo = Literal["all", "last", "discounted"]
"""Which trajectories of an episode get the episode's reward (``multi_turn.reward_to``;
docs/context.md)."""


class MultiTrajectoryAgentLoopOutput(BaseModel):
    """One episode (sample) made of several trajectories, e.g. the snapshots a context edit closed,
    in order.

    A loop may return this wherever it may return a ``list[AgentLoopOutput]``; the worker treats
    both the same: one row per trajectory, each keeping the sample's non-tensor fields (``uid``,
    ``index``...) and getting ``trajectory_index`` (0..k-1, the order here), ``num_trajectories``
    (k) and ``session_id`` (the episode's id).  The last trajectory is the final one: it is the one
    a ``custom_reward_function`` scores, and ``multi_turn.reward_to`` decides which trajectories get
    that episode reward (docs/context.md).

    Extra keyword fields (e.g. the ``contextpilot_*`` fields of verl forks) are accepted and
    ignored.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="allow")

    trajectories: list[AgentLoopOutput]
    """The episode's trajectories in order; the last one is the final trajectory.  Must not be
    empty."""
    session_id: str | None = None
    """The episode's id in the ``session_id`` column (e.g. a gateway session); None: the worker
    makes one."""
    reward_to: RewardTo | None = None
    """This episode's reward rule, overriding ``multi_turn.reward_to`` (None: the config's)."""
    reward_gamma: float | None = None
    """The discount for ``reward_to="discounted"``, overriding ``multi_turn.reward_gamma`` (None:
    the config's)."""

    @field_validator("trajectories")
    @classmethod
    def _not_empty(cls, value: list[AgentLoopOutput]) -> list[AgentLoopOutput]:
        if not value:
            raise ValueError(
                "MultiTrajectoryAgentLoopOutput needs at least one trajectory (the final one)"
            )
        return value

    @field_validator("reward_gamma")
    @classmethod
    def _gamma(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"reward_gamma must be in [0, 1], got {value}")
        return value
