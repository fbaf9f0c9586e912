"""Tool-call parsers (one file per format) and their registry."""

from agentloop.parsers.base import FunctionCall, ToolParser, get_tool_parser
from agentloop.parsers.gpt_oss import GptOssToolParser
from agentloop.parsers.hermes import HermesToolParser
from agentloop.parsers.llama3_json import Llama3JsonToolParser
from agentloop.parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = ["FunctionCall", "GptOssToolParser", "HermesToolParser", "Llama3JsonToolParser", "Qwen3CoderToolParser",
           "ToolParser", "get_tool_parser"]
