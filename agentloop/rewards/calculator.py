"""Outcome reward for the calculator task (the tiny model's arithmetic word problems).

The policy ends its trajectory with "The answer is N."; the score is 1.0 when the last such
statement in the response equals ``ground_truth`` as a number, else 0.0.  Use it as verl's custom
reward function::

    custom_reward_function:
      path: agentloop.rewards.calculator
      name: compute_score
"""

from __future__ import annotations

from typing import Any

from agentloop.rewards.answers import stated_answer, truth_number


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any,
    extra_info: dict[str, Any] | None = None, **kwargs: Any,
) -> float:
    """1.0 when the last "The answer is N" of ``solution_str`` equals ``ground_truth``, else 0.0.

    Raises:
        ValueError: ``ground_truth`` is missing or holds no number (the row gets
        ``reward_valid = 0``).
    """
    truth = truth_number(ground_truth, "calculator.compute_score")
    found = stated_answer(solution_str)
    return float(found is not None and found == truth)
