"""``@function_tool``: a plain Python function as a :class:`~agentloop.tools.base.BaseTool`.

::

    @function_tool
    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
        \"\"\"Current temperature of a city.

        Args:
            city: The city's name, e.g. Paris.
            unit: Celsius or Fahrenheit.
        \"\"\"

The decorator returns a :class:`FunctionTool` *subclass* named after the function, so a YAML tool file
loads it like any other tool (``class_name: mypkg.tools.get_weather``) and ``get_weather()`` builds an
instance.  The original function stays reachable as ``get_weather.fn``.

Schema inference (checked at decoration time; anything else raises :class:`~agentloop.errors.ConfigError`
naming the function and the parameter):

* ``str`` → string, ``int`` → integer, ``float`` → number, ``bool`` → boolean, ``dict`` / ``dict[K, V]`` →
  object, ``list`` / ``list[X]`` → array (with ``items`` inferred from ``X``), ``Literal[...]`` → ``enum``
  (with the values' type), a union of the scalar types above → a list of types.
* ``Optional[X]`` / ``X | None`` makes a parameter optional; so does a default value.  Every other
  parameter is ``required``.
* The docstring's first paragraph is the description (``description=`` overrides it); a Google-style
  ``Args:`` section gives the parameter descriptions.
* Every parameter needs an annotation; ``*args``, ``**kwargs`` and positional-only parameters are refused.

Calling: the model's arguments are passed as keyword arguments (unknown or missing ones are reported
to the model as an error).  Sync functions run in a worker thread (``asyncio.to_thread``); async ones
are awaited.  ``timeout=`` (overridable by the YAML ``config: {timeout: ...}``) bounds one call; when it
fires the ``asyncio.TimeoutError`` propagates, so the agent loop's tool runner reports and counts it as
a timeout (a sync function's thread cannot be killed and runs on in the background).

Return values:

* ``str`` → the tool message text, step reward 0.0;
* :class:`~agentloop.tools.schemas.ToolResponse` → as is (text and/or images), step reward 0.0;
* a 2-tuple ``(str | ToolResponse, reward)`` → that response and that step reward (a real number);
* anything else JSON-serialisable (numbers, lists, dicts, ``None``) → its JSON text, step reward 0.0.

Exceptions raised by the function propagate; the tool runner turns them into an error message.
Per-sample state (``create_kwargs``) is not passed to functions: subclass BaseTool for that.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import operator
import re
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Union, overload

from agentloop.errors import ConfigError
from agentloop.tools.base import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")
_ARG_SECTIONS = ("Args:", "Arguments:")
_ARG_LINE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


class FunctionTool(BaseTool):
    """Base class of the tools made by :func:`function_tool` (``fn``, ``default_schema`` are set there)."""

    fn: ClassVar[Callable[..., Any]]
    default_schema: ClassVar[OpenAIFunctionToolSchema]
    default_timeout: ClassVar[float | None] = None
    none_defaults: ClassVar[tuple[str, ...]] = ()
    """Optional-typed parameters without a default: passed as None when the model omits them."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None
    ) -> None:
        merged = {"timeout": self.default_timeout, **(config or {})}
        super().__init__(merged, tool_schema or self.default_schema)
        self._params = set(inspect.signature(type(self).fn).parameters)
        self._required = set(self.default_schema.function.parameters.required)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Call the function with the model's arguments; see the module docstring for return values."""
        fn = type(self).fn
        if not isinstance(parameters, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(parameters).__name__}")
        unknown = sorted(set(parameters) - self._params)
        missing = sorted(self._required - set(parameters))
        if unknown or missing:
            raise ValueError(f"bad arguments for {self.name!r}: unknown {unknown}, missing required {missing}")
        parameters = {**dict.fromkeys(self.none_defaults), **parameters}
        call = fn(**parameters) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, **parameters)
        timeout = self.config.get("timeout")
        value = await (asyncio.wait_for(call, float(timeout)) if timeout else call)
        response, reward = _to_response(value, self.name)
        return response, reward, {}


