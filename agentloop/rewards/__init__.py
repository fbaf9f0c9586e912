"""Rewards: verl-style scorers, the rule that gives each trajectory its ``reward_score``, and its
columns.

* :mod:`agentloop.rewards.loader` — the ``custom_reward_function`` config block and loading its
  function.
* :mod:`agentloop.rewards.scoring` — :class:`TrajectoryScorer`, called by the worker when a
  trajectory ends (the rule combining the custom function, the loop's own score and tool step
  rewards).
* :mod:`agentloop.rewards.episode` — ``multi_turn.reward_to``: how a sample with several
  trajectories spreads its final trajectory's reward over them (docs/context.md).
* :mod:`agentloop.rewards.columns` — ``rm_scores`` / ``reward_valid`` / ``reward_error`` of a batch.
* Built-in ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
  scorers: :mod:`agentloop.rewards.calculator` ("The answer is N."), :mod:`agentloop.rewards.gsm8k`
  (``#### N``).
* Gateway reward functions (``reward_fn(messages, **sample_fields)``): :func:`final_answer_match`.

See the "Rewards" section of docs/concepts.md.
"""

from agentloop.rewards.conversation import final_answer_match, ground_truth
from agentloop.rewards.episode import EpisodeRewardConfig, reward_shares
from agentloop.rewards.loader import RewardFunctionConfig, load_reward_function
from agentloop.rewards.scoring import TrajectoryScorer, parse_result, tool_reward_sum

__all__ = [
    "EpisodeRewardConfig", "RewardFunctionConfig", "TrajectoryScorer", "final_answer_match",
    "ground_truth", "load_reward_function", "parse_result", "reward_shares", "tool_reward_sum",
]
