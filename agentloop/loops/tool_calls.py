"""Running the tool calls of one assistant turn.

Every call the policy made gets exactly one tool message back, in order:

* an unknown tool → an error naming the available tools;
* a malformed call (parser ``error``) → ``Error: <why>``;
* a call beyond ``max_parallel_calls`` → an error saying the limit (verl drops these silently);
* a tool that raises or exceeds its timeout (its ``config.timeout``, else ``tool_timeout``) → an error
  with the exception or the timeout;
* otherwise the tool's text, truncated to ``max_tool_response_length`` characters
  (``left``: keep the start; ``right``: keep the end; anything else: keep both ends).

``create`` / ``execute`` / ``release`` run per call; ``release`` always runs.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from agentloop.parsers.base import FunctionCall
from agentloop.tools.base import BaseTool


@dataclass
class ToolTurnResult:
    """The tool messages of one turn and what happened."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    num_errors: int = 0
    num_parse_errors: int = 0
    num_dropped: int = 0
    num_timeouts: int = 0


def truncate(text: str, limit: int, side: str) -> str:
    """verl's truncation of long tool responses (limit in characters)."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


@dataclass
class ToolRunner:
    """Executes calls against a fixed tool set with the configured limits."""

    tools: dict[str, BaseTool]
    max_parallel_calls: int = 1
    max_response_length: int = 256
    truncate_side: str = "middle"
    timeout: float | None = 30.0

    async def run_turn(self, calls: list[FunctionCall], tools_kwargs: dict[str, Any] | None) -> ToolTurnResult:
        """One tool message per call, in call order."""
        result = ToolTurnResult()
        jobs = []
        for i, call in enumerate(calls):
            if call.name and call.name not in self.tools:
                result.num_errors += 1
                jobs.append(_text(f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}"))
            elif call.error is not None:
                result.num_parse_errors += 1
                jobs.append(_text(f"Error: could not parse the tool call: {call.error}"))
            elif i >= self.max_parallel_calls:
                result.num_dropped += 1
                jobs.append(_text(f"Error: at most {self.max_parallel_calls} tool call(s) per turn; "
                                  f"call {i + 1} ({call.name}) was not executed"))
            else:
                jobs.append(self._execute(call, (tools_kwargs or {}).get(call.name) or {}, result))
        outputs = await asyncio.gather(*jobs)
        for call, (text, images) in zip(calls, outputs, strict=True):
            text = truncate(text, self.max_response_length, self.truncate_side)
            content: Any = text
            if images:
                result.images.extend(images)
                content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
            result.messages.append({"role": "tool", "content": content, "tool_call_id": call.id, "name": call.name})
        return result

    async def _execute(
        self, call: FunctionCall, kwargs: dict[str, Any], result: ToolTurnResult
    ) -> tuple[str, list[Any]]:
        tool = self.tools[call.name]
        instance_id = None
        timeout = tool.config.get("timeout", self.timeout)  # the tool's own limit (YAML config.timeout) wins
        try:
            instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
            args = json.loads(call.arguments)
            coro = tool.execute(instance_id, args, **kwargs.get("execute_kwargs", {}))
            response, reward, _ = await (asyncio.wait_for(coro, timeout) if timeout else coro)
            result.rewards.append(float(reward))
            return response.text or "", list(response.image or [])
        except asyncio.TimeoutError:
            result.num_timeouts += 1
            result.num_errors += 1
            return f"Error: tool {call.name!r} timed out after {timeout}s", []
        except Exception as e:  # noqa: BLE001 - a failing tool is reported to the model
            result.num_errors += 1
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}", []
        finally:
            if instance_id is not None:
                await tool.release(instance_id)


async def _text(text: str) -> tuple[str, list[Any]]:
    return text, []
