"""Gsm8kTool: the model submits its final GSM8K answer and gets it checked, with a reward.

The ground truth comes per sample through ``tools_kwargs`` (verl's ``gsm8k_tool_agent_loop`` data
shape; ``create`` raises ValueError when it is missing or holds no number).  :func:`extract_answer`
parses the submitted number; ``execute``'s step reward is 1.0 for a correct first submission, else
0.0, and a later submission that does not improve gets ``config.no_improvement_reward``;
``calc_reward`` is the instance's best score.  Spec: docs/tools.md#gsm8ktool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any
from uuid import uuid4

from agentloop.tools.base import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

GSM8K_TOOL_DICT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "Submit your final answer to the math word problem to have it checked.",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {
                    "type": "string",
                    "description": "The final answer as a number, e.g. 72 (no units)",
                },
            },
            "required": ["answer"],
        },
    },
}
GSM8K_SCHEMA = OpenAIFunctionToolSchema.model_validate(GSM8K_TOOL_DICT)

# A number: optional sign (not right after a word character, so "5-3" is not "-3"), optional "$",
# then digits with optional thousands separators and decimals.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-)?\$?\s?(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_MARKER = "####"


def extract_answer(text: str) -> Decimal | None:
    """The final number of ``text`` (docs/tools.md#gsm8ktool), or None when there is none."""
    if _MARKER in text:
        match = _NUMBER.search(text.rsplit(_MARKER, 1)[1])
    else:
        matches = list(_NUMBER.finditer(text))
        match = matches[-1] if matches else None
    if match is None:
        return None
    try:
        value = Decimal(match.group("num").replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the pattern only matches valid decimals
        return None
    return -value if match.group("sign") else value


def format_decimal(value: Decimal) -> str:
    """``Decimal`` as plain text without exponent or trailing zeros (``1234.50`` → ``1234.5``)."""
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "") else text


@dataclass
class _Instance:
    """One trajectory's state."""

    ground_truth: Decimal
    best: float = 0.0
    submissions: int = 0


class Gsm8kTool(BaseTool):
    """``calc_gsm8k_reward(answer)`` → whether the answer is correct, with a step reward.

    Config keys: ``no_improvement_reward`` (default -0.05).
    """

    def __init__(
        self, config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | None = None,
    ):
        super().__init__(config or {}, tool_schema or GSM8K_SCHEMA)
        self.no_improvement_reward = float(self.config.get("no_improvement_reward", -0.05))
        self._instances: dict[str, _Instance] = {}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """Store the ground truth: ``create(create_kwargs={"ground_truth": x})`` or
        ``create(iid, ground_truth=x)``."""
        ground_truth = self.create_kwargs(kwargs).get("ground_truth")
        if ground_truth is None:
            raise ValueError(
                f"{self.name}: no ground truth; give it in "
                f"tools_kwargs.{self.name}.create_kwargs."
                "ground_truth"
            )
        truth = extract_answer(str(ground_truth))
        if truth is None:
            raise ValueError(
                f"{self.name}: the ground truth {str(ground_truth)[:80]!r} contains no number"
            )
        instance_id = instance_id or uuid4().hex
        self._instances[instance_id] = _Instance(ground_truth=truth)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Check ``parameters["answer"]``; returns (verdict text, step reward, metrics)."""
        state = self._instances.get(instance_id)
        if state is None:
            raise KeyError(f"{self.name}: unknown instance {instance_id!r}; call create() first")
        answer = parameters.get("answer")
        value = None if answer is None else extract_answer(str(answer))
        score = 1.0 if value is not None and value == state.ground_truth else 0.0
        first = state.submissions == 0
        step = score if first or score > state.best else self.no_improvement_reward
        state.submissions += 1
        state.best = max(state.best, score)
        if value is None:
            text = (
                f"No number found in the answer {str(answer)[:80]!r}; give the final "
                f"answer as a number."
            )
        else:
            verdict = "correct" if score == 1.0 else "incorrect"
            text = f"Parsed answer: {format_decimal(value)}. The answer is {verdict}."
        return ToolResponse(text=text), step, {"score": score, "parsed": value is not None}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The best score of the instance (0.0 when unknown or released)."""
        state = self._instances.get(instance_id)
        return state.best if state is not None else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""
        self._instances.pop(instance_id, None)
