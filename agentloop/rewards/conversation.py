"""Reward functions for conversations recorded by the gateway (``reward_fn`` of ``openai_agent``).

Signature: ``reward_fn(messages, **sample_fields) -> float``, where ``messages`` is the trajectory's
conversation (OpenAI dicts, assistant turns included) and ``sample_fields`` the sample's non-tensor
fields (``reward_model``, ``extra_info``, ...).
"""

from __future__ import annotations

from typing import Any

from agentloop.rewards.answers import stated_answer
from agentloop.tools.gsm8k import extract_answer


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
    """1.0 when the last assistant message says "the answer is N" with N equal to the ground
    truth."""
    truth = ground_truth(fields)
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if truth is None or last is None:
        return 0.0
    found = stated_answer(str(last.get("content") or ""))
    expected = extract_answer(truth)
    return float(found is not None and expected is not None and found == expected)
