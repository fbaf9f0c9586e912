"""Running the tool calls of one assistant turn.

:class:`ToolRunner` gives every call the policy made exactly one tool message back, in order: the
tool's text (truncated to ``max_tool_response_length``), or an error message for an unknown tool, a
malformed call, a call beyond ``max_parallel_calls``, an exception or a timeout; it never raises for
a tool's failure.  ``create`` / ``execute`` / ``release`` run per call, each bounded by the tool's
own timeout or ``multi_turn.tool_timeout``; ``release`` always runs.  Spec:
docs/tools.md#the-tool_agent-loop (Tools).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentloop.errors import ConfigError
from agentloop.parsers.base import FunctionCall
from agentloop.tools.base import BaseTool
from agentloop.tools.executor import tool_executor
from agentloop.tools.function_tool import FunctionTool
from agentloop.trace import span as trace_span
from agentloop.utils.deadline import within

logger = logging.getLogger(__name__)


@dataclass
class ToolTurnResult:
    """The tool messages of one turn and what happened."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """Each message's full text, before truncation (to cut it again shorter, see
    :meth:`limited`)."""
    rewards: list[float] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    num_errors: int = 0
    num_parse_errors: int = 0
    num_dropped: int = 0
    num_timeouts: int = 0

    def limited(self, limit: int, side: str) -> list[dict[str, Any]]:
        """The messages with every text truncated to ``limit`` characters (see :func:`truncate`)."""
        return [
            _with_text(m, truncate(t, limit, side))
            for m, t in zip(self.messages, self.texts, strict=True)
        ]


def truncate(text: str, limit: int, side: str) -> str:
    """verl's truncation of long tool responses (limit in characters; 0 = no limit)."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[len(text) - limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


def effective_timeout(tool: BaseTool, default: float | None) -> float | None:
    """Seconds one call of ``tool`` may take: its own ``config.timeout`` when set (not None), else
    ``default``; None when that is 0 or None (no limit)."""
    own = tool.config.get("timeout")
    limit = default if own is None else own
    return float(limit) if limit else None


def _check_timeout(tool: BaseTool) -> None:
    own = tool.config.get("timeout")
    if own is None:
        return
    if isinstance(own, bool) or not isinstance(own, (int, float)) or own < 0 or math.isnan(own):
        raise ConfigError(
            f"tool {tool.name!r}: config.timeout={own!r} is not a number of "
            f"seconds >= 0; set it to "
            "a number (0: no limit), or leave it out to use multi_turn.tool_timeout"
        )


