"""Shared helpers of the Responses dialect tests (test_gateway_responses*.py): parse / refuse a
body, scripted turn results, and a rendered stream checked for SSE framing and the openai SDK's
event union."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from agentloop.gateway.dialects.responses import DIALECT
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.store import canonical_message
from agentloop.gateway.turn import TurnEvent, TurnRequest, TurnResult

CALC = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}
"""A flat Responses function tool."""
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def parse(body: dict[str, Any], state: dict[str, Any] | None = None) -> TurnRequest:
    return DIALECT.parse(body, {} if state is None else state)


def refused(body: Any, state: dict[str, Any] | None = None) -> GatewayHTTPError:
    with pytest.raises(GatewayHTTPError) as info:
        DIALECT.parse(body, {} if state is None else state)
    assert info.value.status == 400
    assert set(DIALECT.error_body(info.value)["error"]) >= {"message", "type", "param", "code"}
    return info.value


def call(call_id: str, name: str = "calculator",
         args: str = '{"expression": "2+3"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def result(content: str | None = "", *, calls: tuple[dict[str, Any], ...] = (),
           reasoning: str | None = None, finish: str | None = None) -> TurnResult:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    if reasoning:
        message["reasoning_content"] = reasoning
    finish = finish or ("tool_calls" if calls else "stop")
    return TurnResult(message=message, finish_reason=finish, prompt_tokens=12, completion_tokens=7)


async def events_of(items: list[TurnEvent | Exception]) -> AsyncIterator[TurnEvent]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def stream(request: TurnRequest, items: list[Any], state: dict[str, Any] | None = None
           ) -> list[dict[str, Any]]:
    """The streamed events as dicts; checks the SSE framing and the SDK's event union."""

    async def collect() -> list[str]:
        gen = DIALECT.render_stream(events_of(items), request, {} if state is None else state)
        return [line async for line in gen]

    events = []
    for n, chunk in enumerate(asyncio.run(collect())):
        head, data, *rest = chunk.split("\n")
        assert rest == ["", ""] and head.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and event["sequence_number"] == n
        STREAM_EVENT.validate_python(event)
        events.append(event)
    return events


def canon(messages: list[dict[str, Any]]) -> list[Any]:
    return [canonical_message(m) for m in messages]
