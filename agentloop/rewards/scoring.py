"""Scoring trajectories when they end: verl's custom reward function, called by the worker.

:class:`TrajectoryScorer` sets each trajectory's ``reward_score`` by the rule of
docs/concepts.md#rewards (the loop's own score, else
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)``, plus
the tools' step rewards with ``add_tool_rewards``); a sample with several trajectories shares the
final trajectory's reward by ``multi_turn.reward_to`` (docs/context.md#rewards-across-trajectories).
A scorer that raises, times out or returns no finite score never fails the batch: the row gets no
score and the message in ``extra_fields["reward_error"]``. Plain functions run in a thread pool,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentloop.rewards.columns import REWARD_ERROR, REWARD_EXTRA_INFO, UNFINISHED
from agentloop.rewards.episode import REWARD_TO_MODES, EpisodeRewardConfig, reward_shares
from agentloop.rewards.loader import RewardFunctionConfig, load_reward_function
from agentloop.types import (
    AgentLoopOutput,
    MultiTrajectoryAgentLoopOutput,
    assign_field,
)

logger = logging.getLogger(__name__)

_OWN_KEYS = (REWARD_ERROR, REWARD_EXTRA_INFO)
Outcome = tuple[float | None, dict[str, Any] | None, str | None]
"""(score, reward extra info, error message) of one call."""


class TrajectoryScorer:
    """Applies the reward rule (docs/concepts.md#rewards) to the trajectories of one sample; one per
    worker.

    Args:
        config: the ``custom_reward_function`` block; its function is imported here (once).
        tokenizer: decodes ``solution_str``.
        response_length: only the first ``response_length`` response ids are decoded (None: all).
        episode: ``multi_turn.reward_to`` / ``reward_gamma`` for samples with several trajectories.

    Raises:
        ConfigError: the function cannot be loaded (see :func:`load_reward_function`).
    """

    def __init__(
        self, config: RewardFunctionConfig, tokenizer: Any, response_length: int | None = None,
        episode: EpisodeRewardConfig | None = None,
    ) -> None:
        self.config = config
        self.episode = episode or EpisodeRewardConfig()
        self.tokenizer = tokenizer
        self.response_length = response_length
        self.fn: Callable[..., Any] | None = (
            load_reward_function(config.path, config.name) if config.path else None
        )
        self.label = f"custom_reward_function {config.path}:{config.name}" if config.path else ""
        call = (
            type(self.fn).__call__
            if self.fn is not None and not inspect.isroutine(self.fn)
            else None
        )
        self.is_async = self.fn is not None and (
            inspect.iscoroutinefunction(self.fn)
            or (call is not None and inspect.iscoroutinefunction(call))
        )
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(
        cls, root: Any, tokenizer: Any, response_length: int | None = None
    ) -> TrajectoryScorer:
        """The scorer of a trainer-shaped config's ``custom_reward_function`` block."""
        return cls(RewardFunctionConfig.from_config(root), tokenizer, response_length,
                   EpisodeRewardConfig.from_config(root))

    @property
    def configured(self) -> bool:
        """True when this scorer is a reward source for every finished row (a function or tool
        rewards)."""
        return self.fn is not None or self.config.add_tool_rewards

    def unscored(
        self, outputs: list[AgentLoopOutput] | MultiTrajectoryAgentLoopOutput
    ) -> list[AgentLoopOutput] | None:
        """What :meth:`score` returns when there is nothing to score (no reward function, no tool
        rewards, one plain trajectory: it keeps its own ``reward_score``, recorded as set), without
        a coroutine: the worker's hot path calls it first.  None: :meth:`score` has work to do."""
        if (
            self.fn is not None or self.config.add_tool_rewards or type(outputs) is not list
            or len(outputs) != 1 or type(outputs[0]) is not AgentLoopOutput
        ):
            return None
        if self.episode.reward_to not in REWARD_TO_MODES:  # the mode's error, as score raises it
            reward_shares(1, self.episode.reward_to, self.episode.reward_gamma)
        final = outputs[0]
        assign_field(final, "reward_score", final.reward_score)
        return outputs

    async def score(self, outputs: list[AgentLoopOutput] | MultiTrajectoryAgentLoopOutput,
                    sample: Mapping[str, Any]) -> list[AgentLoopOutput]:
        """Set ``reward_score`` (and ``reward_error`` / ``reward_extra_info`` /
        ``metrics.compute_score``) on each of a sample's trajectories (one episode, final last), in
        place, by the reward rule; returns them.  An episode's own ``reward_to`` / ``reward_gamma``
        win over the config's. Never raises for a scorer's failure."""
        unscored = self.unscored(outputs)
        if unscored is not None:
            return unscored
        episode = outputs if isinstance(outputs, MultiTrajectoryAgentLoopOutput) else None
        trajectories = list(
            outputs.trajectories if isinstance(outputs, MultiTrajectoryAgentLoopOutput) else outputs
        )
        if not trajectories:
            return trajectories
        mode = (episode.reward_to if episode is not None else None) or self.episode.reward_to
        gamma = episode.reward_gamma if episode is not None and episode.reward_gamma is not None \
            else self.episode.reward_gamma
        shares = reward_shares(len(trajectories), mode, gamma)
        final = trajectories[-1]
        outcome, error = await self._outcome(final, sample)
        extra_info = final.extra_fields.get(REWARD_EXTRA_INFO)
        for i, output in enumerate(trajectories):
            if output is final:
                self._finish(output, outcome, error)
                continue
            unfinished = output.status in UNFINISHED
            if self.fn is not None and (outcome is None or unfinished):
                status = getattr(final.status, "value", final.status)
                why = error or f"the final trajectory ended with status {status!r}"
                self._finish(
                    output,
                    None,
                    f"no reward: this episode's final trajectory has none ({why})"
                    if outcome is None
                    else None,
                )
                continue
            share = None if outcome is None else shares[i] * outcome
            parts = [v for v in (share, output.reward_score) if v is not None]
            self._finish(output, math.fsum(parts) if parts else None, None)
            if (
                extra_info is not None
                and outcome is not None
                and REWARD_EXTRA_INFO not in output.extra_fields
            ):
                output.extra_fields = {**output.extra_fields, REWARD_EXTRA_INFO: dict(extra_info)}
        return trajectories

    async def _outcome(
        self, final: AgentLoopOutput, sample: Mapping[str, Any]
    ) -> tuple[float | None, str | None]:
        """The episode reward before tool rewards: the final trajectory's own ``reward_score``, else
        the function's score of it (its extra info recorded on it); and the error when the call
        failed."""
        if self.fn is not None and final.status in UNFINISHED:
            return None, None
        if final.reward_score is not None or self.fn is None:
            return final.reward_score, None
        start = time.perf_counter()
        score, info, error = await self._call(final, sample)
        final.metrics = final.metrics.model_copy(
            update={"compute_score": time.perf_counter() - start}
        )
        if info is not None:
            final.extra_fields = {**final.extra_fields, REWARD_EXTRA_INFO: info}
        return score, error

    def _finish(self, output: AgentLoopOutput, score: float | None, error: str | None) -> None:
        """Add the trajectory's own tool rewards (rule 3) to ``score`` and record it (and
        ``error``)."""
        finished = output.status not in UNFINISHED
        if self.config.add_tool_rewards and error is None:
            try:
                tools = tool_reward_sum(output)
            except ValueError as e:
                score, error = None, str(e)
            else:
                if score is not None:
                    score += tools
                elif self.fn is None and finished:
                    score = tools
        output.reward_score = score
        if error is not None:
            output.extra_fields = {**output.extra_fields, REWARD_ERROR: error}

    async def _call(self, output: AgentLoopOutput, sample: Mapping[str, Any]) -> Outcome:
        assert self.fn is not None
        timeout = self.config.timeout
        try:
            if self.is_async:
                kwargs = self._arguments(output, sample, self._decode(output))
                result = await asyncio.wait_for(self.fn(**kwargs), timeout)
            else:
                job = functools.partial(self._decode_and_call, output, sample)
                deadline = time.monotonic() + timeout if timeout else None
                result = await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(self._executor(), job), timeout)
                if inspect.isawaitable(result):  # a plain function that returned a coroutine
                    left = max(deadline - time.monotonic(), 0.0) if deadline is not None else None
                    result = await asyncio.wait_for(result, left)
        except asyncio.TimeoutError:
            message = (
                f"{self.label} did not return within "
                f"custom_reward_function.timeout={timeout}s; raise the "
                "timeout or make the scorer faster"
            )
            logger.warning("%s", message)
            return None, None, message
        except Exception as e:  # noqa: BLE001 - a failing scorer marks its row, never the batch
            message = f"{self.label} raised {type(e).__name__}: {e}"
            logger.warning("%s", message)
            return None, None, message
        return parse_result(result, self.label)

    def _decode(self, output: AgentLoopOutput) -> str:
        ids = (
            output.response_ids
            if self.response_length is None
            else output.response_ids[: self.response_length]
        )
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _decode_and_call(self, output: AgentLoopOutput, sample: Mapping[str, Any]) -> Any:
        assert self.fn is not None
        return self.fn(**self._arguments(output, sample, self._decode(output)))

    def _arguments(
        self, output: AgentLoopOutput, sample: Mapping[str, Any], solution: str
    ) -> dict[str, Any]:
        """verl's reward-manager arguments (docs/concepts.md#rewards); ``reward_kwargs`` win."""
        given = sample.get("extra_info")
        extra = dict(given) if isinstance(given, Mapping) else {}
        extra.update((k, v) for k, v in output.extra_fields.items() if k not in _OWN_KEYS)
        extra["num_turns"] = output.num_turns
        extra["rollout_reward_scores"] = output.extra_fields.get("reward_scores") or {}
        reward_model = sample.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
        return {
            "data_source": sample.get("data_source"), "solution_str": solution,
            "ground_truth": truth, "extra_info": extra, **self.config.reward_kwargs,
        }

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(thread_name_prefix="agentloop-reward")
        return self._pool


