"""OpenAI function-tool schemas (pydantic), with verl's class names, and the tool result type.

For the same YAML, ``OpenAIFunctionToolSchema.model_dump(exclude_unset=True, exclude_none=True)``
gives the dict verl's class gives (what the chat template renders), with one deliberate difference:
a property's ``items`` (the element schema of an array) is kept, where verl drops it.

Parsed tool calls: :class:`OpenAIFunctionParsedSchema` (name + arguments as the model wrote them, a
JSON string) → :meth:`OpenAIFunctionCallSchema.from_openai_function_parsed_schema` → (name +
arguments as a dict, whether the arguments failed to decode); :class:`OpenAIFunctionToolCall` adds
the call id.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function."""

    type: str | list[str]
    """A JSON type, or a list of them for a union (e.g. ``["integer", "number"]``)."""
    description: str | None = None
    enum: list[Any] | None = None
    """Allowed values (any JSON values)."""
    items: dict[str, Any] | None = None
    """Element schema of an array parameter (verl drops it; we keep it)."""


class OpenAIFunctionParametersSchema(BaseModel):
    """The JSON-schema object describing a function's parameters."""

    type: Literal["object"] = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """A function's name, description and parameters."""

    name: str = Field(min_length=1)
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=OpenAIFunctionParametersSchema
    )
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """``{"type": "function", "function": {...}}`` as passed to chat templates and the OpenAI
    API."""

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A tool call as parsed from the model's text: the arguments are still a JSON string."""

    name: str
    arguments: str
    """The arguments exactly as the model wrote them (expected: a JSON object)."""


class OpenAIFunctionCallSchema(BaseModel):
    """A tool call with decoded arguments (the ``function`` of an OpenAI ``tool_calls`` entry)."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """Decode the arguments: (call, has_decode_error).

        Arguments that are not valid JSON, or JSON that is not an object, become ``{}`` with
        ``has_decode_error`` True (verl's rule); the call itself is always returned.
        """
        try:
            arguments = json.loads(parsed_schema.arguments)
        except (json.JSONDecodeError, TypeError):
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls`` (OpenAI format)."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text and, optionally, images or videos (lists)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values: Any) -> Any:
        """A single image / video must be wrapped in a list; say so instead of a bare validation
        error."""
        if isinstance(values, dict):
            for key in ("image", "video"):
                value = values.get(key)
                if value is not None and not isinstance(value, list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(value).__name__}; "
                        f"wrap a single {key} "
                        f"in a list: ToolResponse({key}=[value])"
                    )
        return values

    def is_empty(self) -> bool:
        """True when there is no text, image or video."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """True when there is text and no image or video."""
        return bool(self.text) and not self.image and not self.video
