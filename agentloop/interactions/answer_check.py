"""AnswerCheckInteraction: checks "The answer is N." against ``interaction_kwargs.ground_truth``.

Correct → score 1.0 and the conversation ends.  Otherwise the user says so and asks again, up to
``config.max_attempts`` (default 2) attempts; then it ends with score 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.interactions.base import BaseInteraction

_ANSWER = re.compile(r"answer is\s*(-?[\d,]+(?:\.\d+)?)", re.IGNORECASE)


class AnswerCheckInteraction(BaseInteraction):
    """A strict grader playing the user."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.max_attempts = int(self.config.get("max_attempts", 2))
        self._state: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._state[instance_id] = {
            "truth": str(kwargs.get("ground_truth", "")), "attempts": 0, "score": 0.0,
        }
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._state[instance_id]
        state["attempts"] += 1
        last = next(
            (m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), ""
        )
        found = _ANSWER.findall(last if isinstance(last, str) else "")
        if found and found[-1].replace(",", "") == state["truth"]:
            state["score"] = 1.0
            return True, "Correct.", 1.0, {}
        if state["attempts"] >= self.max_attempts:
            return True, "That is not right.", 0.0, {}
        return False, "That is not right. Check your work and answer as 'The answer is N.'", 0.0, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        state = self._state.get(instance_id or "")
        return float(state["score"]) if state is not None else 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        self._state.pop(instance_id or "", None)