def parse_result(result: Any, label: str = "custom_reward_function") -> Outcome:
    """A scorer's return value as (score, reward extra info, error): a number, or a dict with
    ``"score"``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            return (
                None,
                None,
                (
                    f"{label} returned a dict without a 'score' key (keys: "
                    f"{sorted(map(str, result))});"
                    " return a float or a dict with 'score'"
                ),
            )
        value: Any = result["score"]
    else:
        value = result
    try:
        score = float(value)
    except (TypeError, ValueError):
        return (
            None,
            None,
            (
                f"{label} returned {type(value).__name__} {str(value)[:80]!r} "
                f"as the score; return a "
                "float or a dict with a numeric 'score'"
            ),
        )
    if not math.isfinite(score):
        return None, None, f"{label} returned a non-finite score ({score}); return a finite float"
    return score, dict(result) if isinstance(result, Mapping) else {"acc": score}, None


def tool_reward_sum(output: AgentLoopOutput) -> float:
    """The sum of ``extra_fields["tool_rewards"]`` (0.0 when the trajectory used no tool).

    Raises:
        ValueError: the list holds something that is not a finite number.
    """
    values = output.extra_fields.get("tool_rewards") or []
    try:
        total = math.fsum(float(v) for v in values)
    except (TypeError, ValueError):
        total = math.nan
    if not math.isfinite(total):
        raise ValueError(
            f"add_tool_rewards: extra_fields['tool_rewards'] is "
            f"{str(values)[:80]}; expected a list "
            "of finite numbers (the tools' step rewards)"
        )
    return total
