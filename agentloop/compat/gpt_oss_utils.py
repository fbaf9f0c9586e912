"""gpt-oss (harmony) helpers of verl's ``verl.experimental.agent_loop.utils``.

verl's tool agent loop formats gpt-oss tool results by hand instead of through the chat template
(the template renders a tool message only next to the assistant message that made the call).  One
result is the harmony message
``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>TEXT<|end|>``; the turn then
ends with the generation prompt ``<|start|>assistant``.  The strings are byte-for-byte verl's, so a
trajectory encodes to the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentloop.errors import ConfigError

GENERATION_PROMPT = "<|start|>assistant"
"""What the model continues after a tool turn."""


def format_gpt_oss_tool_response_manually(tool_response: str, tool_call_name: str) -> str:
    """One tool result as a harmony message from ``functions.<tool_call_name>`` to the assistant."""
    return (
        f"<|start|>functions.{tool_call_name} "
        f"to=assistant<|channel|>commentary<|message|>{tool_response}<|end|>"
    )


def add_generation_prompt_for_gpt_oss(message_content: str) -> str:
    """``message_content`` followed by the assistant's generation prompt."""
    return message_content + GENERATION_PROMPT


def build_gpt_oss_tool_response_text(
    messages: Sequence[Mapping[str, Any]], tool_call_names: Sequence[str]
) -> str:
    """A whole tool turn (verl 0.9.1): each tool message formatted with its call's name, then the
    prompt.

    ``messages[i]["content"]`` is the text of the result of the call named ``tool_call_names[i]``.
    """
    if len(tool_call_names) < len(messages):
        raise ConfigError(
            f"build_gpt_oss_tool_response_text: {len(messages)} tool messages "
            f"but only "
            f"{len(tool_call_names)} tool call names; pass one name per message"
        )
    parts = [format_gpt_oss_tool_response_manually(m["content"], name)
             for m, name in zip(messages, tool_call_names, strict=False)]
    return add_generation_prompt_for_gpt_oss("".join(parts))
