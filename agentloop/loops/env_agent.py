"""EnvAgentLoop: a gym-style environment drives the conversation, registered as ``env_agent``.

Per sample: the environment the sample names (:mod:`agentloop.envs.resolve`) is made and reset;
its messages (and tools) are the prompt, rendered with the chat template. Then, until the
environment says ``done``, a turn limit (``env.max_turns``) or the ``response_length`` budget:
generate, hand the assistant turn (text, content, parsed tool calls) to ``env.step``, append the
returned messages with exact tokens (mask 0). Turn rewards go to ``turn_scores``; the final reward
is the last step's ``info["score"]`` when given, else the sum of turn rewards. An exception or a
timeout (``env.step_timeout``) in the environment ends the sample as an ``error`` / ``timeout``
row naming the environment, with its tokens so far; ``close()`` is always called. Sync environment
methods run in a thread pool, async ones are awaited. A chat template that re-renders earlier turns
closes the trajectory as a snapshot and starts a new one (docs/context.md), as ``tool_agent`` does.
Configured tools (``multi_turn.tool_config_path``: MCP servers, ``BaseTool``s) are offered next to
the environment's and run as ``tool_agent`` runs them (:mod:`agentloop.loops.env_tools`).

Spec: docs/environments.md.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar
from uuid import uuid4

from omegaconf import DictConfig

from agentloop.batch.routed_experts import RoutedExpertsTrace
from agentloop.config import EnvConfig, MultiTurnConfig
from agentloop.envs.base import AssistantTurn, EnvReset, EnvStep
from agentloop.envs.resolve import EnvChoice, check_env_config, env_spec, resolve_env
from agentloop.loops.base import AgentLoopBase, config_values, register, trainer_config_of
from agentloop.loops.context import TEMPLATE, ContextSettings, Snapshots
from agentloop.loops.env_tools import EnvTools, claimed_names
from agentloop.loops.prompt import apply_chat_template, as_messages, fit_prompt
from agentloop.loops.tool_calls import assistant_message
from agentloop.parsers.base import FunctionCall, ToolParser, get_tool_parser
from agentloop.tokenization import encode_new_turns
from agentloop.tokenization.incremental import TemplateMismatchError
from agentloop.trace import span as trace_span
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    MultiTrajectoryAgentLoopOutput,
    RolloutStatus,
    StopReason,
)

logger = logging.getLogger(__name__)

_TIMEOUT_KEY = "actor_rollout_ref.rollout.env.step_timeout"


class EnvFailure(Exception):
    """The environment failed or timed out: the sample ends with ``status`` and this message."""

    def __init__(self, status: RolloutStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Episode:
    """Everything one episode accumulates."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    """The tools offered to the policy: the environment's, then the configured ones."""
    claimed: frozenset[str] = frozenset()
    """The names of the environment's own tools (their calls go to ``step``)."""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    routing: RoutedExpertsTrace = field(default_factory=RoutedExpertsTrace)  # routing replay
    assistant_turns: int = 0
    observation_turns: int = 0
    status: RolloutStatus = RolloutStatus.STOP
    error: str | None = None
    turn_scores: list[float] = field(default_factory=list)
    final_score: float | None = None
    """``info["score"]`` of the last step, when it gave one."""
    info: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=lambda: {
        "num_tool_calls": 0, "num_parse_errors": 0, "num_tool_errors": 0, "num_tool_timeouts": 0,
        "prompt_truncated": 0,
        "min_global_steps": None, "max_global_steps": None, "env_close_error": None,
    })
    metrics: AgentLoopMetrics = field(default_factory=AgentLoopMetrics)
    snapshots: Snapshots = field(default_factory=Snapshots)
    """Trajectories closed because the chat template re-renders earlier turns (docs/context.md)."""
    segment_start: int = 0
    """Turns before the current trajectory began (its ``num_turns`` counts from there)."""

    def reward(self) -> float | None:
        """The documented rule: the last step's ``info["score"]``, else the sum of turn rewards
        (None when no step ran or the episode failed)."""
        if self.error is not None or not self.turn_scores:
            return None
        return self.final_score if self.final_score is not None else float(sum(self.turn_scores))


async def call_env(choice: EnvChoice, what: str, fn: Callable[..., Any], *args: Any,
                   timeout: float | None) -> Any:
    """``fn(*args)``: awaited when async, else run in a thread; under ``timeout`` seconds.

    Raises:
        EnvFailure: ``fn`` raised (status ``error``) or ran past ``timeout`` (status ``timeout``);
            the message names the environment and what failed.
    """
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(*args), timeout)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)
            if inspect.isawaitable(result):  # a plain function that returned a coroutine
                result = await asyncio.wait_for(result, timeout)
    except asyncio.TimeoutError:
        raise EnvFailure(RolloutStatus.TIMEOUT, f"environment {choice.name!r}: {what} timed out "
                         f"after {timeout:g}s ({_TIMEOUT_KEY})") from None
    except Exception as e:  # noqa: BLE001 - any environment error becomes the row's message
        raise EnvFailure(RolloutStatus.ERROR, f"environment {choice.name!r}: {what} raised "
                         f"{type(e).__name__}: {e}") from e
    return result


