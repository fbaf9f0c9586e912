"""Tools: the BaseTool life cycle, OpenAI schemas, ``@function_tool`` and built-in tools."""

from agentloop.tools.base import BaseTool
from agentloop.tools.calculator import CalculatorTool
from agentloop.tools.context_tools import (
    ContextEdit,
    DeleteContextTool,
    SummarizeContextTool,
    current_messages,
    request_context_edit,
)
from agentloop.tools.function_tool import (
    FUNCTION_TOOL_REGISTRY,
    FUNCTION_TOOLS,
    FunctionTool,
    function_tool,
    get_function_tool,
    load_function_tools_from_path,
    normalize_function_tool_return,
)
from agentloop.tools.gsm8k import Gsm8kTool
from agentloop.tools.registry import (
    TOOLS,
    initialize_tools_from_config,
    load_all_tools,
    register_tool,
)
from agentloop.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParametersSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = [
    "FUNCTION_TOOL_REGISTRY", "FUNCTION_TOOLS", "BaseTool", "CalculatorTool", "ContextEdit",
    "DeleteContextTool", "FunctionTool", "Gsm8kTool", "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema", "OpenAIFunctionParsedSchema", "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema", "OpenAIFunctionToolCall", "OpenAIFunctionToolSchema",
    "SummarizeContextTool", "TOOLS", "ToolResponse", "current_messages", "function_tool",
    "get_function_tool", "initialize_tools_from_config", "load_all_tools",
    "load_function_tools_from_path", "normalize_function_tool_return", "register_tool",
    "request_context_edit",
]
