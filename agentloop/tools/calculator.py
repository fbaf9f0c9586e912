"""A calculator tool: evaluates arithmetic safely (an AST walk, never ``eval``).

Supports integers and decimals, ``+ - * / // % **``, unary signs and parentheses.  Exponents are
capped (|exponent| <= 64) and results larger than 10**100 are refused, so a hostile expression
cannot hang a worker.  Errors come back to the model as text.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from agentloop.tools.base import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_LIMIT = 10**100

# The exact schema the tiny test model is trained on (agentloop.testing.tiny_model): keep it
# byte-stable.
CALCULATOR_TOOL_DICT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with integers and the operators "
        "+, - and *.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression, e.g. 12 * 7"}
            },
            "required": ["expression"],
        },
    },
}
CALCULATOR_SCHEMA = OpenAIFunctionToolSchema.model_validate(CALCULATOR_TOOL_DICT)


def evaluate(expression: str) -> int | float:
    """Evaluate ``expression``; raises ValueError with a readable message on anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (limit 64)")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise ValueError("division by zero") from e
        if abs(value) > _LIMIT:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported element {type(node).__name__} in expression")


def format_number(value: int | float) -> str:
    """Integers as integers; floats rounded to 10 significant digits without a trailing ``.0``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class CalculatorTool(BaseTool):
    """``calculator(expression)`` → the value as text."""

    def __init__(
        self, config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | None = None,
    ):
        super().__init__(config or {}, tool_schema or CALCULATOR_SCHEMA)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="Error: 'expression' must be a string"), 0.0, {"ok": False}
        try:
            return ToolResponse(text=format_number(evaluate(expression))), 0.0, {"ok": True}
        except ValueError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"ok": False}
