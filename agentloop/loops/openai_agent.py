"""The ``openai_agent`` loop: rolling out unmodified OpenAI-client agents through the gateway.

An agent runner runs the user's agent for one sample against a gateway session: an async callable
``runner(*, base_url, api_key, raw_prompt, **sample_fields)`` (registered with
:func:`agentloop.gateway.framework.register_agent_runner`; given ``anthropic_base_url`` too when it
takes it), or a ``command`` run as a subprocess with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` /
``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` / ``ANTHROPIC_AUTH_TOKEN`` / ``AGENTLOOP_RAW_PROMPT``
in its environment. :meth:`OpenAIAgentLoop.run` opens a session, runs the agent under
``session_timeout``, and returns the session's branches as one episode
(:class:`~agentloop.types.MultiTrajectoryAgentLoopOutput`) with the session's reward; an agent that
fails or times out marks only its own sample (``error`` / ``timeout``). Spec (runner forms,
selection, the four steps per sample): docs/gateway.md#agent-runners-and-the-openai_agent-loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shlex
import sys
import tempfile
from typing import Any, ClassVar, cast

from omegaconf import DictConfig

from agentloop.batch.multimodal import decode_images
from agentloop.config import GatewayConfig
from agentloop.errors import ConfigError
from agentloop.loops.base import (
    LOOP_CONTRACT_KWARGS,
    AgentLoopBase,
    config_values,
    register,
    trainer_config_of,
)
from agentloop.loops.runners import AgentRunner, accepts_keyword, resolve_runner
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    MultiTrajectoryAgentLoopOutput,
    RewardTo,
    RolloutStatus,
)
from agentloop.utils.imports import import_object
from agentloop.utils.process import start_process, wait_process

__all__ = ["AgentRunner", "OpenAIAgentLoop"]


def _resolve(value: Any, what: str) -> Any:
    if value is None or callable(value):
        return value
    return import_object(str(value), what)


def _gateway_section(rollout: DictConfig) -> dict[str, Any]:
    return {"gateway": GatewayConfig.from_rollout(rollout)}


@register("openai_agent")
class OpenAIAgentLoop(AgentLoopBase):
    """Runs an OpenAI-client agent against a gateway session.

    Spec: docs/gateway.md#agent-runners-and-the-openai_agent-loop.

    Kwargs (from the registry entry): ``runner`` (callable, registered runner name or
    ``"pkg.mod:fn"``), ``command``, ``reward_fn`` (callable or path), and overrides of
    ``rollout.gateway`` keys (``session_timeout``, ``trajectories``, ``reward_to``).  A sample may
    also name its runner in ``extra_info.agent_runner``.
    """

    requires_gateway: ClassVar[bool] = True
    gateway_manager: ClassVar[Any] = None
    _slots: ClassVar[asyncio.Semaphore | None] = None

    def __init__(
        self, trainer_config: Any, server_manager: Any, tokenizer: Any,
        processor: Any | None = None, **kwargs: Any,
    ) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in LOOP_CONTRACT_KWARGS}
        super().__init__(trainer_config, server_manager, tokenizer, processor)
        gateway: GatewayConfig = config_values(self.rollout_config, "gateway", _gateway_section)[
            "gateway"
        ]
        overrides = {k: kwargs[k] for k in GatewayConfig.OVERRIDABLE if k in kwargs}
        if overrides:  # the loop entry's own values (checked like the config's)
            gateway = dataclasses.replace(gateway, **overrides)
        self.runner: AgentRunner | None = resolve_runner(
            kwargs.get("runner"), "openai_agent runner"
        )
        self.command = kwargs.get("command")
        self.reward_fn = _resolve(kwargs.get("reward_fn"), "openai_agent reward_fn")
        self.session_timeout: float | None = (
            float(gateway.session_timeout) if gateway.session_timeout else None
        )
        self.longest_only = gateway.trajectories == "longest"
        self.reward_to: str | None = gateway.reward_to

    @classmethod
    def reset_class(cls) -> None:
        """Forget what :meth:`init_class` set up once per process (the session cap's semaphore and
        the gateway manager), e.g. between two configs in one test process."""
        OpenAIAgentLoop._slots = None
        cls.gateway_manager = None

    @classmethod
    def init_class(
        cls, config: DictConfig, tokenizer: Any, processor: Any | None = None, **kwargs: Any
    ) -> None:
        """Keep the worker's GatewayManager and the session semaphore (once per worker)."""
        if kwargs.get("gateway_manager") is not None:
            OpenAIAgentLoop.gateway_manager = kwargs["gateway_manager"]
        limit = GatewayConfig.from_root(trainer_config_of(config)).max_concurrent_sessions
        if OpenAIAgentLoop._slots is None and limit > 0:
            OpenAIAgentLoop._slots = asyncio.Semaphore(limit)

    async def run(
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> MultiTrajectoryAgentLoopOutput:
        """Steps 1-4 of docs/gateway.md#agent-runners-and-the-openai_agent-loop."""
        if self.gateway_manager is None:
            raise ConfigError(
                "openai_agent needs the gateway: build the worker through "
                "AgentLoopManager, which "
                "starts gateway actors when a registered loop has "
                "requires_gateway=True"
            )
        runner = self._runner_for(kwargs)
        slots = OpenAIAgentLoop._slots
        if slots is not None:
            await slots.acquire()
        try:
            return await self._run_session(runner, sampling_params, kwargs)
        finally:
            if slots is not None:
                slots.release()

    def _runner_for(self, fields: dict[str, Any]) -> AgentRunner:
        extra = fields.get("extra_info") or {}
        named = extra.get("agent_runner") if isinstance(extra, dict) else None
        if named:
            # named: never None
            return cast(AgentRunner, resolve_runner(named, "extra_info.agent_runner"))
        if self.runner is not None:
            return self.runner
        if self.command:
            return _subprocess_runner(self.command)
        raise ConfigError(
            f"agent {fields.get('agent_name')!r} has no runner: register one with "
            "@register_agent_runner(name), or give 'runner' / 'command' in "
            "its registry entry"
        )

    async def _run_session(self, runner: AgentRunner, sampling_params: dict[str, Any],
                           fields: dict[str, Any]) -> MultiTrajectoryAgentLoopOutput:
        gm = self.gateway_manager
        params = {k: v for k, v in sampling_params.items() if k != "logprobs"}
        handle = await gm.create_session(
            metadata={"index": _jsonable(fields.get("index"))}, sampling_params=params
        )
        status, error, returned = RolloutStatus.STOP, None, None
        loop_time = asyncio.get_running_loop().time
        t0 = loop_time()
        try:
            session = {"base_url": handle.base_url, "api_key": handle.api_key}
            # the session root: the SDK appends /v1/messages
            if accepts_keyword(runner, "anthropic_base_url"):
                session["anthropic_base_url"] = handle.base_url.removesuffix("/v1")
            call = runner(**session, raw_prompt=list(fields["raw_prompt"]),
                          **{k: v for k, v in fields.items() if k not in ("raw_prompt", *session)})
            returned = await (
                asyncio.wait_for(call, self.session_timeout) if self.session_timeout else call
            )
        except asyncio.TimeoutError:
            status, error = (
                RolloutStatus.TIMEOUT,
                f"agent exceeded session_timeout={self.session_timeout}s",
            )
            await gm.abort(handle.session_id)
        except Exception as e:  # noqa: BLE001 - the agent failed: this sample only
            status, error = RolloutStatus.ERROR, f"agent runner failed: {type(e).__name__}: {e}"
            await gm.abort(handle.session_id)
        # e.g. the worker's sample_timeout: close the session, then give up
        except asyncio.CancelledError:
            await asyncio.shield(_discard(gm, handle.session_id))
            raise
        result = await gm.finalize(handle.session_id, self.longest_only)
        elapsed = loop_time() - t0
        outputs = self._outputs(result, returned, fields, status, error, elapsed)
        mode = cast("RewardTo | None", "last" if self.reward_to == "longest" else self.reward_to)
        return MultiTrajectoryAgentLoopOutput(
            trajectories=outputs, session_id=str(result["session_id"]), reward_to=mode
        )

    def _outputs(
        self, result: dict[str, Any], returned: Any, fields: dict[str, Any], status: RolloutStatus,
        error: str | None, elapsed: float,
    ) -> list[AgentLoopOutput]:
        trajectories = result["trajectories"]
        over = int((result.get("stats") or {}).get("prompt_over_length") or 0)
        if not trajectories and over and status == RolloutStatus.STOP:
            return [
                AgentLoopOutput(
                    prompt_ids=[],
                    response_ids=[],
                    response_mask=[],
                    status=RolloutStatus.LENGTH,
                    error=f"the agent's prompt has {over} tokens, over "
                    f"rollout.prompt_length; the "
                    "gateway answered finish_reason 'length' without "
                    "generating",
                )
            ]
        if not trajectories:
            return [
                AgentLoopOutput(
                    prompt_ids=[], response_ids=[], response_mask=[],
                    status=status if status != RolloutStatus.STOP else RolloutStatus.ERROR,
                    error=error or "the agent made no chat request that produced tokens",
                )
            ]
        scores = self._scores(trajectories, result.get("reward_info"), returned, fields, status)
        outputs = []
        for traj, score in zip(trajectories, scores, strict=True):
            finish = traj.finish_reason
            st: RolloutStatus
            if status != RolloutStatus.STOP:
                st = status
            elif finish == "length":
                st = RolloutStatus.LENGTH
            else:
                st = RolloutStatus.STOP
            outputs.append(
                AgentLoopOutput(
                    prompt_ids=list(traj.prompt_ids),
                    response_ids=list(traj.response_ids),
                    response_mask=list(traj.response_mask),
                    response_logprobs=traj.response_logprobs,
                    routed_experts=getattr(traj, "routed_experts", None),  # routing replay
                    num_turns=int(traj.num_turns),
                    reward_score=score,
                    status=st,
                    error=error,
                    metrics=AgentLoopMetrics(generate_sequences=elapsed),
                    multi_modal_data=_row_media(traj),
                    extra_fields={
                        "gateway_session_id": result["session_id"], "finish_reason": finish,
                        "constrained": bool(traj.constrained),
                    },
                )
            )
        return outputs

    def _scores(
        self, trajectories: list[Any], reward_info: Any, returned: Any, fields: dict[str, Any],
        status: RolloutStatus,
    ) -> list[float | None]:
        """Each trajectory's own ``reward_score``: the session reward on the final trajectory (the
        worker spreads it by ``reward_to``), or with ``longest`` on the longest one and 0.0 on the
        others.
        """
        chosen = len(trajectories) - 1
        if self.reward_to == "longest":
            chosen = max(range(len(trajectories)), key=lambda k: len(trajectories[k].response_ids))
        score = _score_of(reward_info)
        if score is None:
            score = _score_of(returned)
        if score is None and self.reward_fn is not None and status == RolloutStatus.STOP:
            score = float(self.reward_fn(trajectories[chosen].messages, **fields))
        if score is None and status != RolloutStatus.STOP:
            score = 0.0  # a failed or timed-out agent run earns nothing unless it posted a reward
        other = 0.0 if self.reward_to == "longest" and score is not None else None
        return [score if i == chosen else other for i in range(len(trajectories))]


def _row_media(traj: Any) -> dict[str, Any] | None:
    """A trajectory's images (encoded files, docs/gateway.md#images) as RGB PIL images:
    ``tool_agent``'s row layout, from which the worker adds ``multi_modal_inputs``; None without
    images."""
    images = (getattr(traj, "multi_modal_data", None) or {}).get("image")
    return {"image": decode_images(images, "gateway image")} if images else None


async def _discard(gm: Any, session_id: str) -> None:
    """Abort and finalize a session whose sample was cancelled, so the gateway and its slot are
    freed."""
    try:
        await gm.abort(session_id)
    finally:
        await gm.finalize(session_id)


def _score_of(info: Any) -> float | None:
    if isinstance(info, bool) or info is None:
        return None
    if isinstance(info, (int, float)):
        return float(info)
    if isinstance(info, dict):
        for key in ("score", "reward"):
            if isinstance(info.get(key), (int, float)) and not isinstance(info.get(key), bool):
                return float(info[key])
    return None


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def _subprocess_runner(command: str | list[str]) -> AgentRunner:
    """A runner that executes ``command`` with the session in its environment
    (spec: docs/gateway.md#agent-runners-and-the-openai_agent-loop)."""
    argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable  # the worker's interpreter (the venv), whatever PATH says

    async def run(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                  anthropic_base_url: str | None = None, **fields: Any) -> None:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
               "ANTHROPIC_BASE_URL": anthropic_base_url or base_url.removesuffix("/v1"),
               "ANTHROPIC_API_KEY": api_key, "ANTHROPIC_AUTH_TOKEN": api_key,
               "AGENTLOOP_RAW_PROMPT": json.dumps(_jsonable(raw_prompt))}
        # a file, not a pipe: the agent never blocks on a full pipe
        with tempfile.TemporaryFile() as stderr:
            proc = await start_process(argv, env, stderr)
            code = await wait_process(proc)
            if code != 0:
                stderr.seek(0, os.SEEK_END)
                stderr.seek(max(0, stderr.tell() - 800))
                tail = stderr.read().decode(errors="replace")
                raise RuntimeError(f"agent command {argv!r} exited with {code}: {tail}")

    return run
