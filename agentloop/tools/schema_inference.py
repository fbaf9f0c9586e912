"""Inferring a function's OpenAI tool schema from its signature, type hints and docstring.

Used by :func:`agentloop.tools.function_tool.function_tool` (the rules are listed in that module's
docstring); everything that does not fit raises :class:`~agentloop.errors.ConfigError` naming the
function and the parameter.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from agentloop.errors import ConfigError
from agentloop.tools.schemas import OpenAIFunctionToolSchema

_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")
_ARG_SECTIONS = ("Args:", "Arguments:")
_ARG_LINE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def infer_schema(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> OpenAIFunctionToolSchema:
    """The OpenAI function schema of ``fn`` from its signature, type hints and docstring."""
    label = fn_label(fn)
    tool_name = str(name or getattr(fn, "__name__", ""))
    if not _NAME.match(tool_name):
        raise ConfigError(
            f"@function_tool: tool name {tool_name!r} of {label} must match [A-Za-z0-9_-]{{1,64}}"
        )
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - unresolved forward references, bad annotations
        raise ConfigError(f"@function_tool: cannot resolve the type hints of {label}: {e}") from e
    summary, arg_docs = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        where = f"{label} parameter {param.name!r}"
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ConfigError(
                f"@function_tool: {where}: *args, **kwargs and "
                f"positional-only parameters "
                "are not supported"
            )
        if param.name not in hints:
            raise ConfigError(f"@function_tool: {where} has no type annotation")
        inner, optional = _strip_none(hints[param.name])
        prop = json_schema_for(inner, where)
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if not optional and param.default is param.empty:
            required.append(param.name)
    function = {
        "name": tool_name, "description": description if description is not None else summary,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": function})


def json_schema_for(tp: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation (no ``None`` allowed here); ConfigError names ``where``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is dict or origin is dict:
        return {"type": "object"}
    if tp is list or origin is list:
        return {"type": "array", **({"items": json_schema_for(args[0], where)} if args else {})}
    if origin is Literal:
        types_ = sorted({_literal_type(v, where) for v in args})
        return {"type": types_[0] if len(types_) == 1 else types_, "enum": list(args)}
    if origin in (Union, types.UnionType) and all(a in _SCALARS for a in args):
        return {"type": [_SCALARS[a] for a in args]}
    raise ConfigError(
        f"@function_tool: {where}: unsupported annotation {tp!r}; use str, int, float, "
        f"bool, list[...], dict, "
        "Literal[...] or a union of scalars (Optional[...] / X | None only on the parameter itself)"
    )


def _strip_none(tp: Any) -> tuple[Any, bool]:
    """(annotation without ``None``, whether ``None`` was part of it)."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return tp, False
    args = tuple(a for a in typing.get_args(tp) if a is not type(None))
    if len(args) == len(typing.get_args(tp)):
        return tp, False
    return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), True


def _literal_type(value: Any, where: str) -> str:
    for tp, name in _SCALARS.items():
        if type(value) is tp:
            return name
    raise ConfigError(
        f"@function_tool: {where}: Literal values must be str, int, float or bool, got {value!r}"
    )


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(first paragraph joined on one line, {parameter: description} from a Google-style
    ``Args:``)."""
    lines = (doc or "").splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        summary.append(line.strip())
    args: dict[str, str] = {}
    start = next(
        (
            i
            for i, line in enumerate(lines)
            if line.strip() in _ARG_SECTIONS and not line[:1].isspace()
        ),
        None,
    )
    if start is not None:
        _parse_args(lines[start + 1:], args)
    return " ".join(summary), args


def _parse_args(lines: list[str], out: dict[str, str]) -> None:
    """Fill ``out`` from the indented lines following ``Args:`` (continuation lines are joined)."""
    base: int | None = None
    current: str | None = None
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break
        base = indent if base is None else base
        match = _ARG_LINE.match(line.strip())
        if indent <= base and match:
            current = match.group("name")
            out[current] = match.group("text").strip()
        elif current is not None:
            out[current] = f"{out[current]} {line.strip()}".strip()


def fn_label(fn: Any) -> str:
    return f"function {getattr(fn, '__qualname__', repr(fn))!r}"
