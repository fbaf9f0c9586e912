"""TextArenaSelfPlayLoop: one TextArena game with every seat played by the policy, registered as
``textarena_selfplay`` (docs/environments.md#textarena).

One sample is one game (:class:`~agentloop.envs.textarena.TextArenaGame`). Each seat has its own
conversation: the sample's ``raw_prompt`` (e.g. a system message), then its observations as user
turns (mask 0, exact tokens by :func:`agentloop.tokenization.encode_new_turns`) and its moves as
sampled turns (mask 1; the decoded text is the move, as TextArena hands an LLM agent's answer to
``step``). The loop asks the game whose turn it is, generates that seat's move, plays it, and
repeats until the game is over, a seat reaches ``env.max_turns`` moves or its response budget.
It returns a :class:`MultiTrajectoryAgentLoopOutput`: trajectory ``i`` is seat ``i``
(``trajectory_index`` = player id, one ``session_id`` per game), each with the game's own reward
for that seat as ``reward_score`` and ``reward_to="last"``, so no seat gets another's reward.
A game the loop stopped has no result: every seat's ``reward_score`` is None and
``extra_fields["game_done"]`` is False. A game that raises, or does not answer within
``env.step_timeout``, fails the sample with an error naming the game.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from uuid import uuid4

from omegaconf import DictConfig

from agentloop.batch.routed_experts import RoutedExpertsTrace
from agentloop.config import EnvConfig, MultiTurnConfig
from agentloop.envs.base import Message
from agentloop.envs.textarena import (
    GameError,
    GameResult,
    TextArenaConfig,
    TextArenaGame,
    prompt_prefix,
    selfplay_game,
)
from agentloop.loops.base import AgentLoopBase, config_values, register
from agentloop.loops.prompt import apply_chat_template, fit_prompt
from agentloop.tokenization import encode_new_turns
from agentloop.trace import span as trace_span
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    MultiTrajectoryAgentLoopOutput,
    RolloutStatus,
    StopReason,
)

_T = TypeVar("_T")
_CUT = {StopReason.ABORTED: RolloutStatus.ABORTED, StopReason.LENGTH: RolloutStatus.LENGTH}


@dataclass
class Seat:
    """One player's trajectory as it grows."""

    player_id: int
    messages: list[Message]
    request_id: str = field(default_factory=lambda: uuid4().hex)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    moves: int = 0
    observations: int = 0
    """User turns after the prompt."""
    prompt_truncated: int = 0
    steps: dict[str, int | None] = field(
        default_factory=lambda: {"min_global_steps": None, "max_global_steps": None})
    """The weight versions that sampled the seat's moves (verl's min/max_global_steps)."""
    status: RolloutStatus = RolloutStatus.STOP
    metrics: AgentLoopMetrics = field(default_factory=AgentLoopMetrics)
    routing: RoutedExpertsTrace = field(default_factory=RoutedExpertsTrace)  # routing replay

    @property
    def started(self) -> bool:
        """The seat has its prompt (it has been asked to move)."""
        return bool(self.prompt_ids)

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        """Add response ids: sampled (mask 1) with their log-probs and weight versions, or not
        (mask 0)."""
        self.response_ids += ids
        self.response_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)


