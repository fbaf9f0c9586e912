"""FollowUpInteraction: a user who asks several arithmetic questions in a row (the context-window
example).

``interaction_kwargs``: ``questions`` (the follow-up questions, asked one by one after each answer)
and ``answers`` (the right answer to the first question, then to each follow-up, as strings).  Each
answer "The answer is N." scores 1.0 or 0.0 as a turn score; the conversation's score is the
fraction answered right.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.interactions.base import BaseInteraction

_ANSWER = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


class FollowUpInteraction(BaseInteraction):
    """Asks the next question after every answer; ends after the last one."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._state: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._state[instance_id] = {
            "questions": list(kwargs.get("questions") or []),
            "answers": [str(a) for a in kwargs.get("answers") or []], "right": [],
        }
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._state[instance_id]
        last = (
            messages[-1].get("content") if messages and messages[-1]["role"] == "assistant" else ""
        )
        found = _ANSWER.findall(last if isinstance(last, str) else "")
        k = len(state["right"])
        right = float(
            bool(found) and k < len(state["answers"]) and found[-1] == state["answers"][k]
        )
        state["right"].append(right)
        if k >= len(state["questions"]):
            return True, "Thanks.", right, {}
        return False, state["questions"][k], right, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        right = self._state.get(instance_id or "", {}).get("right") or [0.0]
        return sum(right) / len(right)

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        self._state.pop(instance_id or "", None)
