"""A calculator agent written as plain OpenAI-SDK code — nothing here knows about agentloop.

It reads the conversation from AGENTLOOP_RAW_PROMPT (JSON) and the endpoint from the standard
OPENAI_BASE_URL / OPENAI_API_KEY variables, calls the model with a `calculator` tool, runs the tool
calls itself, sends the results back, and stops when the model answers without a tool call.
"""

from __future__ import annotations

import ast
import json
import operator
import os

from openai import OpenAI

CALCULATOR = {  # the schema the tiny model was trained with
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
_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Safe arithmetic (no eval)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    messages = json.loads(os.environ["AGENTLOOP_RAW_PROMPT"])
    for _ in range(4):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], max_tokens=96
        )
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls or []:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except json.JSONDecodeError:
                expression = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))}
            )


if __name__ == "__main__":
    main()
