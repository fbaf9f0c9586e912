"""Qwen3-Coder tool calls: one XML-like element per parameter, values as plain text.

``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`` blocks become
calls, the text outside them the content; each value is coerced to the JSON type the tool's schema
declares for it.  A value that does not fit, an unclosed element, a repeated parameter or an unknown
tool gives a call with ``error``; nothing raises.  Spec (the format, coercion rules):
docs/tools.md#qwen3_coder.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, ClassVar

from agentloop.parsers.base import (
    FunctionCall,
    ToolParser,
    as_tool_dicts,
    split_blocks,
    unknown_tool_error,
)

_TYPE_ALIASES = {
    "int": "integer", "float": "number", "bool": "boolean", "dict": "object", "list": "array",
}
_Schemas = dict[str, dict[str, Any]]  # tool name -> {parameter name -> its JSON schema}


def tool_parameter_schemas(tools: list[Any] | None) -> _Schemas | None:
    """tool name → {parameter name → its JSON schema}; None when no tools were given."""
    dicts = as_tool_dicts(tools)
    if dicts is None:
        return None
    out: _Schemas = {}
    for tool in dicts:
        fn = tool.get("function") or tool
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[str(fn.get("name"))] = props if isinstance(props, dict) else {}
    return out


def _strip_one_newline(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _as_integer(text: str) -> tuple[bool, Any]:
    try:
        return True, int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return False, None
    return (True, int(value)) if value.is_integer() else (False, None)


def _as_number(text: str) -> tuple[bool, Any]:
    ok, value = _as_integer(text)
    if ok and "." not in text and "e" not in text.lower():
        return True, value
    try:
        number = float(text)
    except ValueError:
        return False, None
    return (True, number) if math.isfinite(number) else (False, None)


def _as_boolean(text: str) -> tuple[bool, Any]:
    lowered = text.lower()
    return (True, lowered == "true") if lowered in ("true", "false") else (False, None)


def _as_null(text: str) -> tuple[bool, Any]:
    return (True, None) if text.lower() in ("null", "none") else (False, None)


def _as_json(kind: type) -> Callable[[str], tuple[bool, Any]]:
    def convert(text: str) -> tuple[bool, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False, None
        return (True, value) if isinstance(value, kind) else (False, None)

    return convert


_CONVERTERS: dict[str, Callable[[str], tuple[bool, Any]]] = {
    "integer": _as_integer, "number": _as_number, "boolean": _as_boolean,
    "object": _as_json(dict), "array": _as_json(list), "null": _as_null,
}


def _declared_types(schema: Any) -> list[str]:
    """The schema's known types, ``null`` then ``string`` last ([] when untyped)."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(declared, str):
        names = [declared]
    elif isinstance(declared, list):
        names = declared
    else:
        names = []
    types = [_TYPE_ALIASES.get(str(t), str(t)) for t in names]
    types = [t for t in types if t in _CONVERTERS or t == "string"]
    return sorted(types, key=lambda t: (t == "string", t == "null"))


def coerce_value(raw: str, schema: Any) -> tuple[Any, str | None]:
    """The value of a parameter's text under ``schema``, and an error when it does not fit."""
    types = _declared_types(schema)
    if not types:
        text = _strip_one_newline(raw)
        try:
            return json.loads(text), None
        except json.JSONDecodeError:
            return text, None
    stripped = raw.strip()
    for kind in types:
        if kind == "string":
            return _strip_one_newline(raw), None
        ok, value = _CONVERTERS[kind](stripped)
        if ok:
            return value, None
    return stripped, f"expected {' or '.join(types)}, got {stripped!r}"


def coerce_arguments(pairs: list[tuple[str, str]], schema: dict[str, Any], errors: list[str],
                     what: str = "parameter") -> dict[str, Any]:
    """``{name: value}`` of (name, raw text) pairs, each coerced to the type ``schema`` declares for
    it; a repeated name or a value that does not fit adds to ``errors``."""
    args: dict[str, Any] = {}
    for key, raw in pairs:
        if key in args:
            errors.append(f"{what} {key!r} is given twice")
            continue
        args[key], error = coerce_value(raw, schema.get(key))
        if error:
            errors.append(f"{what} {key!r}: {error}")
    return args


def _parse_parameters(inner: str, schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The arguments in a function element's body, and what was wrong with them."""
    pairs: list[tuple[str, str]] = []
    errors: list[str] = []
    for piece in inner.split("<parameter=")[1:]:
        name, sep, rest = piece.partition(">")
        value, closed, _ = rest.partition("</parameter>")
        if not sep or "\n" in name or not name.strip():
            errors.append("malformed <parameter=NAME> tag")
        elif not closed:
            errors.append(f"<parameter={name.strip()}> is not closed with </parameter>")
        else:
            pairs.append((name.strip(), value))
    return coerce_arguments(pairs, schema, errors), errors


def _parse_function(piece: str, schemas: _Schemas | None) -> FunctionCall:
    """One call from the text after a ``<function=``."""
    name, sep, rest = piece.partition(">")
    if not sep or "\n" in name or not name.strip():
        return FunctionCall(name="", arguments=piece.strip(), error="malformed <function=NAME> tag")
    name = name.strip()
    inner, closed, _ = rest.partition("</function>")
    if not closed:
        error = f"<function={name}> is not closed with </function>"
        return FunctionCall(name=name, arguments=rest.strip(), error=error)
    schema = {} if schemas is None else schemas.get(name, {})
    args, errors = _parse_parameters(inner, schema)
    call = FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
    if schemas is not None and name not in schemas:
        errors.insert(0, unknown_tool_error(name, schemas))
    if errors:
        call.error = "; ".join(errors)
    return call


def _parse_block(body: str, schemas: _Schemas | None, start: str) -> list[FunctionCall]:
    pieces = body.split("<function=")
    if len(pieces) == 1:
        return [
            FunctionCall(
                name="", arguments=body.strip(), error=f"{start} block has no <function=NAME>"
            )
        ]
    return [_parse_function(piece, schemas) for piece in pieces[1:]]


@ToolParser.register("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """Parser for Qwen3-Coder's ``<tool_call><function=…><parameter=…>`` format."""

    tool_call_start: ClassVar[str | None] = "<tool_call>"
    block_start: ClassVar[str] = "<tool_call>"
    """Opens a block of calls (subclasses with other block tags override both)."""
    block_end: ClassVar[str] = "</tool_call>"
    """Closes a block of calls."""

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on decoded text."""
        start = self.block_start
        schemas = tool_parameter_schemas(tools)
        content, bodies, unclosed = split_blocks(text, start, self.block_end)
        calls = [call for body in bodies for call in _parse_block(body, schemas, start)]
        if unclosed is not None:
            calls.append(
                FunctionCall(
                    name="", arguments=unclosed.strip(), error=f"{start} block is not closed"
                )
            )
        return self.without_special_tokens(content).strip(), calls
