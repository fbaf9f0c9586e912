"""``@function_tool``: a plain Python function as a :class:`~agentloop.tools.base.BaseTool`.

::

    @function_tool
    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
        \"\"\"Current temperature of a city.

        Args:
            city: The city's name, e.g. Paris.
            unit: Celsius or Fahrenheit.
        \"\"\"

The decorator returns a :class:`FunctionTool` subclass named after the function (a YAML tool file
loads it by ``class_name``; ``get_weather.fn`` is the function), with the OpenAI schema inferred
from the type hints and docstring, and registers it in :data:`FUNCTION_TOOLS` (a
:class:`~agentloop.utils.registry.Registry`; the latest tool under a name wins; YAML tool files find
it by name through ``TOOLS``).  Raises :class:`~agentloop.errors.ConfigError` at decoration time for
a parameter it cannot describe.  Async functions are awaited; sync ones run in the tool executor.
Spec (verl's decorator forms, schema inference, timeouts, return values):
docs/tools.md#function-tools.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, overload

from agentloop.errors import ConfigError
from agentloop.tools.base import BaseTool
from agentloop.tools.executor import tool_executor
from agentloop.tools.schema_inference import (
    fn_label,
    infer_schema,
    json_schema_for,
    parse_docstring,
)
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from agentloop.utils.registry import Registry

__all__ = [
    "FUNCTION_TOOLS", "FUNCTION_TOOL_REGISTRY", "FunctionTool", "FunctionToolInstances",
    "function_tool", "get_function_tool", "infer_schema", "json_schema_for",
    "load_function_tools_from_path", "make_function_tool", "normalize_function_tool_return",
    "parse_docstring",
]

# open load_function_tools_from_path calls, innermost last
_collecting: list[list[type[FunctionTool]]] = []
_loaded_paths: dict[Path, list[FunctionTool]] = {}


class FunctionTool(BaseTool):
    """A tool that calls one Python function; made by :func:`function_tool` (``fn``,
    ``default_schema``).

    verl's way of building one directly works too:
    ``FunctionTool(name="add", fn=add, tool_schema=schema)`` (the schema is inferred from ``fn``
    when not given).

    Args:
        config: the YAML entry's ``config`` (``timeout`` overrides the decorator's).
        tool_schema: the schema the model sees (default: the function's).
        name: the tool name (default: the schema's function name).
        fn: the function, for a tool built without the decorator.
        is_async: whether ``fn`` must be awaited (default: inferred).
    """

    fn: ClassVar[Callable[..., Any] | None] = None
    default_schema: ClassVar[OpenAIFunctionToolSchema | None] = None
    default_timeout: ClassVar[float | None] = None
    is_async: bool
    """Whether the function is awaited (else it runs in the tool executor's pool)."""

    def __init__(
        self, config: Mapping[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None, *,
        name: str | None = None, fn: Callable[..., Any] | None = None, is_async: bool | None = None,
    ) -> None:
        default: OpenAIFunctionToolSchema | Mapping[str, Any] | None = type(self).default_schema
        if fn is not None:
            self.fn = fn  # type: ignore[misc]  # an instance's own function shadows the class attribute
            default = tool_schema if tool_schema is not None else infer_schema(fn, name=name)
        elif type(self).fn is None or default is None:
            raise ConfigError(
                f"{type(self).__name__} has no function: decorate one with "
                f"@function_tool, "
                "or build FunctionTool(fn=..., tool_schema=...)"
            )
        super().__init__(
            {"timeout": self.default_timeout, **(config or {})}, tool_schema or default
        )
        if name is not None:
            self.name = name
        function = self.fn
        assert function is not None
        self.is_async = (
            inspect.iscoroutinefunction(function) if is_async is None else bool(is_async)
        )
        signature = inspect.signature(function)
        self._params = set(signature.parameters)
        required = self.tool_schema.function.parameters.required if fn is not None else (
            type(self).default_schema.function.parameters.required)  # type: ignore[union-attr]
        self._required = set(required)
        self._none_defaults = tuple(p.name for p in signature.parameters.values()
                                    if p.default is p.empty and p.name not in self._required)

    async def call(self, parameters: dict[str, Any]) -> Any:
        """Call the function with the model's arguments and return its raw value (verl's API).

        Arguments are checked first (ValueError naming unknown / missing ones); ``config.timeout``
        applies.
        """
        if not isinstance(parameters, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(parameters).__name__}")
        unknown = sorted(set(parameters) - self._params)
        missing = sorted(self._required - set(parameters))
        if unknown or missing:
            raise ValueError(
                f"bad arguments for {self.name!r}: unknown {unknown}, missing required {missing}"
            )
        parameters = {**dict.fromkeys(self._none_defaults), **parameters}
        function = self.fn
        assert function is not None
        call = function(**parameters) if self.is_async else tool_executor().run_function(
            function, parameters, label=f"tool {self.name!r}")
        timeout = self.config.get("timeout")
        return await (asyncio.wait_for(call, float(timeout)) if timeout else call)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Call the function; docs/tools.md#function-tools says how return values become the
        triple."""
        return _to_triple(await self.call(parameters), self.name)


FUNCTION_TOOLS = Registry(
    "function tool", decorator="function_tool", base=FunctionTool,
    how="Decorate a function with @function_tool (in a file given as function_tool_path).",
)
"""Tool name -> the latest :class:`FunctionTool` subclass made by :func:`function_tool` under that
name. ``del FUNCTION_TOOLS[name]`` unregisters one.  ``TOOLS`` (tools/registry.py) looks names up
here after its own, so YAML ``class_name`` / ``_target_`` finds function tools by name."""


class FunctionToolInstances(Mapping[str, FunctionTool]):
    """Read-only view of :data:`FUNCTION_TOOLS` as name -> tool instance (one instance per tool
    class, made on first lookup).  Deprecated: it backs the old name :data:`FUNCTION_TOOL_REGISTRY`;
    use :data:`FUNCTION_TOOLS` (classes) or :func:`get_function_tool` (an instance)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._made: dict[str, FunctionTool] = {}

    def __getitem__(self, name: str) -> FunctionTool:
        """The instance of the tool class registered as ``name``; KeyError if none is."""
        cls = self.registry[name]
        made = self._made.get(name)
        if made is None or type(made) is not cls:
            made = cls()
            self._made[name] = made
        return made

    def __contains__(self, name: object) -> bool:
        return name in self.registry

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry)

    def __len__(self) -> int:
        return len(self.registry)

    def __repr__(self) -> str:
        return f"FunctionToolInstances({self.registry.names()})"


FUNCTION_TOOL_REGISTRY: Mapping[str, FunctionTool] = FunctionToolInstances(FUNCTION_TOOLS)
"""Deprecated read-only mapping tool name -> an instance of the latest tool made by
:func:`function_tool` under that name (verl's spelling); register with ``@function_tool`` and
unregister with ``del FUNCTION_TOOLS[name]``."""


def _to_triple(value: Any, name: str) -> tuple[ToolResponse, float, dict[str, Any]]:
    """Our normalisation of a function's return value (strict: a bad shape raises TypeError)."""
    if not isinstance(value, tuple):
        return _to_response(value, name), 0.0, {}
    bad = (len(value) not in (1, 2, 3) or isinstance(value[0], tuple)
           or (len(value) > 1 and value[1] is not None
               and (isinstance(value[1], bool) or not isinstance(value[1], (int, float))))
           or (len(value) > 2 and value[2] is not None and not isinstance(value[2], dict)))
    if bad:
        raise TypeError(
            f"function tool {name!r} returned a tuple {value!r:.80}; allowed: "
            f"(response,), "
            "(response, reward) or (response, reward, metrics dict)"
        )
    reward = 0.0 if len(value) < 2 or value[1] is None else float(value[1])
    metrics = {} if len(value) < 3 or value[2] is None else dict(value[2])
    return _to_response(value[0], name), reward, metrics


def _to_response(value: Any, name: str) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    try:
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"function tool {name!r} returned {type(value).__name__}; return str, ToolResponse, "
            "(response, reward[, metrics]) or a JSON-serialisable value"
        ) from e


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
    """A function tool's raw return value as ``(ToolResponse, reward, metrics)``, with verl 0.9.1's
    rules.

    ``ToolResponse`` as is; ``str`` as the text; ``dict`` as its JSON; a tuple ``(response,)``,
    ``(response, reward)`` or ``(response, reward, metrics)`` with the response normalised the same
    way (a None reward is 0.0, None metrics are ``{}``); anything else as ``str(ret)``.  Rewards and
    metrics default only when missing or None, so a reward of 0 or False is kept.  A tuple of
    another length raises TypeError (almost always a bug in the tool).
    """
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(
                f"a function tool returned a tuple of length {len(ret)} "
                f"({ret!r:.80}); return "
                "(response,), (response, reward) or (response, reward, metrics)"
            )
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _verl_response(ret[0]), reward, metrics
    return _verl_response(ret), 0.0, {}


def _verl_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=value if isinstance(value, str) else str(value))


@overload
def function_tool(fn: Callable[..., Any], /) -> type[FunctionTool]: ...


@overload
def function_tool(
    name: str | None = None, /, *, description: str | None = None, timeout: float | None = None,
    schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None,
) -> Callable[[Callable[..., Any]], type[FunctionTool]]: ...


@overload
def function_tool(
    *, name: str | None = None, description: str | None = None, timeout: float | None = None,
    schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None,
) -> Callable[[Callable[..., Any]], type[FunctionTool]]: ...


def function_tool(
    fn: Callable[..., Any] | str | None = None, /, *, name: str | None = None,
    description: str | None = None, timeout: float | None = None,
    schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None,
) -> type[FunctionTool] | Callable[[Callable[..., Any]], type[FunctionTool]]:
    """Turn ``fn`` into a :class:`FunctionTool` subclass; usable bare or with options.

    Args:
        fn: the function (when used bare, ``@function_tool``), or the tool name (verl's
            ``@function_tool("web_search")``).
        name: the tool name the model sees (default: the function's name).
        description: the tool description (default: the docstring's first paragraph).
        timeout: seconds one call may take (default: no limit of its own).
        schema: a complete schema to use instead of inferring one (verl's option).
    """
    if isinstance(fn, str):
        if name is not None and name != fn:
            raise ConfigError(
                f"@function_tool: the tool name is given twice ({fn!r} and name={name!r})"
            )
        fn, name = None, fn

    def decorate(f: Callable[..., Any]) -> type[FunctionTool]:
        return make_function_tool(
            f, name=name, description=description, timeout=timeout, schema=schema
        )

    return decorate(fn) if fn is not None else decorate


def make_function_tool(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
    timeout: float | None = None,
    schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None,
) -> type[FunctionTool]:
    """The :class:`FunctionTool` subclass for ``fn`` (what :func:`function_tool` returns);
    registers it."""
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(f"@function_tool decorates a function, got {fn!r}")
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ConfigError(f"@function_tool: {fn_label(fn)} is a generator; return a value instead")
    tool_schema = (
        infer_schema(fn, name=name, description=description)
        if schema is None
        else _given_schema(schema, fn, name=name, description=description)
    )
    namespace = {
        "fn": staticmethod(fn), "default_schema": tool_schema, "default_timeout": timeout,
        "__module__": getattr(fn, "__module__", __name__),
        "__qualname__": getattr(fn, "__qualname__", tool_schema.function.name),
        "__doc__": inspect.getdoc(fn),
    }
    cls = types.new_class(getattr(fn, "__name__", tool_schema.function.name), (FunctionTool,), {},
                          lambda ns: ns.update(namespace))
    cls()  # a tool that cannot be built fails here, at decoration
    FUNCTION_TOOLS.add(tool_schema.function.name, cls, replace=True)
    for created in _collecting:
        created.append(cls)
    return cls


def _given_schema(
    schema: OpenAIFunctionToolSchema | Mapping[str, Any], fn: Callable[..., Any], *,
    name: str | None, description: str | None,
) -> OpenAIFunctionToolSchema:
    """``schema=`` validated, with ``name=`` / ``description=`` applied on top."""
    try:
        given = schema if isinstance(schema, OpenAIFunctionToolSchema) else (
            OpenAIFunctionToolSchema.model_validate(dict(schema)))
    except ValueError as e:
        raise ConfigError(
            f"@function_tool: schema= of {fn_label(fn)} does not validate: {e}"
        ) from e
    updates = {k: v for k, v in (("name", name), ("description", description)) if v is not None}
    if not updates:
        return given
    return given.model_copy(update={"function": given.function.model_copy(update=updates)})


def get_function_tool(name: str) -> FunctionTool:
    """The registered function tool named ``name`` (verl's lookup)."""
    if name not in FUNCTION_TOOL_REGISTRY:
        raise ConfigError(
            f"no function tool named {name!r} is registered (known: "
            f"{sorted(FUNCTION_TOOL_REGISTRY)}); "
            "decorate it with @function_tool in a file given as function_tool_path"
        )
    return FUNCTION_TOOL_REGISTRY[name]


def load_function_tools_from_path(path: str | Path) -> list[FunctionTool]:
    """Run the Python file ``path`` (verl's ``function_tool_path``); one instance per
    ``@function_tool`` in it.

    The file is run once per process (later calls return the same tools).  It runs as a module named
    after its path, so it can import its siblings; tools made by modules it imports for the first
    time count as its own (verl's rule).  Two tools with one name raise ConfigError.
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ConfigError(
            f"function_tool_path {str(path)!r} is not a file; give the path "
            f"of a Python file whose "
            "functions are decorated with @function_tool"
        )
    if resolved in _loaded_paths:
        return list(_loaded_paths[resolved])
    module_name = "_agentloop_function_tools_" + "".join(
        c if c.isalnum() else "_" for c in str(resolved)
    )
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"function_tool_path {str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    created: list[type[FunctionTool]] = []
    _collecting.append(created)
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        sys.modules.pop(module_name, None)
        raise
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ConfigError(
            f"function_tool_path {str(path)!r} failed to run: {type(e).__name__}: {e}"
        ) from e
    finally:
        _collecting.pop()
    tools = [cls() for cls in created]
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"function_tool_path {str(path)!r} defines several tools named "
            f"{duplicates}; "
            "tool names must be unique"
        )
    _loaded_paths[resolved] = tools
    return list(tools)
