"""The episode reward rule: which trajectories of a multi-trajectory sample get the episode's
reward.

A sample whose loop returns k > 1 trajectories is one episode; its reward ``E`` is the final
trajectory's (its own ``reward_score``, else the configured function's score of it;
:mod:`agentloop.rewards.scoring`). :func:`reward_shares` gives each trajectory's share of ``E`` by
``multi_turn.reward_to``: ``all`` (1 each, the default), ``last`` (0 except the final) or
``discounted`` (``reward_gamma ** (k - 1 - i)``); :class:`EpisodeRewardConfig` reads and checks the
two keys (both raise :class:`~agentloop.errors.ConfigError` for a bad value).  Spec:
docs/context.md#rewards-across-trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from agentloop.config.build import read_value
from agentloop.config.checks import REWARD_TO_MODES, check_reward_gamma, check_reward_to
from agentloop.config.schema import MultiTurnConfig
from agentloop.errors import ConfigError
from agentloop.types import RewardTo

DEFAULT_GAMMA: float = read_value(None, "actor_rollout_ref.rollout.multi_turn.reward_gamma")
"""What a null ``reward_gamma`` means (the YAML's value, 0.9)."""


@dataclass(frozen=True)
class EpisodeRewardConfig:
    """``multi_turn.reward_to`` and ``multi_turn.reward_gamma``, checked."""

    reward_to: RewardTo = "all"
    reward_gamma: float = DEFAULT_GAMMA

    @classmethod
    def from_config(cls, root: Any) -> EpisodeRewardConfig:
        """Read the keys from a trainer-shaped config (``actor_rollout_ref.rollout.multi_turn``);
        absent keys take the defaults.

        Raises:
            ConfigError: ``reward_to`` is not all | last | discounted, or ``reward_gamma`` is not in
            [0, 1].
        """
        multi_turn = MultiTurnConfig.from_root(root)
        return cls.checked(multi_turn.reward_to, multi_turn.reward_gamma)

    @classmethod
    def checked(
        cls, reward_to: Any, reward_gamma: Any, where: str = "multi_turn"
    ) -> EpisodeRewardConfig:
        """Validate the two values (None takes the default)."""
        check_reward_to(reward_to, where)
        check_reward_gamma(reward_gamma, where)
        mode = "all" if reward_to is None else reward_to
        gamma = DEFAULT_GAMMA if reward_gamma is None else reward_gamma
        return cls(reward_to=cast(RewardTo, mode), reward_gamma=float(gamma))


def reward_shares(
    num_trajectories: int, reward_to: str, gamma: float = DEFAULT_GAMMA
) -> list[float]:
    """The factor of the episode reward each of ``num_trajectories`` trajectories gets, in order.

    >>> reward_shares(3, "all"), reward_shares(3, "last"), reward_shares(3, "discounted", 0.5)
    ([1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.25, 0.5, 1.0])
    """
    k = num_trajectories
    if reward_to == "all":
        return [1.0] * k
    if reward_to == "last":
        return [0.0] * (k - 1) + [1.0] if k else []
    if reward_to == "discounted":
        return [float(gamma) ** (k - 1 - i) for i in range(k)]
    raise ConfigError(f"reward_to must be one of {' | '.join(REWARD_TO_MODES)}, got {reward_to!r}")


__all__ = ["DEFAULT_GAMMA", "REWARD_TO_MODES", "EpisodeRewardConfig", "reward_shares"]
