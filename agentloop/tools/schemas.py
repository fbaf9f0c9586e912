"""OpenAI function-tool schemas (pydantic), with verl's class names, and the tool result type."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None
    items: dict[str, Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The JSON-schema object describing a function's parameters."""

    type: Literal["object"] = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """A function's name, description and parameters."""

    name: str = Field(min_length=1)
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """``{"type": "function", "function": {...}}`` as passed to chat templates and the OpenAI API."""

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text and, optionally, images or videos."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None
