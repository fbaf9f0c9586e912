"""The OpenAI Responses API dialect (``POST /sessions/{id}/v1/responses``): the request side.

:func:`parse_responses_request` turns a Responses body into the canonical
:class:`~agentloop.gateway.turn.TurnRequest`: ``instructions`` become a leading system message,
``input`` items become chat messages (``function_call`` items merged into the assistant message
before them, ``function_call_output`` items tool messages, ``reasoning`` items the assistant's
``reasoning_content``), flat function ``tools`` chat tools, ``text.format`` the chat
``response_format``; ``previous_response_id`` prepends the stored conversation of that response
(:mod:`agentloop.gateway.dialects.responses_stream` keeps it).  Everything refused is a 400 in
OpenAI's error shape.  Rendering lives in ``responses_stream``.  Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.dialects.responses_stream import (
    error_body,
    recall,
    render,
    render_stream,
)
from agentloop.gateway.protocol import GatewayHTTPError, normalize_message
from agentloop.gateway.turn import ToolChoice, TurnRequest

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
_SERVED_ITEMS = "message, function_call, function_call_output and reasoning"


class ResponsesBody(BaseModel):
    """The request body (types and ranges only; the rules: :func:`parse_responses_request`)."""

    model_config = ConfigDict(extra="allow")

    model: str = "agentloop"
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    n: int | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)


def _bad(message: str, param: str | None = None, code: str | None = None) -> GatewayHTTPError:
    return GatewayHTTPError(400, message, param=param, code=code)


def parse_responses_request(body: Any, state: dict[str, Any]) -> TurnRequest:
    """Check a decoded Responses body and translate it (docs/gateway.md#dialects).

    Args:
        body: the decoded JSON body.
        state: this dialect's per-session dict (stored responses for ``previous_response_id``).
    Returns:
        the canonical request; ``extra`` holds what the renderer echoes and stores.
    Raises:
        GatewayHTTPError: 400 naming the offending key or input item.
    """
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = ResponsesBody.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = first["loc"]  # union members add type tags ("str", "list[any]"): keep keys, indices
        where = "body"
        if loc:
            where = ".".join([str(loc[0]), *(str(p) for p in loc[1:] if isinstance(p, int))])
        raise _bad(f"invalid request: {where}: {first['msg']}", param=where) from None
    _refuse_unsupported(req)
    tools, echo_tools = _tools(req.tools)
    tool_choice = _tool_choice(req.tool_choice, echo_tools)
    response_format, echo_text = _text_format(req.text)
    history = recall(state, req.previous_response_id)
    indexed = _input_messages(req.input)
    if not indexed:
        raise _bad("input holds no message: only reasoning items without text", param="input")
    _check_call_ids(history, indexed)
    new = [msg for _, msg in indexed]
    messages = [*history, *new]
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    return TurnRequest(
        model=req.model, messages=messages, tools=tools, sampling=_sampling(req),
        stream=bool(req.stream), tool_choice=tool_choice, response_format=response_format,
        extra=_extra(req, new, echo_tools, tool_choice, echo_text),
    )


def _refuse_unsupported(req: ResponsesBody) -> None:
    if req.background:
        raise _bad("background responses are not supported: the gateway answers in the request "
                   "(send background: false)", param="background")
    if req.n not in (None, 1):
        raise _bad(f"n={req.n} is not supported: one response per request; send n requests",
                   param="n")
    if req.truncation == "auto":
        raise _bad("truncation 'auto' is not supported: the trajectory must hold the whole "
                   "conversation (use 'disabled')", param="truncation")
    if req.conversation is not None:
        raise _bad("conversation objects are not supported; use previous_response_id or send "
                   "the items", param="conversation")
    if req.prompt is not None:
        raise _bad("stored prompt templates are not supported; send instructions and input",
                   param="prompt")
    if req.input is None or req.input == [] or req.input == "":
        raise _bad("input is required: a string or a non-empty list of items", param="input")


def _sampling(req: ResponsesBody) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req.temperature is not None:
        out["temperature"] = req.temperature
    if req.top_p is not None:
        out["top_p"] = req.top_p
    if req.max_output_tokens is not None:
        out["max_tokens"] = int(req.max_output_tokens)
    return out


def _extra(req: ResponsesBody, new: list[dict[str, Any]], echo_tools: list[dict[str, Any]],
           tool_choice: ToolChoice, echo_text: dict[str, Any]) -> dict[str, Any]:
    """What the renderer needs: ids, the fields a response echoes, what to store."""
    echo: dict[str, Any] = {
        "instructions": req.instructions, "tools": echo_tools, "tool_choice": tool_choice,
        "temperature": req.temperature, "top_p": req.top_p,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "text": echo_text, "previous_response_id": req.previous_response_id,
        "store": True if req.store is None else req.store,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "truncation": "disabled", "reasoning": req.reasoning,
    }
    return {"response_id": f"resp_{uuid.uuid4().hex}", "created_at": int(time.time()),
            "echo": echo, "new_messages": new}


# ---- tools, tool_choice, text.format -------------------------------------------------------------
def _tools(raw: list[Any] | None) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """Flat Responses function tools -> (chat tools or None, the tools a response echoes)."""
    chat: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    for i, tool in enumerate(raw or []):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}] must be an object", param=f"tools.{i}")
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"tools[{i}]: {kind!r} tools are not served; only function tools "
                       "({'type': 'function', 'name', 'parameters'}): the gateway runs no hosted "
                       "tools", param=f"tools.{i}.type")
        name, params = tool.get("name"), tool.get("parameters")
        desc, strict = tool.get("description"), tool.get("strict")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].name must be a non-empty string", param=f"tools.{i}.name")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].parameters must be a JSON schema object",
                       param=f"tools.{i}.parameters")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"tools[{i}].description must be a string", param=f"tools.{i}.description")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"tools[{i}].strict must be a boolean", param=f"tools.{i}.strict")
        fn: dict[str, Any] = {"name": name}
        fn.update({k: v for k, v in (("description", desc), ("parameters", params),
                                     ("strict", strict)) if v is not None})
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": name, "description": desc,
                     "parameters": params, "strict": strict})
    return (chat or None), echo


def _tool_choice(raw: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> ToolChoice:
    if raw is None or raw == "auto":
        return "auto"
    names = {t["name"] for t in tools}
    if raw in ("none", "required"):
        choice: ToolChoice = raw  # type: ignore[assignment]
    elif (isinstance(raw, dict) and raw.get("type") == "function"
          and isinstance(raw.get("name"), str)):
        if raw["name"] not in names:
            raise _bad(f"tool_choice names the function {raw['name']!r}, which is not in tools",
                       param="tool_choice")
        choice = {"type": "function", "name": raw["name"]}
    else:
        raise _bad(f"tool_choice={raw!r} is not supported; use 'auto', 'none', 'required' or "
                   "{'type': 'function', 'name': ...}", param="tool_choice")
    if choice == "required" and not names:
        raise _bad("tool_choice 'required' needs at least one tool", param="tool_choice")
    return choice


def _text_format(text: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``text.format`` -> (the chat ``response_format`` or None, the ``text`` a response echoes)."""
    fmt = (text or {}).get("format")
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if text and text.get("verbosity") is not None:
        echo["verbosity"] = text["verbosity"]
    if fmt is None or fmt == {"type": "text"}:
        return None, echo
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return {"type": "json_object"}, echo
    if kind != "json_schema":
        raise _bad(f"text.format must be {{'type': 'text' | 'json_object' | 'json_schema'}}, "
                   f"got {fmt!r}", param="text.format")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise _bad("text.format json_schema needs a 'name' (string) and a 'schema' (object)",
                   param="text.format")
    spec: dict[str, Any] = {"name": name, "schema": schema}
    for key, typ in (("strict", bool), ("description", str)):
        if fmt.get(key) is not None:
            if not isinstance(fmt[key], typ):
                raise _bad(f"text.format.{key} must be a {typ.__name__}",
                           param=f"text.format.{key}")
            spec[key] = fmt[key]
    echo["format"] = {"type": "json_schema", **spec}
    return {"type": "json_schema", "json_schema": spec}, echo


# ---- input items -> chat messages --------------------------------------------------------------
def _input_messages(raw: str | list[Any] | None) -> list[tuple[int, dict[str, Any]]]:
    """``input`` as canonical chat messages, each with the index of the item it starts at."""
    if isinstance(raw, str):
        return [(0, {"role": "user", "content": raw})]
    assembler = _Assembler()
    for i, item in enumerate(raw or []):
        assembler.add(item, i)
    assembler.flush()
    out = []
    for index, msg in assembler.out:
        try:
            normal = normalize_message(msg, index)
        except GatewayHTTPError as e:  # chat's check of the message: name the input item instead
            message = e.message.replace(f"messages[{index}]", f"input[{index}]")
            param = (e.param or "").replace(f"messages.{index}", f"input.{index}", 1)
            raise _bad(message, param=param if param.startswith("input.") else f"input.{index}",
                       code=e.code) from None
        if msg.get("reasoning_content"):
            normal["reasoning_content"] = msg["reasoning_content"]
        out.append((index, normal))
    return out


class _Assembler:
    """Builds chat messages from items: one assistant message gathers a reasoning item, the
    assistant text after it and the function calls after that."""

    def __init__(self) -> None:
        self.out: list[tuple[int, dict[str, Any]]] = []
        self.pending: dict[str, Any] | None = None
        self.pending_index = 0

    def flush(self) -> None:
        if self.pending is not None:
            self.out.append((self.pending_index, self.pending))
            self.pending = None

    def _assistant(self, i: int) -> dict[str, Any]:
        if self.pending is None:
            self.pending = {"role": "assistant", "content": None}
            self.pending_index = i
        return self.pending

    def add(self, item: Any, i: int) -> None:
        if not isinstance(item, dict):
            raise _bad(f"input[{i}] must be an object (an input item)", param=f"input.{i}")
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            self._message(item, i)
        elif kind == "function_call":
            self._call(item, i)
        elif kind == "function_call_output":
            self.flush()
            self.out.append((i, _call_output(item, i)))
        elif kind == "reasoning":
            self._reasoning(item, i)
        elif kind == "item_reference":
            raise _bad(f"input[{i}]: item_reference is not supported (the gateway keeps no items "
                       "by id); send the item itself or use previous_response_id",
                       param=f"input.{i}")
        else:
            raise _bad(f"input[{i}]: item type {kind!r} is not supported; the gateway serves "
                       f"{_SERVED_ITEMS} items", param=f"input.{i}.type")

    def _message(self, item: dict[str, Any], i: int) -> None:
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            raise _bad(f"input[{i}].role must be one of {list(_MESSAGE_ROLES)}, got {role!r}",
                       param=f"input.{i}.role")
        content = _content(item.get("content"), f"input[{i}].content")
        if role != "assistant":
            self.flush()
            self.out.append((i, {"role": role, "content": content}))
            return
        if self.pending is not None and (self.pending["content"] is not None
                                         or self.pending.get("tool_calls")):
            self.flush()
        self._assistant(i)["content"] = content

    def _call(self, item: dict[str, Any], i: int) -> None:
        for key in ("name", "arguments", "call_id"):
            if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                raise _bad(f"input[{i}]: a function_call needs '{key}' as a non-empty string",
                           param=f"input.{i}.{key}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        self._assistant(i).setdefault("tool_calls", []).append(call)

    def _reasoning(self, item: dict[str, Any], i: int) -> None:
        text = _reasoning_text(item, i)
        if not text:  # nothing readable (e.g. only encrypted_content): not part of the prompt
            return
        self.flush()
        self._assistant(i)["reasoning_content"] = text


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    """The text of a reasoning item: its ``content`` (reasoning_text), else its ``summary``."""
    texts: dict[str, list[str]] = {"content": [], "summary": []}
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise _bad(f"input[{i}].{key} must be a list", param=f"input.{i}.{key}")
        for j, part in enumerate(parts):
            if not (isinstance(part, dict) and part.get("type") == part_type
                    and isinstance(part.get("text"), str)):
                raise _bad(f"input[{i}].{key}[{j}] must be {{'type': '{part_type}', 'text': ...}}",
                           param=f"input.{i}.{key}.{j}")
            texts[key].append(part["text"])
    return "".join(texts["content"]) or "\n\n".join(texts["summary"])


def _call_output(item: dict[str, Any], i: int) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"input[{i}]: a function_call_output needs 'call_id' as a non-empty string",
                   param=f"input.{i}.call_id")
    if "output" not in item:
        raise _bad(f"input[{i}]: a function_call_output needs 'output'", param=f"input.{i}.output")
    content = _content(item["output"], f"input[{i}].output")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content or a call's output: a string, or the chat form of its parts (text parts
    joined into one string; with images, chat ``text`` / ``image_url`` parts)."""
    if isinstance(content, str):
        return content
    param = where.replace("[", ".").replace("]", "")
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{j}]: {kind} is not supported here (images: send image_url as a "
                       "data URL; files and audio: not served)", param=f"{param}.{j}")
        else:
            raise _bad(f"{where}[{j}] must be an input_text / output_text / refusal / input_image "
                       f"part, got {str(part)[:200]}", param=f"{param}.{j}")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _check_call_ids(history: list[dict[str, Any]], new: list[tuple[int, dict[str, Any]]]) -> None:
    """Every function_call_output answers a function_call before it; call ids are unique."""
    seen: set[str] = {c["id"] for msg in history for c in msg.get("tool_calls") or []}
    for i, msg in new:
        for call in msg.get("tool_calls") or []:
            if call["id"] in seen:
                raise _bad(f"input[{i}]: call_id {call['id']!r} is used by an earlier "
                           "function_call", param=f"input.{i}.call_id")
            seen.add(call["id"])
        if msg["role"] == "tool" and msg.get("tool_call_id") not in seen:
            raise _bad(f"input[{i}]: function_call_output for call_id {msg.get('tool_call_id')!r}, "
                       "which no earlier function_call has", param=f"input.{i}.call_id")


def _openapi() -> dict[str, Any]:
    schema = ResponsesBody.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


DIALECT = Dialect(
    name="responses", path="/responses", parse=parse_responses_request, render=render,
    render_stream=render_stream, error_body=error_body, openapi=_openapi(),
)
"""The OpenAI Responses API on ``POST /sessions/{id}/v1/responses``."""
