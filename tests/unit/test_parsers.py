"""Hermes tool-call parsing: golden cases, malformed output never raises."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentloop.errors import ConfigError
from agentloop.parsers import HermesToolParser, get_tool_parser
from agentloop.testing import FakeTokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def parse(text: str, tools=TOOLS):
    return HermesToolParser(FakeTokenizer()).parse_text(text, tools)


def test_single_call_and_content():
    content, calls = parse(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
        '"2 + 3"}}\n</tool_call>'
    )
    assert content == "Let me compute."
    got = [(c.name, json.loads(c.arguments), c.error) for c in calls]
    assert got == [("calculator", {"expression": "2 + 3"}, None)]
    assert calls[0].id.startswith("call_")


def test_parallel_calls_and_string_arguments():
    text = (
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
        '\\"1\\"}"}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    )
    _, calls = parse(text)
    assert [json.loads(c.arguments)["expression"] for c in calls] == ["1", "2"]
    assert calls[0].id != calls[1].id


def test_no_call_is_plain_content():
    assert parse("The answer is 5.") == ("The answer is 5.", [])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "'name'"),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be an object"),
        (
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
            "available tools: ['calculator']",
        ),
        ('thinking <tool_call>{"name": "calculator"', "not closed"),
    ],
)
def test_malformed_calls_carry_an_error(text, error):
    _, calls = parse(text)
    assert len(calls) == 1 and error in calls[0].error


def test_registry_and_async_entry_point():
    tok = FakeTokenizer()
    parser = get_tool_parser("hermes", tok)
    ids = tok.encode('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    content, calls = asyncio.run(parser.extract_tool_calls(ids, TOOLS))
    assert content == "" and calls[0].name == "calculator"
    with pytest.raises(ConfigError, match="hermes"):
        get_tool_parser("nope", tok)