@dataclass
class ToolRunner:
    """Executes calls against a fixed tool set with the configured limits."""

    tools: dict[str, BaseTool]
    max_parallel_calls: int = 1
    max_response_length: int = 256
    truncate_side: str = "middle"
    timeout: float | None = 30.0
    """The default per-call limit in seconds (a tool's own ``config.timeout`` wins); 0 or None:
    no limit."""

    def __post_init__(self) -> None:
        """Check every tool now (not at its first call): timeouts, and sync functions vs the tool
        executor."""
        executor = tool_executor()
        for tool in self.tools.values():
            _check_timeout(tool)
            if isinstance(tool, FunctionTool) and not tool.is_async and tool.fn is not None:
                executor.check_function(tool.fn, f"tool {tool.name!r}")

    async def run_turn(
        self, calls: list[FunctionCall], tools_kwargs: dict[str, Any] | None
    ) -> ToolTurnResult:
        """One tool message per call, in call order."""
        result = ToolTurnResult()
        jobs = []
        for i, call in enumerate(calls):
            if call.name and call.name not in self.tools:
                result.num_errors += 1
                jobs.append(
                    _text(
                        f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}"
                    )
                )
            elif call.error is not None:
                result.num_parse_errors += 1
                jobs.append(_text(f"Error: could not parse the tool call: {call.error}"))
            elif i >= self.max_parallel_calls:
                result.num_dropped += 1
                jobs.append(
                    _text(
                        f"Error: at most {self.max_parallel_calls} tool call(s) "
                        f"per turn; "
                        f"call {i + 1} ({call.name}) was not executed"
                    )
                )
            else:
                jobs.append(self._execute(call, (tools_kwargs or {}).get(call.name) or {}, result))
        # one call (the common turn): awaited here, without gather's task and future
        outputs = [await jobs[0]] if len(jobs) == 1 else await asyncio.gather(*jobs)
        for call, (text, images) in zip(calls, outputs, strict=True):
            result.texts.append(text)
            content: Any = truncate(text, self.max_response_length, self.truncate_side)
            if images:
                result.images.extend(images)
                content = [*({"type": "image"} for _ in images), {"type": "text", "text": content}]
            result.messages.append(
                {"role": "tool", "content": content, "tool_call_id": call.id, "name": call.name}
            )
        return result

    async def _execute(
        self, call: FunctionCall, kwargs: dict[str, Any], result: ToolTurnResult
    ) -> tuple[str, list[Any]]:
        """Run one call; with ``rollout.trace`` on, one ``tool`` span (name, arguments, result
        head, error)."""
        errors = result.num_errors
        with trace_span("tool", inputs={"name": call.name, "arguments": call.arguments}) as s:
            text, images = await self._run_call(call, kwargs, result)
            s.outputs = {"result": text[:500], "images": len(images)}
            if result.num_errors > errors:
                s.error = text[:500]
        return text, images

    async def _run_call(
        self, call: FunctionCall, kwargs: dict[str, Any], result: ToolTurnResult
    ) -> tuple[str, list[Any]]:
        tool = self.tools[call.name]
        instance_id = None
        timeout = effective_timeout(tool, self.timeout)
        try:
            instance_id, _ = await _bounded(
                tool.create, timeout, create_kwargs=kwargs.get("create_kwargs", {})
            )
            args = json.loads(call.arguments)
            response, reward, _ = await _bounded(tool.execute, timeout, instance_id, args,
                                                 **kwargs.get("execute_kwargs", {}))
            result.rewards.append(float(reward))
            return response.text or "", list(response.image or [])
        except asyncio.TimeoutError:
            result.num_timeouts += 1
            result.num_errors += 1
            return f"Error: tool {call.name!r} timed out after {timeout:g}s", []
        except Exception as e:  # noqa: BLE001 - a failing tool is reported to the model
            result.num_errors += 1
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}", []
        finally:
            if instance_id is not None:
                await _release(tool, instance_id, timeout)


async def _bounded(
    method: Callable[..., Any], timeout: float | None, /, *args: Any, **kwargs: Any
) -> Any:
    """Await ``method(*args, **kwargs)`` within ``timeout`` seconds; a plain ``def`` runs in the
    tool thread pool."""
    sync = not _is_async(method)
    call = _in_thread(method, *args, **kwargs) if sync else method(*args, **kwargs)
    return await within(call, timeout)


_ASYNC: weakref.WeakKeyDictionary[Callable[..., Any], bool] = weakref.WeakKeyDictionary()


def _is_async(method: Callable[..., Any]) -> bool:
    """``inspect.iscoroutinefunction(method)``, remembered per function for bound methods (a tool's
    ``create`` / ``execute`` / ``release``: three checks per call otherwise)."""
    func = getattr(method, "__func__", None)
    if func is None or getattr(method, "__self__", None) is None:
        return inspect.iscoroutinefunction(method)
    known = _ASYNC.get(func)
    if known is None:
        known = _ASYNC[func] = inspect.iscoroutinefunction(method)
    return known


async def _in_thread(method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    value = await tool_executor().run_in_thread(method, *args, **kwargs)
    # a sync wrapper around an async method
    return await value if inspect.isawaitable(value) else value


async def _release(tool: BaseTool, instance_id: str, timeout: float | None) -> None:
    try:
        await _bounded(tool.release, timeout, instance_id)
    # the call's result is already decided; keep the sample going
    except Exception as e:  # noqa: BLE001
        logger.warning(
            "tool %r: release(%r) failed: %s: %s", tool.name, instance_id, type(e).__name__, e
        )


def _with_text(message: dict[str, Any], text: str) -> dict[str, Any]:
    content = message["content"]  # a string, or image parts then the text part
    text_part = (
        [*content[:-1], {"type": "text", "text": text}] if isinstance(content, list) else text
    )
    return {**message, "content": text_part}


async def _text(text: str) -> tuple[str, list[Any]]:
    return text, []


def assistant_message(content: str, calls: list[Any]) -> dict[str, Any]:
    """The chat message of an assistant turn: its content and the parsed calls
    (:class:`~agentloop.parsers.base.FunctionCall`) as OpenAI ``tool_calls``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message
