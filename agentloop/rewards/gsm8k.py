"""Outcome reward for GSM8K, with verl's ``#### N`` answer format.

``method`` (pass it through ``custom_reward_function.reward_kwargs``):

* ``flexible`` (default): the number after the last ``####`` when the response has one, else the
  last number in the response (:func:`agentloop.tools.gsm8k.extract_answer`);
* ``strict``: only a number after ``####`` counts; a response without the marker scores 0.

The score is ``score`` (1.0) when the extracted number equals the ground truth, ``format_score``
(0.0) when a number was found but is wrong, and 0.0 when none was found (verl's rule).  Differences
from verl's ``verl.utils.reward_score.gsm8k``: numbers compare as decimals (``72.0`` equals ``72``,
verl compares strings), the whole response is read (verl reads its last 300 characters), and
``flexible`` prefers a ``####`` answer over a later number.  Use it as verl's custom reward
function::

    custom_reward_function:
      path: agentloop.rewards.gsm8k
      name: compute_score
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from agentloop.rewards.answers import truth_number
from agentloop.tools.gsm8k import extract_answer

_METHODS = ("flexible", "strict")
_STRICT = re.compile(r"####\s*(?P<sign>-?)\s*\$?\s*(?P<num>\d[\d,]*(?:\.\d+)?)")


def _strict_answer(text: str) -> Decimal | None:
    """The number right after the last ``####`` that is followed by one (verl's strict pattern)."""
    matches = list(_STRICT.finditer(text))
    if not matches:
        return None
    value = Decimal(matches[-1].group("num").replace(",", ""))
    return -value if matches[-1].group("sign") else value


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any,
    extra_info: dict[str, Any] | None = None, *, method: str = "flexible",
    format_score: float = 0.0, score: float = 1.0, **kwargs: Any,
) -> float:
    """``score`` for a correct final answer, ``format_score`` for a wrong one, 0.0 for none (see the
    module).

    Raises:
        ValueError: ``method`` is not ``flexible`` / ``strict``, or ``ground_truth`` is missing or
        holds no
            number (the row gets ``reward_valid = 0``).
    """
    if method not in _METHODS:
        raise ValueError(
            f"gsm8k.compute_score: method={method!r}; use one of {', '.join(_METHODS)}"
        )
    truth = truth_number(ground_truth, "gsm8k.compute_score")
    found = _strict_answer(solution_str) if method == "strict" else extract_answer(solution_str)
    if found is None:
        return 0.0
    return float(score) if found == truth else float(format_score)