@register("textarena_selfplay")
class TextArenaSelfPlayLoop(AgentLoopBase):
    """Self-play of a TextArena game: one trajectory per seat (module docstring).

    Args:
        *args: :class:`AgentLoopBase`'s.
        **kwargs: the registry entry's :class:`~agentloop.envs.textarena.TextArenaConfig` keys
            (``env_id``, ``num_players``, ``seed``, ``observation``, ``env_kwargs``) are the
            defaults of every game; a sample's ``extra_info.env`` mapping overrides them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = TextArenaConfig.__dataclass_fields__
        self.defaults = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        super().__init__(*args, **kwargs)
        values = config_values(self.rollout_config, "textarena_selfplay", _loop_values)
        self.env: EnvConfig = values["env"]
        self.max_turns: int | None = self.env.max_turns
        self.step_timeout: float | None = self.env.step_timeout
        self.return_messages: bool = values["return_messages"]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any
                  ) -> MultiTrajectoryAgentLoopOutput:
        """Play one game (module docstring).

        Raises:
            ConfigError: the sample's game config is bad, or textarena is missing.
            GameError: the game raised or timed out (the worker makes it an error row).
        """
        label, config = selfplay_game(kwargs, self.env, self.defaults)
        game = await asyncio.to_thread(TextArenaGame, config)  # the first one imports textarena
        self.sampling_params = dict(sampling_params)
        players = config.num_players or 2
        await self._call(game, "reset", game.reset, players)
        prefix = prompt_prefix(kwargs)
        seats = [Seat(player_id=i, messages=[dict(m) for m in prefix]) for i in range(players)]
        while True:
            player_id, text = await self._call(game, "get_observation", game.observe)
            seat = seats[player_id]
            if self.max_turns is not None and seat.moves >= self.max_turns:
                seat.status = RolloutStatus.MAX_TURNS
                break
            if not self._observe(seat, text):
                break
            move = await self._move(seat)
            if move is None:
                break
            with trace_span("game_step", inputs={"env_id": config.env_id, "player": player_id,
                                                 "move": move[:500]}) as s:
                done = await self._call(game, "step", game.step, move)
                s.outputs = {"done": done}
            if done:
                break
        result = await self._call(game, "close", game.result)
        return MultiTrajectoryAgentLoopOutput(
            trajectories=[self._output(seat, result, config, label) for seat in seats],
            reward_to="last",
        )

    async def _call(self, game: TextArenaGame, name: str, fn: Callable[..., _T], *args: Any
                    ) -> _T:
        """``fn(*args)`` in a thread, within ``env.step_timeout``.

        Raises:
            GameError: the game raised, or did not answer in time.
        """
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.step_timeout)
        except asyncio.TimeoutError:
            raise GameError(
                f"textarena game {game.config.env_id!r} did not answer {name} within "
                f"env.step_timeout={self.step_timeout}s"
            ) from None

    def _observe(self, seat: Seat, text: str) -> bool:
        """Add an observation: the seat's prompt on its first turn, else a user turn (exact ids,
        mask 0). False (status ``length``) when the turn leaves no room in the budget."""
        message = {"role": "user", "content": text}
        if not seat.started:
            seat.messages.append(message)
            ids = apply_chat_template(self.tokenizer, seat.messages, add_generation_prompt=True,
                                      **self.apply_chat_template_kwargs)
            seat.prompt_ids, seat.prompt_truncated = fit_prompt(ids, self.prompt_length,
                                                                self.prompt_truncation)
            return True
        system = seat.messages[0] if seat.messages[0]["role"] == "system" else None
        ids = encode_new_turns(self.tokenizer, [message], system=system,
                               previous=seat.messages[-1],
                               chat_template_kwargs=self.apply_chat_template_kwargs)
        if len(seat.response_mask) + len(ids) >= self.response_length:
            seat.status = RolloutStatus.LENGTH
            return False
        seat.messages.append(message)
        seat.append(ids, sampled=False)
        seat.observations += 1
        return True

    async def _move(self, seat: Seat) -> str | None:
        """Sample the seat's move; its text, or None when the generation was cut (status
        ``length`` / ``aborted``: the game stops there)."""
        start, prompt = time.perf_counter(), seat.prompt_ids + seat.response_ids
        out = await self.server_manager.generate(
            request_id=seat.request_id, prompt_ids=prompt,
            sampling_params={**self.sampling_params, **seat.routing.request(prompt),
                             "max_tokens": self.response_length - len(seat.response_mask)},
        )
        seat.metrics.generate_sequences += time.perf_counter() - start
        seat.routing.add(prompt, out)
        for key, pick in (("min_global_steps", min), ("max_global_steps", max)):
            value, old = out.extra_fields.get(key), seat.steps[key]
            if value is not None:
                seat.steps[key] = value if old is None else pick(old, value)
        if out.num_preempted and out.num_preempted > 0:
            seat.metrics.num_preempted = max(seat.metrics.num_preempted, 0) + out.num_preempted
        seat.append(out.token_ids, sampled=True, logprobs=out.log_probs,
                    versions=out.extra_fields.get("weight_versions"))
        seat.moves += 1
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        seat.messages.append({"role": "assistant", "content": text})
        cut = _CUT.get(out.stop_reason)
        if cut is None and len(seat.response_mask) >= self.response_length:
            cut = RolloutStatus.LENGTH
        if cut is not None:
            seat.status = cut
            return None
        return str(text)

    def _output(self, seat: Seat, result: GameResult, config: TextArenaConfig, label: str
                ) -> AgentLoopOutput:
        """The seat's trajectory; a seat that never moved has its prompt (the sample's
        ``raw_prompt``) and no response."""
        if not seat.started:
            seat.prompt_ids, seat.prompt_truncated = fit_prompt(
                apply_chat_template(self.tokenizer, seat.messages, add_generation_prompt=True,
                                    **self.apply_chat_template_kwargs) if seat.messages else [],
                self.prompt_length, self.prompt_truncation,
            )
        n = self.response_length
        rewards = result.rewards
        return AgentLoopOutput(
            prompt_ids=seat.prompt_ids, response_ids=seat.response_ids[:n],
            response_mask=seat.response_mask[:n],
            response_logprobs=seat.logprobs[:n] if self.sampling_params.get("logprobs") else None,
            response_weight_versions=(seat.versions[:n] if any(v >= 0 for v in seat.versions)
                                      else None),
            routed_experts=seat.routing.rows_for(seat.prompt_ids, seat.response_ids[:n]),
            num_turns=1 + seat.moves + seat.observations,
            metrics=seat.metrics,
            reward_score=None if rewards is None else rewards.get(seat.player_id),
            status=seat.status,
            extra_fields={
                "env": label, "player_id": seat.player_id, "env_id": config.env_id,
                "prompt_truncated": seat.prompt_truncated, "num_tool_calls": 0, **seat.steps,
                **result.fields(seat.player_id),
                **({"messages": list(seat.messages)} if self.return_messages else {}),
            },
        )


def _loop_values(rollout: DictConfig) -> dict[str, Any]:
    return {"env": EnvConfig.from_rollout(rollout),
            "return_messages": MultiTurnConfig.from_rollout(rollout).return_messages}
