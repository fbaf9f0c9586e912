"""schema_json.tools_json: the tool schemas' JSON remembered per list, never stale after an edit."""

from __future__ import annotations

import json

import pytest

from agentloop.loops.prompt import apply_chat_template
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.tokenization.schema_json import tools_json


def _schema(description: str) -> dict:
    return {"type": "function", "function": {
        "name": "calculator", "description": description,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}


def test_same_text_as_json_dumps_and_follows_in_place_edits():
    tools = [_schema("Evaluate an expression.")]
    assert tools_json(tools) == json.dumps(tools, ensure_ascii=False)
    assert tools_json(tools) == json.dumps(tools, ensure_ascii=False)  # remembered
    tools[0]["function"]["description"] = "Évalue une expression."  # edited in place
    assert tools_json(tools) == json.dumps(tools, ensure_ascii=False)
    tools.append(_schema("second"))
    assert tools_json(tools) == json.dumps(tools, ensure_ascii=False)


def test_not_json_raises():
    with pytest.raises(TypeError, match="not JSON"):
        tools_json([{"f": object()}])


def test_render_cache_sees_a_schema_edited_in_place():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    tools = [_schema("Adds numbers.")]
    first = apply_chat_template(tok, messages, tools=tools, add_generation_prompt=True)
    assert apply_chat_template(tok, messages, tools=tools, add_generation_prompt=True) == first
    tools[0]["function"]["description"] = "Multiplies numbers, and subtracts them."
    edited = apply_chat_template(tok, messages, tools=tools, add_generation_prompt=True)
    whole = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                    tokenize=False)
    assert edited != first
    assert edited == tok(whole, add_special_tokens=False)["input_ids"]
