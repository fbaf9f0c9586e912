"""Tool-call formats beyond hermes (Qwen3-Coder, Llama 3 JSON, gpt-oss and verl 0.9.1's glm, seed,
minimax, kimi, deepseek_v4, gemma4): golden cases, malformed output never raises."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from agentloop.errors import ConfigError
from agentloop.parsers import get_tool_parser
from agentloop.parsers.gpt_oss import GptOssToolParser
from agentloop.parsers.llama3_json import Llama3JsonToolParser
from agentloop.parsers.qwen3_coder import Qwen3CoderToolParser
from agentloop.testing import FakeTokenizer


def tool(name: str, **props: Any) -> dict[str, Any]:
    schema = {"type": "object", "properties": {p: {"type": t} for p, t in props.items()}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    tool("calculator", expression="string"),
    tool(
        "typed", n="integer", x="number", flag="boolean", obj="object", items="array",
        text="string", nothing="null", maybe=["string", "null"], alias="int",
    ),
]


def args(call) -> dict[str, Any]:
    return json.loads(call.arguments)


class MarkerTokenizer:
    """Ids 0..k-1 are special tokens (dropped by ``skip_special_tokens``); other ids are UTF-8
    bytes + 100."""

    SPECIAL = (
        "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
        "<|call|>", "<|python_tag|>", "<|eot_id|>",
    )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in re.split("(" + "|".join(map(re.escape, self.SPECIAL)) + ")", text):
            ids += (
                [self.SPECIAL.index(part)]
                if part in self.SPECIAL
                else [b + 100 for b in part.encode()]
            )
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 100:
                out.append(buf.decode())
                buf = bytearray()
                out.append("" if skip_special_tokens else self.SPECIAL[i])
            else:
                buf.append(i - 100)
        return "".join(out) + buf.decode()


# --- qwen3_coder
# -------------------------------------------------------------------------------------------


def qwen(text: str, tools=TOOLS):
    return Qwen3CoderToolParser(FakeTokenizer()).parse_text(text, tools)


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_single_call_and_content():
    content, calls = qwen(
        "Let me compute.\n" + xml_call("calculator", expression="2 + 3") + "\nDone"
    )
    assert content == "Let me compute.\n\nDone"
    assert [(c.name, args(c), c.error) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, None)
    ]
    assert calls[0].id.startswith("call_")


def test_qwen3_coder_several_calls():
    two_in_one = (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n3\n</parameter>\n</function>\n"
        "<function=calculator>\n<parameter=expression>\n4\n</parameter>\n</function>\n</tool_call>"
    )
    text = (
        xml_call("calculator", expression="1")
        + "\n"
        + xml_call("calculator", expression="2")
        + two_in_one
    )
    content, calls = qwen(text)
    assert content == ""
    assert [args(c)["expression"] for c in calls] == ["1", "2", "3", "4"]
    assert all(c.error is None for c in calls) and len({c.id for c in calls}) == 4


@pytest.mark.parametrize(
    ("param", "raw", "value"),
    [
        ("n", "42", 42),
        ("n", "-7", -7),
        ("n", "5.0", 5),
        ("x", "2.5", 2.5),
        ("x", "4", 4),
        ("x", "1e3", 1000.0),
        ("flag", "true", True),
        ("flag", "False", False),
        ("obj", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        ("items", '[1, "two", 3.0]', [1, "two", 3.0]),
        ("text", "line one\n  line two", "line one\n  line two"),
        # only the template's own ones go
        ("text", "\nkeeps inner newlines\n", "\nkeeps inner newlines\n"),
        ("text", "  42  ", "  42  "),
        ("nothing", "null", None),
        ("maybe", "null", None),
        ("maybe", "hello", "hello"),
        ("alias", "3", 3),
        ("unknown_param", "7", 7),
        ("unknown_param", '{"k": 1}', {"k": 1}),
        ("unknown_param", "plain words", "plain words"),
    ],
)
def test_qwen3_coder_coerces_to_the_schema_type(param, raw, value):
    _, calls = qwen(xml_call("typed", **{param: raw}))
    assert calls[0].error is None
    assert args(calls[0]) == {param: value}
    assert type(args(calls[0])[param]) is type(value)


def test_qwen3_coder_without_tools_guesses_json():
    _, calls = qwen(xml_call("anything", a="1", b="[1]", c="word", d="\nmulti\nline\n"), tools=None)
    assert calls[0].error is None
    assert args(calls[0]) == {"a": 1, "b": [1], "c": "word", "d": "\nmulti\nline\n"}


@pytest.mark.parametrize(
    ("param", "raw"),
    [
        ("n", "four"), ("n", "2.5"), ("x", "nan"), ("flag", "yes"), ("obj", "[1, 2]"),
        ("obj", "{broken"), ("items", '{"a": 1}'), ("nothing", "0"),
    ],
)
def test_qwen3_coder_value_of_the_wrong_type_is_kept_as_string_with_an_error(param, raw):
    _, calls = qwen(xml_call("typed", **{param: raw}))
    assert args(calls[0]) == {param: raw}
    assert param in calls[0].error and "expected" in calls[0].error


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "thinking "
            "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n",
            "not closed",
        ),
        (
            "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</tool_call>",
            "not closed with </function>",
        ),
        (
            "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</function>\n</tool_call>",
            "not closed with </parameter>",
        ),
        ('<tool_call>\n{"name": "calculator"}\n</tool_call>', "no <function=NAME>"),
        ("<tool_call></tool_call>", "no <function=NAME>"),
        ("<tool_call><function=>\n</function></tool_call>", "malformed <function=NAME>"),
        (
            "<tool_call><function=calculator><parameter=>1</parameter></function></tool_call>",
            "malformed <parameter",
        ),
        (xml_call("search", query="x"), "available tools: ['calculator', 'typed']"),
        (
            "<tool_call><function=calculator><parameter=expression>1</parameter><parameter=expression>2</parameter>"
            "</function></tool_call>",
            "given twice",
        ),
    ],
)
def test_qwen3_coder_malformed_calls_carry_an_error(text, error):
    _, calls = qwen(text)
    assert len(calls) == 1 and error in calls[0].error


def test_qwen3_coder_plain_and_empty_text():
    assert qwen("The answer is 5.") == ("The answer is 5.", [])
    assert qwen("") == ("", [])
    assert qwen("<function=calculator> outside a block") == (
        "<function=calculator> outside a block",
        [],
    )


# --- llama3_json
# -------------------------------------------------------------------------------------------


def llama(text: str, tools=TOOLS):
    return Llama3JsonToolParser(FakeTokenizer()).parse_text(text, tools)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "calculator", "parameters": {"expression": "2 + 3"}}',
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2 + 3"}}',
        '  \n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n',
        '{"name": "calculator", "parameters": "{\\"expression\\": \\"2 + 3\\"}"}',
    ],
)
def test_llama3_single_call(text):
    content, calls = llama(text)
    assert content == ""
    assert [(c.name, args(c), c.error) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, None)
    ]


def test_llama3_several_calls():
    text = ('{"name": "calculator", "parameters": {"expression": "1; 2"}}; '
            '{"name": "calculator", "parameters": {"expression": "3"}};\n'
            '{"name": "typed", "parameters": {}}\n{"name": "typed"};')
    content, calls = llama(text)
    assert content == ""
    assert [(c.name, args(c)) for c in calls] == [
        ("calculator", {"expression": "1; 2"}), ("calculator", {"expression": "3"}), ("typed", {}),
        ("typed", {}),
    ]
    assert all(c.error is None for c in calls)


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 5.", 'Use {"name": "calculator"} like this.', "[1, 2]",
        "<|python_tag|>print(1)", "",
    ],
)
def test_llama3_text_not_starting_with_a_brace_is_content(text):
    content, calls = llama(text)
    assert calls == [] and content == text.replace("<|python_tag|>", "").strip()


@pytest.mark.parametrize(
    ("text", "error", "good_calls"),
    [
        ('{"name": "calculator", "parameters": {"expression": ', "not valid JSON", 0),
        ("{not json}", "not valid JSON", 0), ('{"parameters": {}}', "'name'", 0),
        ('{"name": "calculator", "parameters": [1]}', "must be an object", 0),
        ('{"name": "calculator", "parameters": "nope"}', "not a JSON object", 0),
        ('{"name": "search", "parameters": {}}', "available tools: ['calculator', 'typed']", 0),
        ('{"name": "calculator", "parameters": {}} and then some text', "unexpected text", 1),
        ('{"name": "calculator", "parameters": {}}; {"name": "calc', "not valid JSON", 1),
    ],
)
def test_llama3_malformed_calls_carry_an_error(text, error, good_calls):
    content, calls = llama(text)
    assert content == ""
    assert [c.error is None for c in calls] == [True] * good_calls + [False]
    assert error in calls[-1].error


# --- gpt-oss (harmony)
# -------------------------------------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>Need the calculator.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json'
        '<|message|>{"expression": "2 + 3"}<|call|>')


def harmony(text: str, tools=TOOLS):
    parser = GptOssToolParser(FakeTokenizer())
    content, calls = parser.parse_text(text, tools)
    return content, calls, parser.last_reasoning


def test_gpt_oss_analysis_then_call():
    content, calls, reasoning = harmony(ANALYSIS + CALL)
    assert content == "" and reasoning == "Need the calculator."
    assert [(c.name, args(c), c.error) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, None)
    ]


@pytest.mark.parametrize(
    "header",
    [
        # our harmony template
        "<|start|>assistant to=functions.calculator<|channel|>commentary json",
        "<|channel|>commentary to=functions.calculator json",
        "<|channel|>commentary to=functions.calculator<|constrain|>json",
    ],
)
def test_gpt_oss_recipient_before_or_after_the_channel(header):
    _, calls, _ = harmony(header + '<|message|>{"expression": "1"}<|call|>')
    assert [(c.name, args(c), c.error) for c in calls] == [
        ("calculator", {"expression": "1"}, None)
    ]


def test_gpt_oss_several_calls_and_a_preamble():
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking two things.<|end|>"
    second = CALL.replace("2 + 3", "4 * 5")
    content, calls, reasoning = harmony(ANALYSIS + preamble + CALL + second)
    assert content == "Checking two things." and reasoning == "Need the calculator."
    assert [args(c)["expression"] for c in calls] == ["2 + 3", "4 * 5"]
    assert all(c.error is None for c in calls)


def test_gpt_oss_final_answer():
    content, calls, reasoning = harmony(
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 5.<|return|>"
    )
    assert (content, calls, reasoning) == ("It is 5.", [], "Need the calculator.")
    assert harmony("<|channel|>final<|message|>Cut off mid-sent") == ("Cut off mid-sent", [], "")


def test_gpt_oss_without_final_channel():
    assert harmony("plain text, no harmony<|return|>") == ("plain text, no harmony", [], "")
    assert harmony("<|channel|>analysis<|message|>thinking, cut off") == (
        "", [], "thinking, cut off",
    )
    assert harmony("") == ("", [], "")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (CALL.replace('{"expression": "2 + 3"}', '{"expression": '), "not valid JSON"),
        (CALL.replace("<|call|>", ""), None),  # closing token missing, JSON complete: accepted
        (CALL.replace('{"expression": "2 + 3"}', "[1, 2]"), "must be a JSON object"),
        (CALL.replace('{"expression": "2 + 3"}', ""), "not valid JSON"),
        (
            CALL.replace("functions.calculator", "functions.search"),
            "available tools: ['calculator', 'typed']",
        ),
        (
            CALL.replace("functions.calculator", "browser.search"),
            "unsupported recipient 'browser.search'",
        ),
        (CALL.replace("functions.calculator", "functions."), "unsupported recipient"),
    ],
)
def test_gpt_oss_malformed_calls_carry_an_error(text, error):
    _, calls, _ = harmony(ANALYSIS + text)
    assert len(calls) == 1
    assert calls[0].error == error if error is None else error in calls[0].error


def test_gpt_oss_decodes_with_special_tokens():
    tok = MarkerTokenizer()
    parser = get_tool_parser("gpt-oss", tok)
    final = "<|start|>assistant<|channel|>final<|message|>It is 5.<|return|>"
    assert asyncio.run(parser.extract_tool_calls(tok.encode(ANALYSIS + final), TOOLS)) == (
        "It is 5.",
        [],
    )
    content, calls = asyncio.run(parser.extract_tool_calls(tok.encode(ANALYSIS + CALL), TOOLS))
    assert content == "" and calls[0].name == "calculator" and calls[0].error is None


# --- verl 0.9.1's other formats
# ---------------------------------------------------------------------------

FAKE = FakeTokenizer()
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
DSML = "｜DSML｜"


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (
            "glm",
            "<think>hmm</think>Let me "
            "check.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>007</arg_value>"
            "\n<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
            "Let me check.",
            [("weather", {"city": "007", "days": 3}, None)],
        ),
        (
            "glm", "<tool_call>weather<arg_key>city</arg_key></tool_call>", "",
            [("weather", {}, "has no <arg_value>")],
        ),
        (
            "glm", "<tool_call>weather<arg_key>days</arg_key><arg_value>x</arg_value>", "",
            [("", None, "block is not closed")],
        ),
        (
            "seed",
            "Ok.<seed:tool_call>\n<function=weather>\n<parameter=days>\n4\n</parameter>\n</function>\n"
            "</seed:tool_call><|im_end|>",
            "Ok.",
            [("weather", {"days": 4}, None)],
        ),
        (
            "minimax",
            'A<minimax:tool_call>\n<invoke name="weather">\n<parameter '
            'name="city">Oslo</parameter>\n</invoke>'
            '\n<invoke name="other"></invoke>\n</minimax:tool_call>',
            "A",
            [("weather", {"city": "Oslo"}, None), ("other", {}, "unknown tool 'other'")],
        ),
        (
            "minimax",
            '<minimax:tool_call><invoke name="weather"><parameter name="days">2</parameter>', "",
            [("weather", {"days": 2}, "block is not closed")],
        ),
        (
            "kimi",
            "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>"
            '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
            "Sure.",
            [("weather", {"city": "Oslo"}, None)],
        ),
        (
            "kimi",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:1<|tool_call_argument_begin|>{bad"
            "<|tool_call_end|><|tool_call_begin|>functions.weather:2<|tool_call_argument_begin|>{}",
            "",
            [("weather", None, "not valid JSON"), ("weather", None, "not closed")],
        ),
        (
            "deepseek_v4",
            f"plan</think>Checking.\n\n<{DSML}tool_calls>\n<{DSML}invoke "
            f'name="weather">\n'
            f'<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n'
            f'<{DSML}parameter name="days" '
            f'string="false">5</{DSML}parameter>\n</{DSML}invoke>\n'
            f"</{DSML}tool_calls><｜end▁of▁sentence｜>",
            "Checking.",
            [("weather", {"city": "Oslo", "days": 5}, None)],
        ),
        (
            "deepseek_v4",
            f'<{DSML}tool_calls><{DSML}invoke name="weather"><{DSML}parameter '
            f'name="days" string="false">'
            f"five</{DSML}parameter></{DSML}invoke></{DSML}tool_calls>",
            "",
            [("weather", {"days": "five"}, 'marked string="false" but is not valid JSON')],
        ),
        (
            "gemma4",
            'Sure.<|tool_call>call:weather{city:<|"|>Oslo, '
            'NO<|"|>,days:3,opts:{metric:true,tags:[1,<|"|>a<|"|>]},'
            "x:null}<tool_call|>",
            "Sure.",
            [
                (
                    "weather",
                    {
                        "city": "Oslo, NO", "days": 3, "opts": {"metric": True, "tags": [1, "a"]},
                        "x": None,
                    },
                    "unknown tool",
                )
            ],
        ),
        (
            "gemma4", '<|tool_call>call:weather{city:<|"|>Oslo}<tool_call|><|tool_call>weather{}',
            "", [("weather", None, "do not parse"), ("", None, "not closed")],
        ),
    ],
)
def test_verl_091_formats(fmt, text, content, calls):
    tools = (
        [WEATHER] if fmt != "gemma4" else [{"type": "function", "function": {"name": "weather_v2"}}]
    )
    got_content, got = asyncio.run(
        get_tool_parser(fmt, FAKE).extract_tool_calls(FAKE.encode(text), tools)
    )
    assert got_content == content and len(got) == len(calls)
    for call, (name, args, error) in zip(got, calls, strict=True):
        assert call.name == name
        assert args is None or json.loads(call.arguments) == args
        assert call.error is None if error is None else error in call.error


def test_kimi_keeps_the_model_written_call_id():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:3<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    _, (call,) = asyncio.run(
        get_tool_parser("kimi", FAKE).extract_tool_calls(FAKE.encode(text), [WEATHER])
    )
    assert call.tool_call_id == call.id == "functions.weather:3" and call.name == "weather"


# --- token ids, real tokenizers, registry
# ------------------------------------------------------------------


def test_token_id_entry_points():
    tok = MarkerTokenizer()
    content, calls = asyncio.run(get_tool_parser("llama3_json", tok).extract_tool_calls(
        tok.encode('<|python_tag|>{"name": "calculator", "parameters": {}}<|eot_id|>'), TOOLS))
    assert content == "" and calls[0].name == "calculator" and calls[0].error is None
    fake = FakeTokenizer()
    ids = fake.encode(xml_call("typed", n="1")) + [fake.eos_token_id]
    content, calls = asyncio.run(
        get_tool_parser("qwen3_coder", fake).extract_tool_calls(ids, TOOLS)
    )
    assert content == "" and args(calls[0]) == {"n": 1}


@pytest.mark.parametrize(
    ("family", "fmt", "response"),
    [
        ("harmony", "gpt_oss", ANALYSIS + CALL),
        (
            "llama3_json", "llama3_json",
            '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eot_id|>',
        ),
    ],
)
def test_round_trip_through_a_template_tokenizer(family, fmt, response):
    pytest.importorskip("tokenizers")
    from agentloop.testing.templates import make_template_tokenizer

    tok = make_template_tokenizer(family)
    ids = tok.encode(response, add_special_tokens=False)
    content, calls = asyncio.run(get_tool_parser(fmt, tok).extract_tool_calls(ids, TOOLS))
    assert content == ""
    assert [(c.name, args(c), c.error) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, None)
    ]


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("qwen3_coder", Qwen3CoderToolParser), ("llama3_json", Llama3JsonToolParser),
        ("gpt-oss", GptOssToolParser), ("gpt_oss", GptOssToolParser),
    ],
)
def test_registry(name, cls):
    assert type(get_tool_parser(name, FakeTokenizer())) is cls


def test_unknown_parser_lists_the_registered_names():
    with pytest.raises(ConfigError) as info:
        get_tool_parser("nope", FakeTokenizer())
    for name in ("gpt-oss", "gpt_oss", "hermes", "llama3_json", "qwen3_coder"):
        assert repr(name) in str(info.value)
