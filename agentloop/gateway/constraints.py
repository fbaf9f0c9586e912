"""Tool choice and structured output: one engine sampling entry per request.

:func:`apply` turns a :class:`~agentloop.gateway.turn.TurnRequest`'s ``tool_choice``, ``tools`` and
``response_format`` plus the served tool-call format (``multi_turn.format``) into one engine
entry, ``params["structured_outputs"]``: a dict of vLLM ``StructuredOutputsParams`` fields (here
always ``structural_tag``, an xgrammar structural tag as a JSON string), or nothing when the
request leaves sampling free.  What cannot be expressed is refused with a 400 naming it, never
dropped.  Spec (the mapping, what the log-probs of a constrained row mean): docs/gateway.md,
"Tool choice and structured output".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import TurnRequest
from agentloop.parsers import (
    GlmToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MiniMaxToolParser,
    Qwen3CoderToolParser,
    SeedToolParser,
    ToolParser,
)
from agentloop.parsers.reasoning import ReasoningParser

STRUCTURED_OUTPUTS = "structured_outputs"
"""The engine sampling key: vLLM ``StructuredOutputsParams`` fields as a plain dict."""

MAX_WHITESPACE = 16
"""Most whitespace characters in a row a constrained JSON value may hold (indented JSON fits; a
model cannot pad a value with whitespace until its budget runs out)."""

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
"""The ``[time] file.cc:line:`` xgrammar puts before its message."""

TagBuilder = Callable[[str, dict[str, Any]], dict[str, Any]]
"""``(tool name, parameters schema) -> structural-tag "tag" format`` for one tool's call."""


def _content(schema: dict[str, Any], style: str = "json") -> dict[str, Any]:
    return {
        "type": "json_schema", "json_schema": schema, "style": style,
        "max_whitespace_cnt": MAX_WHITESPACE,
    }


