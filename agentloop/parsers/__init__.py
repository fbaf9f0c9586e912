"""Tool-call parsers (one file per format) and their registry."""

from agentloop.parsers.base import FunctionCall, ToolParser, get_tool_parser
from agentloop.parsers.deepseek_v4 import DeepSeekV4ToolParser
from agentloop.parsers.gemma4 import Gemma4ToolParser
from agentloop.parsers.glm import GlmToolParser
from agentloop.parsers.gpt_oss import GptOssToolParser
from agentloop.parsers.hermes import HermesToolParser
from agentloop.parsers.kimi import KimiToolParser
from agentloop.parsers.llama3_json import Llama3JsonToolParser
from agentloop.parsers.minimax import MiniMaxToolParser
from agentloop.parsers.qwen3_coder import Qwen3CoderToolParser
from agentloop.parsers.reasoning import ReasoningParser, get_reasoning_parser
from agentloop.parsers.seed import SeedToolParser

__all__ = [
    "DeepSeekV4ToolParser", "FunctionCall", "Gemma4ToolParser", "GlmToolParser", "GptOssToolParser",
    "HermesToolParser", "KimiToolParser", "Llama3JsonToolParser", "MiniMaxToolParser",
    "Qwen3CoderToolParser", "ReasoningParser", "SeedToolParser", "ToolParser",
    "get_reasoning_parser", "get_tool_parser",
]
