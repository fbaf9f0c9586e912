"""Reading numeric answers out of text, shared by the built-in scorers.

Numbers are compared as exact decimals (``Decimal``), so ``72``, ``72.0``, ``$72`` and ``72.`` are
the same answer and ``1,234`` is ``1234``; the parsing itself is
:func:`agentloop.tools.gsm8k.extract_answer`'s.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from agentloop.tools.gsm8k import extract_answer

_STATED = re.compile(
    r"answer " r"is\s*:?\s*(?P<sign>-?)\s*\$?\s*(?P<sign2>-?)(?P<num>\d[\d,]*(?:\.\d+)?|\.\d+)",
    re.IGNORECASE,
)


def stated_answer(text: str) -> Decimal | None:
    """The number of the last "the answer is N" in ``text`` (case-insensitive), or None when
    there is none."""
    matches = list(_STATED.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    try:
        value = Decimal(last.group("num").replace(",", ""))
    except InvalidOperation:
        return None
    return -value if last.group("sign") or last.group("sign2") else value


def truth_number(ground_truth: Any, scorer: str) -> Decimal:
    """The number a ground truth holds (``"72"``, ``72``, or a GSM8K solution ending in
    ``#### 72``).

    Raises:
        ValueError: the ground truth is missing or holds no number (a data bug, reported as the
        row's
            ``reward_error`` rather than scored 0).
    """
    if ground_truth is None:
        raise ValueError(
            f"{scorer}: no ground truth; put it in the sample's reward_model.ground_truth"
        )
    value = extract_answer(str(ground_truth))
    if value is None:
        raise ValueError(
            f"{scorer}: the ground truth {str(ground_truth)[:80]!r} contains no number"
        )
    return value