def _to_response(value: Any, name: str) -> tuple[ToolResponse, float]:
    """Normalise a function's return value to (response, step reward)."""
    if isinstance(value, tuple):
        if len(value) != 2 or isinstance(value[1], bool) or not isinstance(value[1], (int, float)):
            raise TypeError(f"function tool {name!r} returned a tuple; only (str | ToolResponse, reward) is allowed")
        response, _ = _to_response(value[0], name)
        return response, float(value[1])
    if isinstance(value, ToolResponse):
        return value, 0.0
    if isinstance(value, str):
        return ToolResponse(text=value), 0.0
    try:
        return ToolResponse(text=json.dumps(value, ensure_ascii=False)), 0.0
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"function tool {name!r} returned {type(value).__name__}; return str, ToolResponse, "
            "(str | ToolResponse, reward) or a JSON-serialisable value"
        ) from e


@overload
def function_tool(fn: Callable[..., Any], /) -> type[FunctionTool]: ...


@overload
def function_tool(
    *, name: str | None = None, description: str | None = None, timeout: float | None = None
) -> Callable[[Callable[..., Any]], type[FunctionTool]]: ...


def function_tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> type[FunctionTool] | Callable[[Callable[..., Any]], type[FunctionTool]]:
    """Turn ``fn`` into a :class:`FunctionTool` subclass; usable bare or with keyword options.

    Args:
        fn: the function (when used bare, ``@function_tool``).
        name: the tool name the model sees (default: the function's name).
        description: the tool description (default: the docstring's first paragraph).
        timeout: seconds one call may take (default: no limit of its own).
    """

    def decorate(f: Callable[..., Any]) -> type[FunctionTool]:
        return make_function_tool(f, name=name, description=description, timeout=timeout)

    return decorate(fn) if fn is not None else decorate


def make_function_tool(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
    timeout: float | None = None,
) -> type[FunctionTool]:
    """The :class:`FunctionTool` subclass for ``fn`` (what :func:`function_tool` returns)."""
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(f"@function_tool decorates a function, got {fn!r}")
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ConfigError(f"@function_tool: {_label(fn)} is a generator; return a value instead")
    schema = infer_schema(fn, name=name, description=description)
    required = set(schema.function.parameters.required)
    none_defaults = tuple(p.name for p in inspect.signature(fn).parameters.values()
                          if p.default is p.empty and p.name not in required)
    namespace = {
        "none_defaults": none_defaults,
        "fn": staticmethod(fn),
        "default_schema": schema,
        "default_timeout": timeout,
        "__module__": getattr(fn, "__module__", __name__),
        "__qualname__": getattr(fn, "__qualname__", schema.function.name),
        "__doc__": inspect.getdoc(fn),
    }
    return types.new_class(getattr(fn, "__name__", schema.function.name), (FunctionTool,), {},
                           lambda ns: ns.update(namespace))


def infer_schema(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> OpenAIFunctionToolSchema:
    """The OpenAI function schema of ``fn`` from its signature, type hints and docstring."""
    label = _label(fn)
    tool_name = str(name or getattr(fn, "__name__", ""))
    if not _NAME.match(tool_name):
        raise ConfigError(f"@function_tool: tool name {tool_name!r} of {label} must match [A-Za-z0-9_-]{{1,64}}")
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
            raise ConfigError(f"@function_tool: {where}: *args, **kwargs and positional-only parameters "
                              "are not supported")
        if param.name not in hints:
            raise ConfigError(f"@function_tool: {where} has no type annotation")
        inner, optional = _strip_none(hints[param.name])
        prop = json_schema_for(inner, where)
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if not optional and param.default is param.empty:
            required.append(param.name)
    function = {"name": tool_name, "description": description if description is not None else summary,
                "parameters": {"type": "object", "properties": properties, "required": required}}
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
        f"@function_tool: {where}: unsupported annotation {tp!r}; use str, int, float, bool, list[...], dict, "
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
    raise ConfigError(f"@function_tool: {where}: Literal values must be str, int, float or bool, got {value!r}")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(first paragraph joined on one line, {parameter: description} from a Google-style ``Args:``)."""
    lines = (doc or "").splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        summary.append(line.strip())
    args: dict[str, str] = {}
    start = next((i for i, line in enumerate(lines) if line.strip() in _ARG_SECTIONS and not line[:1].isspace()),
                 None)
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


def _label(fn: Any) -> str:
    return f"function {getattr(fn, '__qualname__', repr(fn))!r}"