@register("env_agent")
class EnvAgentLoop(AgentLoopBase):
    """Reset → (generate → step → append the observation) …, until done, a limit or the
    budget."""

    tool_parser: ClassVar[ToolParser | None] = None
    env_tools: ClassVar[EnvTools] = EnvTools()
    """The configured tools (``multi_turn.tool_config_path``), loaded once per worker."""
    init_class_takes_tools: ClassVar[bool] = True

    @classmethod
    def init_class(
        cls, config: Any, tokenizer: Any, processor: Any | None = None, **kwargs: Any
    ) -> None:
        """Load the tool parser (``multi_turn.format``) and the configured tools (or take the
        worker's, ``tools=ToolListWrap``), and check the ``env`` section, once per worker."""
        root = trainer_config_of(config)
        check_env_config(EnvConfig.from_root(root))
        mt = MultiTurnConfig.from_root(root)
        given = kwargs.get("tools")
        cls.env_tools = EnvTools.load(mt, list(given.tools) if given is not None else None)
        cls.tool_parser = get_tool_parser(mt.format, tokenizer)
        cls._class_initialized = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        values = config_values(self.rollout_config, "env_agent", _env_agent_values)
        self.env_config: EnvConfig = values["env"]
        self.return_messages: bool = values["return_messages"]
        self.context: ContextSettings = values["context"]
        self.request_id = uuid4().hex
        self.sampling_params: dict[str, Any] = {}
        self.tools_kwargs: dict[str, Any] = {}

    async def run(
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> AgentLoopOutput | MultiTrajectoryAgentLoopOutput:
        """Roll out one episode (see the module docstring).

        Raises:
            ConfigError: the sample names no environment, or one that does not resolve (the
                worker makes it an error row).
        """
        choice = resolve_env(env_spec(kwargs, self.env_config.default), self.env_config)
        self.sampling_params = dict(sampling_params)
        self.tools_kwargs = dict(kwargs.get("tools_kwargs") or {})
        ep = Episode()
        env = None
        try:
            env = await call_env(choice, "creating it", choice.make, timeout=self._timeout)
            await self._reset(choice, env, ep, kwargs)
            while await self._turn(choice, env, ep):
                pass
        except EnvFailure as failure:
            ep.status, ep.error = failure.status, str(failure)
        finally:
            if env is not None:
                await self._close(choice, env, ep)
        return ep.snapshots.finish(self._output(ep, choice))

    @property
    def _timeout(self) -> float | None:
        return self.env_config.step_timeout

    async def _reset(self, choice: EnvChoice, env: Any, ep: Episode,
                     sample: dict[str, Any]) -> None:
        with trace_span("env_reset", inputs={"env": choice.name}) as s:
            reset = await self._env_call(choice, ep, "reset", env.reset, sample)
            if not isinstance(reset, EnvReset):
                raise EnvFailure(RolloutStatus.ERROR, f"environment {choice.name!r}: reset "
                                 f"returned {type(reset).__name__}, expected an EnvReset")
            s.outputs = {"messages": _short(reset.messages), "tools": len(reset.tools or [])}
        ep.messages = _checked_messages(choice, "reset", reset.messages)
        ep.tools, ep.claimed = self.env_tools.offered(reset.tools), claimed_names(reset.tools)
        ep.info.update(reset.info)
        ep.prompt_ids, ep.counters["prompt_truncated"] = fit_prompt(
            self._render(ep.messages, ep.tools), self.prompt_length, self.prompt_truncation
        )

    def _render(self, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, tools=tools,
                                   add_generation_prompt=True, **self.apply_chat_template_kwargs)

    async def _turn(self, choice: EnvChoice, env: Any, ep: Episode) -> bool:
        """One generate → step → append round; False once the episode is over."""
        out = await self._generate(ep)
        if out.stop_reason == StopReason.ABORTED:
            return self._end(ep, RolloutStatus.ABORTED)
        content, calls = await self.tool_parser.extract_tool_calls(out.token_ids, ep.tools)  # type: ignore[union-attr]
        ep.counters["num_tool_calls"] += len(calls)
        ep.counters["num_parse_errors"] += sum(1 for c in calls if c.error)
        assistant = assistant_message(content, calls)
        ep.messages.append(assistant)
        ours, theirs = self.env_tools.split(calls, ep.claimed)
        if ours and not theirs:  # only configured tools: run them, the environment is not stepped
            stop = self._limit(ep, out)
            if stop is not None:
                return self._end(ep, stop)
            return self._append(choice, ep, await self._run_tools(ep, ours), assistant)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        step = await self._step(choice, env, ep, AssistantTurn(text, content, _calls(theirs)))
        if step.done:
            return self._end(ep, RolloutStatus.STOP)
        stop = self._limit(ep, out)
        if stop is not None:
            return self._end(ep, stop)
        results = await self._run_tools(ep, ours) if ours else []
        return self._append(choice, ep, [*results, *step.messages], assistant)

    def _limit(self, ep: Episode, out: Any) -> RolloutStatus | None:
        """``length`` when the turn used up the budget, ``max_turns`` at ``env.max_turns``, else
        None."""
        if out.stop_reason == StopReason.LENGTH or len(ep.response_mask) >= self.response_length:
            return RolloutStatus.LENGTH
        max_turns = self.env_config.max_turns
        if max_turns and ep.assistant_turns >= max_turns:
            return RolloutStatus.MAX_TURNS
        return None

    async def _run_tools(self, ep: Episode, calls: list[FunctionCall]) -> list[dict[str, Any]]:
        """Run configured-tool calls as ``tool_agent`` does; their tool messages, in call order."""
        start = time.perf_counter()
        result = await self.env_tools.run(calls, self.tools_kwargs)
        ep.metrics.tool_calls += time.perf_counter() - start
        ep.counters["num_tool_errors"] += result.num_errors
        ep.counters["num_tool_timeouts"] += result.num_timeouts
        return result.messages

    async def _generate(self, ep: Episode) -> Any:
        budget = self.response_length - len(ep.response_mask)
        start, prompt = time.perf_counter(), ep.prompt_ids + ep.response_ids
        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=prompt,
            sampling_params={**self.sampling_params, "max_tokens": budget,
                             **ep.routing.request(prompt)},
        )
        ep.metrics.generate_sequences += time.perf_counter() - start
        ep.routing.add(prompt, out)
        for key, pick in (("min_global_steps", min), ("max_global_steps", max)):
            value, old = out.extra_fields.get(key), ep.counters[key]
            if value is not None:
                ep.counters[key] = value if old is None else pick(old, value)
        n = len(out.token_ids)
        ep.response_ids += out.token_ids
        ep.response_mask += [1] * n
        ep.response_logprobs += out.log_probs if out.log_probs is not None else [0.0] * n
        versions = out.extra_fields.get("weight_versions")
        ep.weight_versions += versions if versions is not None else [-1] * n
        if out.num_preempted and out.num_preempted > 0:
            ep.metrics.num_preempted = max(ep.metrics.num_preempted, 0) + out.num_preempted
        ep.assistant_turns += 1
        return out

    async def _step(self, choice: EnvChoice, env: Any, ep: Episode,
                    turn: AssistantTurn) -> EnvStep:
        what = f"step {ep.assistant_turns}"
        with trace_span("env_step", inputs={"env": choice.name, "turn": ep.assistant_turns,
                                            "text": turn.text[:500],
                                            "tool_calls": turn.tool_calls}) as s:
            step = await self._env_call(choice, ep, what, env.step, turn)
            if not isinstance(step, EnvStep):
                raise EnvFailure(RolloutStatus.ERROR, f"environment {choice.name!r}: {what} "
                                 f"returned {type(step).__name__}, expected an EnvStep")
            s.outputs = {"reward": step.reward, "done": step.done,
                         "messages": _short(step.messages)}
        _checked_messages(choice, what, step.messages)
        try:
            ep.turn_scores.append(float(step.reward))
        except (TypeError, ValueError):
            raise EnvFailure(RolloutStatus.ERROR, f"environment {choice.name!r}: {what} "
                             f"returned reward {step.reward!r}, expected a number") from None
        ep.info.update(step.info)
        score = step.info.get("score")
        ep.final_score = float(score) if isinstance(score, (int, float)) else None
        return step

    def _append(self, choice: EnvChoice, ep: Episode, messages: list[dict[str, Any]],
                assistant: dict[str, Any]) -> bool:
        """Append the observation with exact tokens (mask 0) if it fits the budget."""
        system = ep.messages[0] if ep.messages[0].get("role") == "system" else None
        try:
            ids = encode_new_turns(self.tokenizer, messages, system=system, tools=ep.tools,
                                   previous=assistant,
                                   chat_template_kwargs=self.apply_chat_template_kwargs)
        except TemplateMismatchError:
            return self._snapshot(choice, ep, messages)
        if len(ep.response_mask) + len(ids) >= self.response_length:
            return self._end(ep, RolloutStatus.LENGTH)
        ep.messages += messages
        ep.response_ids += ids
        ep.response_mask += [0] * len(ids)
        ep.response_logprobs += [0.0] * len(ids)
        ep.weight_versions += [-1] * len(ids)
        ep.observation_turns += 1
        return True

    def _snapshot(self, choice: EnvChoice, ep: Episode, messages: list[dict[str, Any]]) -> bool:
        """The template re-renders earlier turns: close this trajectory and start a new one whose
        prompt renders the whole conversation (as ``tool_agent`` does; docs/context.md)."""
        if not ep.snapshots.allows_another(self.context):
            ep.snapshots.capped = True
            return self._end(ep, RolloutStatus.MAX_TURNS)
        conversation = [*ep.messages, *messages]
        prompt = self._render(conversation, ep.tools)
        if len(prompt) > self.prompt_length:  # never cut: it would not render the conversation
            return self._end(ep, RolloutStatus.LENGTH)
        closed = self._output(ep, choice)
        closed.reward_score = None  # the episode's reward goes with its final trajectory
        ep.snapshots.close(closed, TEMPLATE)
        ep.prompt_ids, ep.response_ids, ep.response_mask = prompt, [], []
        ep.response_logprobs, ep.weight_versions, ep.metrics = [], [], AgentLoopMetrics()
        ep.messages = conversation
        ep.observation_turns += 1
        ep.segment_start = ep.assistant_turns + ep.observation_turns
        return True

    async def _env_call(self, choice: EnvChoice, ep: Episode, what: str,
                        fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return await call_env(choice, what, fn, *args, timeout=self._timeout)
        finally:
            ep.metrics.tool_calls += time.perf_counter() - start

    async def _close(self, choice: EnvChoice, env: Any, ep: Episode) -> None:
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            await call_env(choice, "close", close, timeout=self._timeout)
        except EnvFailure as failure:  # the episode stands; the failure is kept and logged
            ep.counters["env_close_error"] = str(failure)
            logger.warning("%s", failure)

    @staticmethod
    def _end(ep: Episode, status: RolloutStatus) -> bool:
        ep.status = status
        return False

    def _output(self, ep: Episode, choice: EnvChoice) -> AgentLoopOutput:
        n = self.response_length
        fields: dict[str, Any] = {
            "env": choice.name, "turn_scores": list(ep.turn_scores), "env_info": dict(ep.info),
            **ep.counters,
        }
        if self.return_messages:
            fields["messages"] = list(ep.messages)
        return AgentLoopOutput(
            prompt_ids=ep.prompt_ids,
            response_ids=ep.response_ids[:n],
            response_mask=ep.response_mask[:n],
            response_logprobs=(ep.response_logprobs[:n]
                               if self.sampling_params.get("logprobs") else None),
            response_weight_versions=(ep.weight_versions[:n]
                                      if any(v >= 0 for v in ep.weight_versions) else None),
            routed_experts=ep.routing.rows_for(ep.prompt_ids, ep.response_ids[:n]),
            num_turns=ep.assistant_turns + ep.observation_turns - ep.segment_start + 1,
            metrics=ep.metrics,
            extra_fields=fields,
            reward_score=ep.reward(),
            status=ep.status,
            error=ep.error,
        )


def _env_agent_values(rollout: DictConfig) -> dict[str, Any]:
    mt = MultiTurnConfig.from_rollout(rollout)
    return {"env": EnvConfig.from_rollout(rollout), "return_messages": mt.return_messages,
            "context": ContextSettings.from_config(mt)}


def _checked_messages(choice: EnvChoice, what: str, messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a list of chat messages, or the EnvFailure naming what is wrong."""
    try:
        checked = as_messages(messages)
    except Exception as e:  # noqa: BLE001 - DatasetError's text says what a message is
        raise EnvFailure(RolloutStatus.ERROR, f"environment {choice.name!r}: {what} returned "
                         f"bad messages: {e}") from None
    if not all("role" in m for m in checked):
        raise EnvFailure(RolloutStatus.ERROR, f"environment {choice.name!r}: {what} returned a "
                         f"message without 'role': {str(messages)[:200]}")
    return checked


def _calls(calls: list[FunctionCall]) -> list[dict[str, Any]]:
    """Parsed calls as the environment sees them: ``{"id", "name", "arguments"}`` (a dict; a
    malformed call has ``{}`` and its problem under ``"error"``)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = None
        call: dict[str, Any] = {"id": c.id, "name": c.name,
                                "arguments": args if isinstance(args, dict) else {}}
        if c.error:
            call["error"] = c.error
        out.append(call)
    return out


def _short(messages: list[Any]) -> list[Any]:
    """Messages with their contents cut to 500 characters (for trace spans)."""
    return [
        {**m, "content": str(m.get("content"))[:500]} if isinstance(m, dict) else str(m)[:500]
        for m in messages
    ]
