"""A context-editing tool for the example and its real-engine test: the calculator, which on every
call replaces the conversation from the first question up to the calling turn by a one-line summary
(the current question and the earlier calculator results).

Tool YAML (``examples/context_window/forgetful_tools.yaml``)::

    tools:
      - class_name: examples.context_window.forgetful.ForgetfulCalculatorTool
        config: {type: native}

It has the calculator's name and schema (the tiny model calls ``calculator``), so any calculator
rollout turns into one whose tool edits the context: ``tool_agent`` closes a snapshot at each edit
(source (a) of docs/context.md).
"""

from __future__ import annotations

from typing import Any

from agentloop.tools.calculator import CalculatorTool
from agentloop.tools.context_tools import ContextEdit, current_messages, request_context_edit
from agentloop.tools.schemas import ToolResponse


class ForgetfulCalculatorTool(CalculatorTool):
    """``calculator`` that compacts the conversation on every call: everything from the first user
    message up to the calling turn becomes one summary message (the current question and the earlier
    calculator results)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        response, reward, info = await super().execute(instance_id, parameters, **kwargs)
        messages = current_messages()
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        # the calling turn itself stays
        start, stop = (users[0], len(messages) - 1) if users else (0, 0)
        if stop > start:
            results = [
                str(m.get("content", "")) for m in messages[start:stop] if m["role"] == "tool"
            ]
            summary = f"the user asked: {messages[users[-1]].get('content', '')}"
            if results:
                summary += f"; earlier calculator results: {', '.join(results)}"
            request_context_edit(ContextEdit.summarize(start, stop, summary))
        return response, reward, info