def _hermes(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    head = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    return {"type": "tag", "begin": head, "content": _content(schema), "end": "}\n</tool_call>"}


def _llama3_json(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '
    return {"type": "tag", "begin": head, "content": _content(schema), "end": "}"}


def _qwen_xml(block: str) -> TagBuilder:
    def tag(name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag", "begin": f"<{block}>\n<function={name}>\n",
            "content": _content(schema, "qwen_xml"), "end": f"\n</function>\n</{block}>",
        }

    return tag


def _glm(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag", "begin": f"<tool_call>{name}\n", "content": _content(schema, "glm_xml"),
        "end": "\n</tool_call>",
    }


def _minimax(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag", "begin": f'<minimax:tool_call>\n<invoke name="{name}">\n',
        "content": _content(schema, "minimax_xml"), "end": "\n</invoke>\n</minimax:tool_call>",
    }


CALL_FORMATS: dict[type[ToolParser], tuple[str, TagBuilder, str]] = {
    HermesToolParser: ("hermes", _hermes, "\n"),
    Llama3JsonToolParser: ("llama3_json", _llama3_json, "; "),
    Qwen3CoderToolParser: ("qwen3_coder", _qwen_xml("tool_call"), "\n"),
    SeedToolParser: ("seed", _qwen_xml("seed:tool_call"), "\n"), GlmToolParser: ("glm", _glm, "\n"),
    MiniMaxToolParser: ("minimax", _minimax, "\n"),
}
"""Formats a grammar can force: parser class (exact type) -> (name, one call's tag, separator)."""


def apply(request: TurnRequest, parser: ToolParser | None, params: dict[str, Any],
          reasoning: ReasoningParser | None = None) -> bool:
    """Set ``params["structured_outputs"]`` for the request's tool choice and response format.

    Args:
        request: the checked request (``tool_choice``, ``tools``, ``response_format``).
        parser: the served tool parser (``multi_turn.format``; None: no tool calls are served).
        params: the engine sampling params, edited in place.
        reasoning: the gateway's reasoning parser: the grammar then lets the thinking section come
            first, free.
    Returns:
        True when the engine samples under a grammar (the turn is constrained), else False.
    Raises:
        GatewayHTTPError: 400 naming what cannot be honoured (unknown tool, no tools, a format no
            grammar is built for, a malformed ``response_format``, a schema no grammar can take).
    """
    entry = engine_entry(request.tool_choice, request.tools, request.response_format, parser,
                         reasoning)
    if entry is None:
        return False
    params[STRUCTURED_OUTPUTS] = entry
    return True


def engine_entry(
    tool_choice: Any, tools: list[dict[str, Any]] | None, response_format: dict[str, Any] | None,
    parser: ToolParser | None, reasoning: ReasoningParser | None = None,
) -> dict[str, Any] | None:
    """The ``structured_outputs`` entry (vLLM field names), or None for free sampling.

    ``required`` / a named function: calls only, in the served format (the ``response_format``
    applies to the answer, a later turn).  ``auto`` with tools and a JSON ``response_format``: a
    call or a JSON answer.  ``none``: tool calls are neither parsed nor forbidden; only
    ``response_format`` constrains.  Raises as :func:`apply`.
    """
    answer = json_answer(response_format)
    if tool_choice in ("auto", None, "none"):
        if answer is None:
            return None
        if tool_choice == "none" or not tools or parser is None:
            return _structural_tag(_thinking_first(_content(answer), reasoning), "response_format")
        _structural_tag(_content(answer), "response_format")  # its own 400 first
        calls = _calls(tools, parser, "tool_choice 'auto' with a JSON response_format", only=None)
        fmt = {"type": "or", "elements": [calls, _content(answer)]}
    elif tool_choice == "required":
        fmt = _calls(tools, parser, "tool_choice 'required'", only=None)
    else:
        name = _named(tool_choice)
        fmt = _calls(tools, parser, f"tool_choice naming {name!r}", only=name)
    return _structural_tag(_thinking_first(fmt, reasoning), "tools")


def _thinking_first(fmt: dict[str, Any], reasoning: ReasoningParser | None) -> dict[str, Any]:
    """``fmt`` after the reasoning model's thinking section (free text up to its end marker;
    optional where the model, not the generation prompt, opens it) and up to 4 whitespace."""
    if reasoning is None:
        return fmt
    begin = "" if reasoning.opened_by_prompt else reasoning.start
    thinking: dict[str, Any] = {"type": "tag", "begin": begin, "content": {"type": "any_text"},
                                "end": reasoning.end}
    if not reasoning.opened_by_prompt:
        thinking = {"type": "optional", "content": thinking}
    gap = {"type": "regex", "pattern": "\\s{0,4}"}
    return {"type": "sequence", "elements": [thinking, gap, fmt]}


def json_answer(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (``{"type": "object"}`` for ``json_object``),
    or None for free text (absent or ``text``).  Raises GatewayHTTPError 400 on any other shape."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _bad("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _bad(
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
            "'json_schema'",
            "response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(
            "response_format json_schema needs a 'json_schema' object ({'name', 'schema'})",
            "response_format.json_schema",
        )
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad(
            "response_format.json_schema.schema must be a JSON schema object",
            "response_format.json_schema.schema",
        )
    return schema


def _structural_tag(fmt: dict[str, Any], param: str) -> dict[str, Any]:
    """The entry for one structural-tag format, compiled once here so that a schema the grammar
    backend cannot take is the client's 400 (naming ``param``), not an engine failure."""
    spec = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    try:  # xgrammar is an optional dependency (vLLM's): without it the engine is the judge
        import xgrammar
    except ImportError:
        return {"structural_tag": spec}
    try:
        xgrammar.Grammar.from_structural_tag(spec)
    # xgrammar raises RuntimeError / ValueError / its own types
    except Exception as e:  # noqa: BLE001
        reason = _SOURCE_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
        what = "the tools' parameters" if param == "tools" else "the response_format schema"
        raise _bad(f"{what} cannot be made into a grammar: {reason[:300]}", param) from None
    return {"structural_tag": spec}


def _named(tool_choice: Any) -> str:
    """The tool name of ``{"type": "function", "name": ...}``; 400 on any other tool_choice."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise _bad(
        f"tool_choice {tool_choice!r} is not supported; use 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def _calls(
    tools: list[dict[str, Any]] | None, parser: ToolParser | None, what: str, only: str | None
) -> dict[str, Any]:
    """One or more calls in the served format (exactly one call of ``only`` when given)."""
    if not tools:
        raise _bad(f"{what} needs tools; the request has none", "tools")
    served = CALL_FORMATS.get(type(parser)) if parser is not None else None
    if served is None:
        fmt = "none (multi_turn.format is not set)" if parser is None else type(parser).__name__
        known = ", ".join(name for name, _, _ in CALL_FORMATS.values())
        raise _bad(
            f"{what} is not supported for the served tool-call format {fmt}: constrained tool "
            f"calls are built for {known}",
            "tool_choice",
        )
    _, build, separator = served
    functions = [t.get("function") or {} for t in tools]
    if only is not None:
        functions = [f for f in functions if f.get("name") == only]
        if not functions:
            names = sorted(str(f.get("name")) for f in (t.get("function") or {} for t in tools))
            raise _bad(
                f"tool_choice names {only!r}, which is not one of the request's tools {names}",
                "tool_choice",
            )
    tags = [build(str(f["name"]), _parameters(f)) for f in functions]
    return {
        "type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
        "stop_after_first": only is not None,
    }


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    if not isinstance(schema, dict) or not schema:
        return {"type": "object"}
    return schema


def _bad(message: str, param: str) -> GatewayHTTPError:
    return GatewayHTTPError(400, message, param=param)
