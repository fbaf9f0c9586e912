"""What a sample's loop returned, made into trajectories the worker can pad, or into failed rows.

:func:`to_episode` normalises a loop's return value into one episode of checked trajectories;
:func:`failed_output` is the one ``error`` / ``timeout`` row; :func:`task_outputs` reads a finished
sample task; :func:`error_batch` is the padded rows of a chunk that no worker could roll out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agentloop.batch.postprocess import postprocess
from agentloop.batch.protocol import DataProto
from agentloop.config import EngineConfig
from agentloop.rollout.samples import agent_names
from agentloop.types import (
    AgentLoopOutput,
    MultiTrajectoryAgentLoopOutput,
    RolloutStatus,
    assign_field,
)
from agentloop.utils.ids import fresh_hex

# the worker's logger: these records are the worker's, as before the split
logger = logging.getLogger("agentloop.rollout.worker")


def failed_output(status: RolloutStatus, message: str) -> AgentLoopOutput:
    """One empty trajectory with ``status`` and ``message`` (its row's ``error``)."""
    return AgentLoopOutput(
        prompt_ids=[], response_ids=[], response_mask=[], status=status, error=message
    )


def task_outputs(task: asyncio.Task, timeout: float | None) -> list[AgentLoopOutput]:
    """A finished sample task's outputs; a cancelled one (deadline ``timeout``) is a ``timeout``
    row, one that raised (a bug outside the loop's own error handling) an ``error`` row."""
    if task.cancelled():
        return [
            failed_output(
                RolloutStatus.TIMEOUT,
                f"the batch deadline (agent.batch_timeout) passed after {timeout or 0:.0f}s with "
                "this sample still running",
            )
        ]
    e = task.exception()
    if e is not None:
        logger.error("a sample task failed outside its agent loop: %r", e)
        return [failed_output(RolloutStatus.ERROR, f"{type(e).__name__}: {e}")]
    return task.result()


def error_batch(chunk: DataProto, status: RolloutStatus, message: str, *, engine: EngineConfig,
                calculate_log_probs: bool, pad_token_id: int, default_agent: str,
                routed_experts_shape: tuple[int, int] | None = None) -> DataProto:
    """The rows of ``chunk`` when no worker could roll them out (its worker died and retries ran
    out, or it hung past the batch deadline): one ``status`` row per sample with ``message``, in
    verl's padded layout (the ``engine`` section's lengths; ``routed_experts`` all fill with
    routing replay's ``routed_experts_shape``), keeping each sample's non-tensor fields (uid,
    index...)."""
    fields = {k: v for k, v in chunk.non_tensor_batch.items()}
    fields["agent_name"] = agent_names(chunk, default_agent)
    output = postprocess(
        [failed_output(status, message) for _ in range(len(chunk))],
        prompt_length=engine.prompt_length, response_length=engine.response_length,
        pad_token_id=pad_token_id, sample_fields=fields, calculate_log_probs=calculate_log_probs,
        rewards_configured=False, routed_experts_shape=routed_experts_shape,
    )
    return output


def loop_failure(
    error: Exception, name: str, sample_index: Any, timeout: float | None
) -> list[AgentLoopOutput]:
    """The one row of a sample whose loop ``name`` raised ``error``: ``timeout`` for a timeout (as
    ``sample_timeout`` expiring gives it), else ``error``; logged as a warning."""
    if isinstance(error, asyncio.TimeoutError):
        logger.warning("sample %s (%s) timed out after %ss", sample_index, name, timeout)
        return [
            failed_output(
                RolloutStatus.TIMEOUT, f"agent loop {name!r} exceeded sample_timeout={timeout}s"
            )
        ]
    logger.warning("sample %s (%s) failed: %r", sample_index, name, error)
    return [failed_output(RolloutStatus.ERROR, f"{type(error).__name__}: {error}")]


def to_episode(
    output: Any, name: str
) -> MultiTrajectoryAgentLoopOutput | list[AgentLoopOutput]:
    """What loop ``name`` returned (an AgentLoopOutput, a list of them or a
    MultiTrajectoryAgentLoopOutput) as one episode of checked trajectories; anything else is one
    error row.  Every trajectory gets the episode's ``session_id`` in ``extra_fields``: the
    episode's own, else one a trajectory carries (the first), else a fresh one.  Returns the
    loop's episode (its trajectories checked), else the list of trajectories (an episode with the
    config's reward rule: what the scorer does with a list)."""
    if type(output) is AgentLoopOutput:  # the usual return, without the general path's checks
        checked = checked_output(output, name)
        given = checked.extra_fields.get("session_id")
        session = fresh_hex() if given is None else str(given)
        _set_extra_fields(checked, {**checked.extra_fields, "session_id": session})
        return [checked]
    episode = output if isinstance(output, MultiTrajectoryAgentLoopOutput) else None
    if episode is not None:
        outputs = episode.trajectories
    elif isinstance(output, list):
        outputs = output
    else:
        outputs = [output]
    if not outputs or not all(isinstance(o, AgentLoopOutput) for o in outputs):
        msg = (
            f"agent loop {name!r} returned {type(output).__name__}; expected "
            "AgentLoopOutput, a list of them or a MultiTrajectoryAgentLoopOutput"
        )
        outputs, episode = [failed_output(RolloutStatus.ERROR, msg)], None
    outputs = [checked_output(o, name) for o in outputs]
    given = [o.extra_fields.get("session_id") for o in outputs]
    given = [g for g in given if g is not None]
    if episode is not None and episode.session_id is not None:
        session_id = str(episode.session_id)
    elif given:
        session_id = str(given[0])
    else:
        session_id = fresh_hex()
    for o in outputs:
        _set_extra_fields(o, {**o.extra_fields, "session_id": session_id})
    if episode is None:
        return outputs
    return episode.model_copy(update={"trajectories": outputs, "session_id": session_id})


def _set_extra_fields(output: AgentLoopOutput, fields: dict[str, Any]) -> None:
    """``output.extra_fields = fields`` (:func:`~agentloop.types.assign_field`)."""
    assign_field(output, "extra_fields", fields)


def checked_output(output: AgentLoopOutput, name: str) -> AgentLoopOutput:
    """The output, or an error row when its per-token lists disagree in length (one bad trajectory
    must not fail its neighbours' padding)."""
    n = len(output.response_ids)
    problem = None
    if len(output.response_mask) != n:
        problem = f"response_mask has {len(output.response_mask)} entries for {n} response ids"
    elif output.response_logprobs is not None and len(output.response_logprobs) != n:
        problem = (
            f"response_logprobs has {len(output.response_logprobs)} entries for {n} response ids"
        )
    if problem is None:
        return output
    logger.warning("agent loop %r returned a malformed trajectory: %s", name, problem)
    return failed_output(
        RolloutStatus.ERROR,
        f"agent loop {name!r} returned a malformed trajectory: {problem} (one mask value and, "
        "with log-probs, one log-prob per response token)",
    )
