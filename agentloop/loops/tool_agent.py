"""ToolAgentLoop: multi-turn generation with tool calls, registered as ``tool_agent``.

Generate, parse tool calls, run the tools (:mod:`agentloop.loops.tool_calls`), append the tool turn
exactly as the chat template renders it, and repeat until the model stops, a turn cap
(``multi_turn.max_assistant_turns`` / ``max_user_turns``) or the ``response_length`` budget; an
interaction (``multi_turn.interaction_config_path``) can reply instead of ending.  ``run`` returns
an :class:`AgentLoopOutput` whose ``status`` says why it ended, or a
:class:`MultiTrajectoryAgentLoopOutput` when the context was edited
(:mod:`agentloop.loops.context`). Tool failures, parse errors and budget cuts are counted in
``extra_fields``, never raised.

Spec (budgets, stop precedence, interactions, counters, images, context edits):
docs/tools.md#the-tool_agent-loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar
from uuid import uuid4

from omegaconf import DictConfig

from agentloop.batch.multimodal import decode_images, encode_images, sample_media
from agentloop.batch.routed_experts import RoutedExpertsTrace
from agentloop.config import MultiTurnConfig
from agentloop.errors import ConfigError
from agentloop.interactions.base import BaseInteraction
from agentloop.interactions.registry import initialize_interactions_from_config
from agentloop.loops.base import AgentLoopBase, config_values, register, trainer_config_of
from agentloop.loops.context import TEMPLATE, ContextSettings, Snapshots, edited_history
from agentloop.loops.prompt import apply_chat_template, as_messages, fit_prompt
from agentloop.loops.tool_calls import ToolRunner, ToolTurnResult, assistant_message
from agentloop.parsers.base import ToolParser, get_tool_parser
from agentloop.rewards.loader import RewardFunctionConfig
from agentloop.tokenization import encode_new_turns
from agentloop.tokenization.incremental import TemplateMismatchError
from agentloop.tools import registry as tool_registry
from agentloop.tools.base import BaseTool
from agentloop.tools.context_tools import ContextEdit, tool_turn
from agentloop.tools.executor import configure_tool_executor
from agentloop.trace import span as trace_span
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    MultiTrajectoryAgentLoopOutput,
    RolloutStatus,
    StopReason,
    unchecked,
)
from agentloop.utils.ids import fresh_hex


class AgentState(str, Enum):
    """States of the loop (verl's names)."""

    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class AgentData:
    """Everything one rollout accumulates."""

    messages: list[dict[str, Any]]
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    """Per response token: the weight version that sampled it (-1: not sampled, or not reported)."""
    routing: RoutedExpertsTrace = field(default_factory=RoutedExpertsTrace)
    """Routing replay: the experts each token ran through, by position (batch/routed_experts.py)."""
    assistant_turns: int = 0
    user_turns: int = 0
    status: RolloutStatus = RolloutStatus.STOP
    pending_calls: list[Any] = field(default_factory=list)
    image_data: list[Any] = field(default_factory=list)
    video_data: list[Any] | None = None
    counters: dict[str, Any] = field(default_factory=lambda: _new_counters())
    metrics: AgentLoopMetrics = field(default_factory=AgentLoopMetrics)
    interaction: BaseInteraction | None = None
    interaction_id: str | None = None
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    reward_score: float | None = None
    snapshots: Snapshots = field(default_factory=Snapshots)
    segment_start: int = 0
    """user_turns + assistant_turns when the current trajectory started (its ``num_turns`` counts
    from there)."""


def _new_counters() -> dict[str, Any]:
    """The per-trajectory counters of ``extra_fields``, at zero."""
    return {
        "tool_rewards": [], "turn_scores": [], "num_tool_calls": 0, "num_tool_errors": 0,
        "num_parse_errors": 0, "num_dropped_calls": 0, "num_tool_timeouts": 0,
        "num_budget_truncations": 0, "min_global_steps": None, "max_global_steps": None,
    }


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Generate → parse tool calls → run tools → generate …, until a stop condition."""

    tools: ClassVar[dict[str, BaseTool]] = {}
    tool_schemas: ClassVar[list[dict[str, Any]] | None] = None
    tool_parser: ClassVar[ToolParser | None] = None
    runner: ClassVar[ToolRunner | None] = None
    interactions: ClassVar[dict[str, BaseInteraction]] = {}
    interaction_config_path: ClassVar[str | None] = None
    reward_function_set: ClassVar[bool] = False

    init_class_takes_tools: ClassVar[bool] = True

    @classmethod
    def init_class(
        cls, config: Any, tokenizer: Any, processor: Any | None = None, **kwargs: Any
    ) -> None:
        """Load tools (or take the worker's, ``tools=ToolListWrap``) and the parser once per
        worker."""
        mt = MultiTurnConfig.from_root(trainer_config_of(config))  # checked here, once per worker
        given = kwargs.get("tools")
        if given is not None:
            tool_list = list(given.tools)
        else:
            tool_list = tool_registry.load_all_tools(tool_config_path=mt.tool_config_path,
                                                     function_tool_path=mt.function_tool_path)
        cls.tools = {t.name: t for t in tool_list}
        # Only the keys the schema was given (verl's rule), so the prompt shows the tool as written.
        cls.tool_schemas = [
            t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tool_list
        ] or None
        cls.tool_parser = get_tool_parser(mt.format, tokenizer)
        path = mt.interaction_config_path
        cls.interactions = initialize_interactions_from_config(path) if path else {}
        cls.interaction_config_path = str(path) if path else None
        # verl's tool_agent leaves the reward to custom_reward_function; the interaction's score is
        # ours, for runs without one (a loop's own reward_score would win over the function:
        # agentloop.rewards.scoring)
        cls.reward_function_set = RewardFunctionConfig.from_config(config).path is not None
        configure_tool_executor(mt.tool_executor, mt.tool_max_workers)
        cls.runner = ToolRunner(
            tools=cls.tools, max_parallel_calls=mt.max_parallel_calls,
            max_response_length=mt.max_tool_response_length,
            truncate_side=mt.tool_response_truncate_side, timeout=mt.tool_timeout or None,
        )
        cls._class_initialized = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        values = config_values(self.rollout_config, "tool_agent", _tool_agent_values)
        self.max_assistant_turns: int | None = values["max_assistant_turns"]
        self.max_user_turns: int | None = values["max_user_turns"]
        self.return_messages: bool = values["return_messages"]
        self.context: ContextSettings = values["context"]
        self.request_id = fresh_hex()

    async def run(
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> AgentLoopOutput | MultiTrajectoryAgentLoopOutput:
        data = AgentData(
            messages=as_messages(kwargs["raw_prompt"]),
            image_data=self._decoded(sample_media(kwargs)),
            video_data=sample_media(kwargs, "video") or None,
        )
        tools_kwargs = kwargs.get("tools_kwargs") or {}
        self.sampling_params = dict(sampling_params)
        await self._start_interaction(data, kwargs.get("extra_info"))
        state = AgentState.PENDING
        try:
            # 1. pending → 2. generating → (3. processing tools | 4. interacting) → 2. …
            # → terminated
            while state != AgentState.TERMINATED:
                if state == AgentState.PENDING:
                    state = self._pending(data)
                elif state == AgentState.GENERATING:
                    state = await self._generating(data)
                elif state == AgentState.PROCESSING_TOOLS:
                    state = await self._processing_tools(data, tools_kwargs)
                else:
                    state = await self._interacting(data)
            if data.interaction is not None:
                score = await data.interaction.calculate_score(data.interaction_id)  # type: ignore[arg-type]
                # the function scores the trajectory, as in verl; the score is kept
                if self.reward_function_set:
                    data.counters["interaction_score"] = score
                else:
                    data.reward_score = score
        finally:
            if data.interaction is not None:
                await data.interaction.finalize_interaction(data.interaction_id)  # type: ignore[arg-type]
        return data.snapshots.finish(self._output(data))

    async def _start_interaction(self, data: AgentData, extra_info: Any) -> None:
        kwargs = (
            dict((extra_info or {}).get("interaction_kwargs") or {})
            if isinstance(extra_info, dict)
            else {}
        )
        # verl: interactions only when the config names them
        if not kwargs or not self.interaction_config_path:
            return
        name = kwargs.get("name", "interaction_agent")
        if name not in self.interactions:
            raise ConfigError(
                f"sample asks for interaction {name!r}; loaded interactions: "
                f"{sorted(self.interactions)} "
                "(actor_rollout_ref.rollout.multi_turn.interaction_config_path)"
            )
        data.interaction, data.interaction_kwargs = self.interactions[name], kwargs
        data.interaction_id = await data.interaction.start_interaction(uuid4().hex, **kwargs)

    def _render_prompt(self, messages: list[dict[str, Any]], images: list[Any]) -> list[int]:
        ids = apply_chat_template(
            self.tokenizer, messages, tools=self.tool_schemas, add_generation_prompt=True,
            **self.apply_chat_template_kwargs,
        )
        return encode_images(self.processor, ids, images) if self.processor is not None else ids

    def _decoded(self, images: list[Any], where: str = "sample image") -> list[Any]:
        """RGB PIL images when the model has a processor (else as given: the engine decides)."""
        return decode_images(images, where) if self.processor is not None and images else images

    def _pending(self, data: AgentData) -> AgentState:
        data.prompt_ids, dropped = fit_prompt(
            self._render_prompt(data.messages, data.image_data), self.prompt_length,
            self.prompt_truncation,
        )
        data.counters["prompt_truncated"] = dropped
        return AgentState.GENERATING

    async def _generating(self, data: AgentData) -> AgentState:
        budget = self.response_length - len(data.response_mask)
        start, prompt = time.perf_counter(), data.prompt_ids + data.response_ids
        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=prompt,
            sampling_params={**self.sampling_params, "max_tokens": budget,
                             **data.routing.request(prompt)},
            image_data=list(data.image_data) or None,
            **({"video_data": data.video_data} if data.video_data else {}),
        )
        data.metrics.generate_sequences += time.perf_counter() - start
        _track_versions(data.counters, out.extra_fields)
        data.routing.add(prompt, out)
        data.response_ids += out.token_ids
        data.response_mask += [1] * len(out.token_ids)
        data.response_logprobs += (
            out.log_probs if out.log_probs is not None else [0.0] * len(out.token_ids)
        )
        # per token, with async_training.partial_rollout
        versions = out.extra_fields.get("weight_versions")
        data.weight_versions += versions if versions is not None else [-1] * len(out.token_ids)
        # resumes of this generation after server pauses
        if out.num_preempted and out.num_preempted > 0:
            data.metrics.num_preempted = max(data.metrics.num_preempted, 0) + out.num_preempted
        data.assistant_turns += 1
        if out.stop_reason == StopReason.ABORTED:
            return self._end(data, RolloutStatus.ABORTED)
        if out.stop_reason == StopReason.LENGTH or len(data.response_mask) >= self.response_length:
            return self._end(data, RolloutStatus.LENGTH)
        content, calls = await self.tool_parser.extract_tool_calls(out.token_ids, self.tool_schemas)  # type: ignore[union-attr]
        data.messages.append(assistant_message(content, calls))
        if not calls:
            return (
                AgentState.INTERACTING
                if data.interaction is not None
                else self._end(data, RolloutStatus.STOP)
            )
        if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
            return self._end(data, RolloutStatus.MAX_TURNS)
        data.pending_calls = calls
        return AgentState.PROCESSING_TOOLS

    async def _processing_tools(self, data: AgentData, tools_kwargs: dict[str, Any]) -> AgentState:
        start = time.perf_counter()
        with tool_turn(data.messages) as turn:  # tools may read the conversation and ask for edits
            result = await self.runner.run_turn(data.pending_calls, tools_kwargs)  # type: ignore[union-attr]
        data.metrics.tool_calls += time.perf_counter() - start
        _count(data, result, len(data.pending_calls))
        result.images = self._decoded(result.images, "tool image")
        return self._append_turn(
            data, result.messages, result.images, tool_result=result, edits=turn.edits
        )

    async def _interacting(self, data: AgentData) -> AgentState:
        assert data.interaction is not None and data.interaction_id is not None
        with trace_span("interaction", inputs={"turn": data.user_turns}) as s:
            terminate, reply, score, _ = await data.interaction.generate_response(
                data.interaction_id, data.messages, **data.interaction_kwargs
            )
            s.outputs = {
                "terminate": bool(terminate), "reply": str(reply)[:500], "score": float(score),
            }
        data.counters["turn_scores"].append(float(score))
        if terminate:
            return self._end(data, RolloutStatus.STOP)
        return self._append_turn(data, [{"role": "user", "content": reply}])

    def _append_turn(
        self, data: AgentData, messages: list[dict[str, Any]], images: list[Any] | None = None,
        tool_result: ToolTurnResult | None = None, edits: list[ContextEdit] | None = None,
    ) -> AgentState:
        """Append tool / user messages (mask 0) and their images if they fit (a tool turn's texts
        cut to fit when needed), then decide whether to go on; or snapshot when the context is
        edited."""
        history, source = edited_history(data.messages, messages, edits or [], self.context.window)
        if source is None:
            try:
                ids = self._encode_turn(data, messages, images)
            except TemplateMismatchError:
                history, source = data.messages, TEMPLATE
        if source is not None:
            return self._snapshot(
                data, data.messages if history is None else history, messages, images, source
            )
        if len(data.response_mask) + len(ids) >= self.response_length:
            fitted = self._fit_tool_turn(data, tool_result) if tool_result is not None else None
            if fitted is None:
                return self._end(data, RolloutStatus.LENGTH)
            messages, ids = fitted
            data.counters["num_budget_truncations"] += 1
        data.messages += messages
        data.image_data += images or []
        data.response_ids += ids
        data.response_mask += [0] * len(ids)
        data.response_logprobs += [0.0] * len(ids)
        data.weight_versions += [-1] * len(ids)
        return self._count_user_turn(data)

    def _count_user_turn(self, data: AgentData) -> AgentState:
        data.user_turns += 1
        if self.max_user_turns and data.user_turns >= self.max_user_turns:
            return self._end(data, RolloutStatus.MAX_TURNS)
        return AgentState.GENERATING

    def _snapshot(
        self, data: AgentData, history: list[dict[str, Any]], messages: list[dict[str, Any]],
        images: list[Any] | None, source: str,
    ) -> AgentState:
        """Close the trajectory as it is and start a new one whose prompt renders
        ``history + messages``."""
        if not data.snapshots.allows_another(self.context):
            data.snapshots.capped = True
            return self._end(data, RolloutStatus.MAX_TURNS)
        if self.max_user_turns and data.user_turns + 1 >= self.max_user_turns:
            # the new trajectory could not generate anything
            return self._end(data, RolloutStatus.MAX_TURNS)
        conversation = [*history, *messages]
        prompt = self._render_prompt(conversation, [*data.image_data, *(images or [])])
        # never truncated: it would not be a render of the conversation
        if len(prompt) > self.prompt_length:
            return self._end(data, RolloutStatus.LENGTH)
        data.snapshots.close(self._output(data), source)
        data.prompt_ids, data.response_ids, data.response_mask, data.response_logprobs = (
            prompt, [], [], [],
        )
        data.weight_versions = []
        data.counters, data.metrics = _new_counters(), unchecked(AgentLoopMetrics)
        data.messages = conversation
        data.image_data += images or []
        state = self._count_user_turn(data)
        data.segment_start = data.user_turns + data.assistant_turns
        return state

    def _encode_turn(
        self, data: AgentData, messages: list[dict[str, Any]], images: list[Any] | None = None
    ) -> list[int]:
        system = data.messages[0] if data.messages[0]["role"] == "system" else None
        previous = data.messages[-1] if data.messages[-1]["role"] == "assistant" else None
        ids = encode_new_turns(
            self.tokenizer, messages, system=system, tools=self.tool_schemas, previous=previous,
            chat_template_kwargs=self.apply_chat_template_kwargs,
        )
        return (
            encode_images(self.processor, ids, images or []) if self.processor is not None else ids
        )

    def _fit_tool_turn(self, data: AgentData, result: ToolTurnResult,
                       ) -> tuple[list[dict[str, Any]], list[int]] | None:
        """The tool turn with its texts cut to the largest character limit whose encoding leaves one
        token of the budget, and its ids; None when not even one character per text fits."""
        room = self.response_length - len(data.response_mask) - 1  # tokens the turn may take
        runner = self.runner
        assert runner is not None
        longest = max((len(t) for t in result.texts), default=0)
        tried = (
            min(longest, runner.max_response_length) if runner.max_response_length > 0 else longest
        )
        if room <= 0 or tried <= 1:
            return None  # ``tried`` chars per text did not fit, and there is nothing shorter to try

        def attempt(limit: int) -> tuple[list[dict[str, Any]], list[int]] | None:
            messages = result.limited(limit, runner.truncate_side)
            ids = self._encode_turn(data, messages, result.images)
            return (messages, ids) if len(ids) <= room else None

        best = attempt(1)
        if best is None:
            return None
        # Binary search between 1 (fits) and ``hi`` (does not); a token rarely spans 64 characters,
        # so the search starts there instead of rendering a huge text (when no
        # max_tool_response_length caps it).
        lo, hi = 1, min(tried, 64 * room + 1)
        if hi < tried and (top := attempt(hi)) is not None:
            return top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = attempt(mid)
            if got is None:
                hi = mid
            else:
                lo, best = mid, got
        return best

    @staticmethod
    def _end(data: AgentData, status: RolloutStatus) -> AgentState:
        data.status = status
        return AgentState.TERMINATED

    def _output(self, data: AgentData) -> AgentLoopOutput:
        n = self.response_length
        want_logprobs = bool(self.sampling_params.get("logprobs"))
        # the loop's own values skip validation (types.unchecked); an interaction's score is the
        # user's: checked by the constructor
        return (AgentLoopOutput if data.reward_score is not None else _unchecked_output)(
            prompt_ids=data.prompt_ids,
            response_ids=data.response_ids[:n],
            response_mask=data.response_mask[:n],
            response_logprobs=data.response_logprobs[:n] if want_logprobs else None,
            response_weight_versions=(
                data.weight_versions[:n] if max(data.weight_versions, default=-1) >= 0 else None
            ),
            routed_experts=data.routing.rows_for(data.prompt_ids, data.response_ids[:n]),
            num_turns=data.user_turns + data.assistant_turns - data.segment_start + 1,
            metrics=data.metrics,
            extra_fields={
                **data.counters,
                **({"messages": list(data.messages)} if self.return_messages else {}),
            },
            reward_score=data.reward_score,
            multi_modal_data={"image": list(data.image_data)} if data.image_data else None,
            status=data.status,
        )


def _unchecked_output(**values: Any) -> AgentLoopOutput:
    return unchecked(AgentLoopOutput, **values)


def _tool_agent_values(rollout: DictConfig) -> dict[str, Any]:
    mt = MultiTurnConfig.from_rollout(rollout)
    return {
        "max_assistant_turns": mt.max_assistant_turns, "max_user_turns": mt.max_user_turns,
        "return_messages": mt.return_messages, "context": ContextSettings.from_config(mt),
    }


def _track_versions(fields: dict[str, Any], out_fields: dict[str, Any]) -> None:
    """Widen the trajectory's weight-version range by one generation's (verl's
    min/max_global_steps)."""
    for key, pick in (("min_global_steps", min), ("max_global_steps", max)):
        value = out_fields.get(key)
        if value is not None:
            fields[key] = value if fields[key] is None else pick(fields[key], value)


def _count(data: AgentData, result: ToolTurnResult, num_calls: int) -> None:
    c = data.counters
    c["num_tool_calls"] += num_calls
    c["tool_rewards"] += result.rewards
    c["num_tool_errors"] += result.num_errors
    c["num_parse_errors"] += result.num_parse_errors
    c["num_dropped_calls"] += result.num_dropped
    c["num_tool_timeouts"] += result.num_timeouts
