"""Tool-call parsers (one file per format) and their registry."""

from agentloop.parsers.base import FunctionCall, ToolParser, get_tool_parser
from agentloop.parsers.hermes import HermesToolParser

__all__ = ["FunctionCall", "HermesToolParser", "ToolParser", "get_tool_parser"]
