"""Tool-call parsers: turn the policy's sampled ids into (content, tool calls).

Registry as in verl: ``@ToolParser.register("hermes")`` and
``ToolParser.get_tool_parser(name, tokenizer)`` (also :func:`get_tool_parser`; ``name`` may also be
an import path; an unknown one raises :class:`~agentloop.errors.ConfigError`).
``extract_tool_calls(ids[, tools])`` returns the content and a list of :class:`FunctionCall`; it
never raises on model output: a malformed call comes back with ``error`` set, and arguments are
never ``eval``-ed.  :attr:`ToolParser.stop_token_ids` are the ids of the tokens that end a call.
Spec (built-in formats, verl's calling conventions): docs/tools.md#tool-call-parsers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property
from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from agentloop.errors import ConfigError
from agentloop.tokenization.fast import decode_ids
from agentloop.utils.ids import fresh_hex
from agentloop.utils.registry import Registry


class FunctionCall(BaseModel):
    """One tool call the policy asked for.

    ``tool_call_id`` (verl's name) is the same value as :attr:`id`: readable, writable and accepted
    by the constructor (``FunctionCall(name=..., arguments=..., tool_call_id="call_1")``; None there
    means "make one up", as for ``id``).
    """

    name: str
    """Function name ("" when it could not be parsed)."""
    arguments: str
    """Arguments as a JSON object string (the raw text when it was not valid JSON)."""
    id: str = Field(default_factory=lambda: f"call_{fresh_hex()[:24]}")
    """Call id, echoed in the tool message (``tool_call_id``)."""
    error: str | None = None
    """Why the call is malformed; None for a well-formed call."""

    @model_validator(mode="before")
    @classmethod
    def _accept_tool_call_id(cls, data: Any) -> Any:
        """Map verl's ``tool_call_id=`` keyword onto :attr:`id`."""
        if isinstance(data, Mapping) and "tool_call_id" in data:
            data = dict(data)
            given = data.pop("tool_call_id")
            if given is not None and data.get("id") is None:
                data["id"] = str(given)
        return data

    @property
    def tool_call_id(self) -> str:
        """verl's name of :attr:`id`."""
        return self.id

    @tool_call_id.setter
    def tool_call_id(self, value: str) -> None:
        self.id = value


def as_tool_dicts(tools: Iterable[Any] | None) -> list[dict[str, Any]] | None:
    """``tools`` as plain dicts (OpenAI tool dicts or bare function dicts); None stays None.

    Accepts dicts (any mapping), pydantic schema objects (``model_dump()``) and objects shaped like
    ``OpenAIFunctionToolSchema`` (a ``.function`` with ``.name``); raises ConfigError for anything
    else.
    """
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            out.append(dict(tool))
        elif callable(getattr(tool, "model_dump", None)):
            out.append(tool.model_dump(exclude_none=True))
        elif getattr(tool, "function", None) is not None:
            out.append(
                {
                    "type": getattr(tool, "type", "function"),
                    "function": _function_dict(tool.function),
                }
            )
        else:
            raise ConfigError(
                f"tools[{i}] passed to extract_tool_calls is a {type(tool).__name__}; pass "
                f"OpenAI tool dicts "
                "or OpenAIFunctionToolSchema objects (e.g. [t.tool_schema for t in tools])"
            )
    return out


def _function_dict(function: Any) -> dict[str, Any]:
    """A function description object (``.name``, ``.parameters``) as a dict."""
    if isinstance(function, Mapping):
        return dict(function)
    params = getattr(function, "parameters", None)
    if params is not None and not isinstance(params, Mapping):
        params = params.model_dump(exclude_none=True) if hasattr(params, "model_dump") else None
    return {"name": getattr(function, "name", None), "parameters": params or {}}


def tool_names(tools: Iterable[Any] | None) -> set[str] | None:
    """The names of ``tools`` (see :func:`as_tool_dicts`); None when no tools were given."""
    dicts = as_tool_dicts(tools)
    return None if dicts is None else {str((t.get("function") or t).get("name")) for t in dicts}


def unknown_tool_error(name: str, allowed: set[str] | dict[str, Any]) -> str:
    """The error a call to a tool that is not offered gets (it names the available tools)."""
    return f"unknown tool {name!r}; available tools: {sorted(allowed)}"


def split_blocks(text: str, start: str, end: str) -> tuple[str, list[str], str | None]:
    """Cut ``start…end`` blocks out of ``text``.

    Returns (the text outside the blocks, the blocks' bodies in order, the text after a ``start``
    that is never closed, or None when every block is closed).
    """
    outside: list[str] = []
    bodies: list[str] = []
    pos = 0
    while True:
        open_at = text.find(start, pos)
        if open_at < 0:
            outside.append(text[pos:])
            return "".join(outside), bodies, None
        outside.append(text[pos:open_at])
        close_at = text.find(end, open_at + len(start))
        if close_at < 0:
            return "".join(outside), bodies, text[open_at + len(start):]
        bodies.append(text[open_at + len(start):close_at])
        pos = close_at + len(end)


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the tokenizer has it as one token (decoding back to it), else
    None."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    candidates: list[Any] = []
    if callable(convert):
        candidates.append(convert(token))
    try:
        ids = tokenizer.encode(token, add_special_tokens=False)
    except TypeError:  # tokenizers whose encode takes no add_special_tokens
        ids = tokenizer.encode(token)
    if len(ids) == 1:
        candidates.append(ids[0])
    for tid in candidates:
        if (
            isinstance(tid, int)
            and tid >= 0
            and tokenizer.decode([tid], skip_special_tokens=False) == token
        ):
            return tid
    return None


def finish_call(name: str, args: dict[str, Any], errors: list[str], allowed: Any,
                missing_name: str = "tool call needs a name") -> FunctionCall:
    """A parsed call: its arguments as a JSON string, and every problem found (no name, a tool that
    is not offered, argument errors) joined into ``error``."""
    if not name.strip():
        errors.insert(0, missing_name)
    elif allowed is not None and name not in allowed:
        errors.insert(0, unknown_tool_error(name, allowed))
    return FunctionCall(
        name=name, arguments=json.dumps(args, ensure_ascii=False), error="; ".join(errors) or None
    )


class ToolParser:
    """Base class; subclasses implement :meth:`parse_text` (on the decoded response).

    A subclass written against verl's interface may override :meth:`extract_tool_calls` instead.
    """

    _registry: ClassVar[Registry]
    """verl's name of :data:`TOOL_PARSERS` (set below the class)."""
    tool_call_start: ClassVar[str | None] = None
    """Decoded text that opens a tool call; streaming holds content back from it on (None: hold
    all)."""
    skip_special_tokens: ClassVar[bool] = True
    """How :meth:`extract_tool_calls` decodes (False for formats marked by special tokens, e.g.
    harmony)."""
    stop_tokens: ClassVar[tuple[str, ...]] = ()
    """Tokens that end a tool call and should halt generation (resolved to
    :attr:`stop_token_ids`)."""
    markup_tokens: ClassVar[tuple[str, ...]] = ()
    """The format's own markers that may be special tokens (kept by
    :meth:`without_special_tokens`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @cached_property
    def stop_token_ids(self) -> list[int]:
        """Ids of :attr:`stop_tokens` the tokenizer has as single tokens ([] when none: rely on
        EOS)."""
        ids = (single_token_id(self.tokenizer, token) for token in self.stop_tokens)
        return [tid for tid in ids if tid is not None]

    def without_special_tokens(self, text: str) -> str:
        """``text`` without the tokenizer's special tokens (EOS, padding, ...), except
        :attr:`markup_tokens`.

        For parsers that decode with special tokens: what is left outside the calls becomes content.
        """
        tok = self.tokenizer
        # HF tokenizers; fakes may lack it
        specials = list(getattr(tok, "all_special_tokens", None) or ())
        specials += [
            t for t in (getattr(tok, "eos_token", None), getattr(tok, "pad_token", None)) if t
        ]
        for token in sorted(set(specials) - set(self.markup_tokens), key=len, reverse=True):
            text = text.replace(token, "")
        return text

    async def extract_tool_calls(
        self, response_ids: list[int], tools: Iterable[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """Split a response into its text content and its tool calls (``tools``: see
        :func:`as_tool_dicts`)."""
        text = decode_ids(self.tokenizer, response_ids, self.skip_special_tokens)
        return self.parse_text(text, as_tool_dicts(tools))

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on decoded text; every built-in parser implements it."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither parse_text(text, tools) nor "
            f"extract_tool_calls(ids, tools); "
            "implement one of them"
        )

    @classmethod
    def register(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        """Class decorator registering a parser under ``name`` (the ``multi_turn.format`` value).

        Raises:
            ConfigError: not a ToolParser subclass, or ``name`` is taken by another parser.
        """
        return TOOL_PARSERS.register(name)

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer: Any) -> ToolParser:
        """An instance of the parser registered as ``name`` (or at the import path ``name``).

        Raises:
            ConfigError: unknown name (with the registered names) or a path that is not a
            ToolParser.
        """
        return TOOL_PARSERS.resolve(name)(tokenizer)


TOOL_PARSERS = Registry(
    "tool parser",
    decorator="ToolParser.register",
    base=ToolParser,
    where="actor_rollout_ref.rollout.multi_turn.format",
    how="Register one with @ToolParser.register(name), or give the import path of a "
    "ToolParser subclass.",
)
"""Tool-call parsers by ``multi_turn.format`` name; the built-ins are imported on first use."""
ToolParser._registry = TOOL_PARSERS
_BUILTIN_PARSERS = {
    "hermes": "hermes.HermesToolParser", "qwen3_coder": "qwen3_coder.Qwen3CoderToolParser",
    "llama3_json": "llama3_json.Llama3JsonToolParser", "gpt-oss": "gpt_oss.GptOssToolParser",
    "gpt_oss": "gpt_oss.GptOssToolParser", "glm": "glm.GlmToolParser",
    "seed": "seed.SeedToolParser", "minimax": "minimax.MiniMaxToolParser",
    "kimi": "kimi.KimiToolParser", "deepseek_v4": "deepseek_v4.DeepSeekV4ToolParser",
    "gemma4": "gemma4.Gemma4ToolParser",
}
for _name, _path in _BUILTIN_PARSERS.items():
    TOOL_PARSERS.add(_name, f"agentloop.parsers.{_path}")


def get_tool_parser(name: str, tokenizer: Any) -> ToolParser:
    """Module-level alias of :meth:`ToolParser.get_tool_parser`."""
    return ToolParser.get_tool_parser(name, tokenizer)
