"""Built-in reward functions for trajectories recorded by the gateway (``reward_fn`` of ``openai_agent``).

Signature: ``reward_fn(messages, **sample_fields) -> float``, where ``messages`` is the trajectory's
conversation (OpenAI dicts, assistant turns included) and ``sample_fields`` the sample's non-tensor
fields (``reward_model``, ``extra_info``, ...).
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"answer is\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)


def ground_truth(fields: dict[str, Any]) -> str | None:
    """``reward_model.ground_truth`` (verl's dataset layout), else ``extra_info.answer``."""
    rm = fields.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return str(rm["ground_truth"])
    extra = fields.get("extra_info")
    if isinstance(extra, dict) and extra.get("answer") is not None:
        return str(extra["answer"])
    return None


def final_answer_match(messages: list[dict[str, Any]], **fields: Any) -> float:
    """1.0 when the last assistant message says "the answer is N" with N equal to the ground truth."""
    truth = ground_truth(fields)
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if truth is None or last is None:
        return 0.0
    found = _ANSWER.findall(str(last.get("content") or ""))
    if not found:
        return 0.0
    try:
        return float(float(found[-1].replace(",", "")) == float(truth.replace(",", "")))
    except ValueError:
        return 0.0
