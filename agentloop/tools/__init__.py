"""Tools: the BaseTool life cycle, OpenAI schemas, ``@function_tool`` and built-in tools."""

from agentloop.tools.base import BaseTool
from agentloop.tools.calculator import CalculatorTool
from agentloop.tools.function_tool import FunctionTool, function_tool
from agentloop.tools.gsm8k import Gsm8kTool
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
    "FunctionTool",
    "Gsm8kTool",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "function_tool",
]
