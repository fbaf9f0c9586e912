"""Tools: the BaseTool life cycle, OpenAI schemas and built-in tools."""

from agentloop.tools.base import BaseTool
from agentloop.tools.calculator import CalculatorTool
from agentloop.tools.schemas import (
    OpenAIFunctionParametersSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = [
    "BaseTool",
    "CalculatorTool",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]
