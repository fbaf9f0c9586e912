"""A tiny MCP server for examples/environments/mcp.yaml: one `calculator` tool, over stdio.

Written with the mcp SDK only (FastMCP; named MCPServer in mcp 2.x), as a user's own server would
be; agentloop starts it as a subprocess (see mcp_servers.json) and lists its tools.
Run it alone with `python examples/environments/mcp_server.py` (it then waits for a client on
stdin).
"""

from __future__ import annotations

import ast
import operator

try:
    from mcp.server.mcpserver import MCPServer as FastMCP  # mcp 2.x
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP

server = FastMCP("calculator")

_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _value(node: ast.AST) -> float:
    """The value of an arithmetic expression tree (numbers and + - * / // % only)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)}")


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * (3 + 4)' (numbers, + - * / // %)."""
    result = _value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else result)


if __name__ == "__main__":
    server.run()
