"""verl's tool, parser, schema, interaction and gpt-oss APIs as verl's agent loops use them, on
agentloop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentloop.compat.gpt_oss_utils import (
    add_generation_prompt_for_gpt_oss,
    build_gpt_oss_tool_response_text,
    format_gpt_oss_tool_response_manually,
)
from agentloop.errors import ConfigError
from agentloop.interactions import BaseInteraction, initialize_interactions_from_config
from agentloop.parsers import FunctionCall, ToolParser, get_tool_parser
from agentloop.testing import FakeTokenizer
from agentloop.tools import (
    FUNCTION_TOOL_REGISTRY,
    BaseTool,
    FunctionTool,
    Gsm8kTool,
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
    function_tool,
    get_function_tool,
    load_all_tools,
    load_function_tools_from_path,
    normalize_function_tool_return,
)
from agentloop.tools.registry import initialize_tools_from_config

TOK = FakeTokenizer()

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml with our class path.
GSM8K_YAML = """\
tools:
  - class_name: "agentloop.tools.gsm8k.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 otherwise)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
# What verl's OpenAIFunctionToolSchema.model_dump(exclude_unset=True, exclude_none=True) gives for
# it.
GSM8K_RENDERED = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer "
        "is correct, 0.0 otherwise)",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {
                    "type": "string",
                    "description": "The model's answer to the GSM8K math problem, must be a digits",
                }
            },
            "required": ["answer"],
        },
    },
}
# One row's tools_kwargs as verl's examples/data_preprocess/gsm8k_tool_agent_loop.py writes it.
GSM8K_TOOLS_KWARGS = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}

TYPED = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "typed",
            "description": "d",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
            },
        },
    }
)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def hermes_ids(*calls: tuple[str, dict[str, Any]], text: str = "") -> list[int]:
    blocks = "".join(
        f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls
    )
    return TOK.encode(text + blocks) + [TOK.eos_token_id]


def xml_ids(name: str, **params: str) -> list[int]:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return TOK.encode(f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>")


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    "tools",
    [
        # our schema objects (verl 0.9.1's loop)
        [TYPED],
        [TYPED.model_dump(exclude_unset=True, exclude_none=True)],  # dicts (our loop)
        # any object shaped like the schema
        [
            SimpleNamespace(
                type="function",
                function=SimpleNamespace(
                    name="typed",
                    parameters=SimpleNamespace(
                        model_dump=lambda **_: TYPED.function.parameters.model_dump()
                    ),
                ),
            )
        ],
    ],
)
def test_qwen3_coder_reads_parameter_types_from_schema_objects_and_dicts(tools):
    parser = get_tool_parser("qwen3_coder", TOK)
    content, calls = run(parser.extract_tool_calls(xml_ids("typed", n="7", s="7"), tools))
    assert (
        content == ""
        and json.loads(calls[0].arguments) == {"n": 7, "s": "7"}
        and calls[0].error is None
    )


def test_hermes_with_schema_objects_flags_unknown_tools_and_accepts_the_one_argument_form():
    parser = get_tool_parser("hermes", TOK)
    ids = hermes_ids(("typed", {"n": 1}), ("nope", {}), text="Sure. ")
    content, calls = run(parser.extract_tool_calls(ids, [TYPED]))
    assert content == "Sure." and calls[0].error is None and "unknown tool 'nope'" in calls[1].error
    content, calls = run(parser.extract_tool_calls(ids))  # verl 0.6.1: no tools, nothing is unknown
    assert [c.error for c in calls] == [None, None]


def test_tools_of_an_unusable_type_are_a_clear_error():
    with pytest.raises(ConfigError, match=r"tools\[0\].*int.*OpenAIFunctionToolSchema"):
        run(get_tool_parser("hermes", TOK).extract_tool_calls(hermes_ids(), [3]))


def test_function_call_tool_call_id_is_the_same_value_as_id():
    call = FunctionCall(name="f", arguments="{}", tool_call_id="call_7")
    assert call.id == call.tool_call_id == "call_7"
    call.tool_call_id = "call_8"
    assert call.id == "call_8"
    made_up = FunctionCall(name="f", arguments="{}", tool_call_id=None)
    assert made_up.tool_call_id == made_up.id and made_up.id.startswith("call_")
    _, (parsed,) = run(get_tool_parser("hermes", TOK).extract_tool_calls(hermes_ids(("f", {}))))
    assert parsed.tool_call_id == parsed.id


class SpecialTokenizer(FakeTokenizer):
    """FakeTokenizer plus a few stop tokens of other formats as single special tokens (ids
    3000+)."""

    EXTRA = {3000: "<|call|>", 3001: "<|observation|>", 3002: "<tool_call|>"}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return next((i for i, t in self.EXTRA.items() if t == token), None)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.EXTRA), None)
        if cut is None:
            return super().decode(ids, skip_special_tokens)
        marker = "" if skip_special_tokens else self.EXTRA[ids[cut]]
        return (
            self.decode(ids[:cut], skip_special_tokens)
            + marker
            + self.decode(ids[cut + 1 :], skip_special_tokens)
        )


@pytest.mark.parametrize(
    ("fmt", "stop"),
    [
        ("hermes", []),
        ("qwen3_coder", []),
        ("llama3_json", []),
        ("seed", []),
        ("minimax", []),
        ("deepseek_v4", []),
        # kimi: <|im_end|>, the fake's EOS
        ("gpt-oss", [3000]),
        ("glm", [3001]),
        ("gemma4", [3002]),
        ("kimi", [2]),
    ],
)
def test_stop_token_ids(fmt, stop):
    assert get_tool_parser(fmt, SpecialTokenizer()).stop_token_ids == stop


def test_no_stop_token_ids_when_the_tokenizer_lacks_the_token():
    assert get_tool_parser("gpt-oss", TOK).stop_token_ids == []


def test_stop_token_ids_with_a_real_tokenizer():
    pytest.importorskip("tokenizers")
    from agentloop.testing.templates import make_template_tokenizer

    tok = make_template_tokenizer("harmony")
    (call_id,) = get_tool_parser("gpt-oss", tok).stop_token_ids
    assert tok.convert_ids_to_tokens(call_id) == "<|call|>"


VERL_091_FORMATS = [
    "hermes", "gpt-oss", "qwen3_coder", "glm", "seed", "minimax", "kimi", "deepseek_v4", "gemma4",
]


@pytest.mark.parametrize("name", VERL_091_FORMATS)
def test_verl_parser_names_resolve(name):
    parser = ToolParser.get_tool_parser(name, TOK)
    assert isinstance(parser, ToolParser)
    assert run(parser.extract_tool_calls(TOK.encode("Just text."), [TYPED])) == ("Just text.", [])


def test_a_parser_written_against_verls_interface_works():
    @ToolParser.register("test_verl_style")
    class Upper(ToolParser):
        async def extract_tool_calls(self, responses_ids, tools=None):
            return self.tokenizer.decode(responses_ids).upper(), []

    parser = get_tool_parser("test_verl_style", TOK)
    assert (
        run(parser.extract_tool_calls(TOK.encode("hi"))) == ("HI", [])
        and parser.stop_token_ids == []
    )
    with pytest.raises(NotImplementedError, match="implement one of them"):
        ToolParser(TOK).parse_text("x")


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize(("arguments", "expected", "error"), [
    ('{"a": 1}', {"a": 1}, False), ("{}", {}, False), ("{not json", {}, True), ("[1, 2]", {}, True),
    ('"text"', {}, True), ("", {}, True),
])
def test_parsed_call_decodes_arguments_and_reports_decode_errors(arguments, expected, error):
    call, has_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name="f", arguments=arguments))
    assert (call.name, call.arguments, has_error) == ("f", expected, error)


def test_assistant_tool_call_entry_as_verl_0_9_builds_it():
    parsed = FunctionCall(name="f", arguments='{"x": 2}', tool_call_id="call_1")
    function, has_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name=parsed.name, arguments=parsed.arguments))
    entry = OpenAIFunctionToolCall(id=parsed.tool_call_id, function=function)
    assert not has_error and entry.model_dump() == {
        "id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 2}},
    }


def test_schema_renders_like_verls_for_verls_gsm8k_yaml(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_YAML)
    (tool,) = initialize_tools_from_config(path)
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == GSM8K_RENDERED


def test_tool_response_helpers_and_single_image_error():
    assert ToolResponse().is_empty() and not ToolResponse(text="a").is_empty()
    assert (
        ToolResponse(text="a").is_text_only()
        and not ToolResponse(text="a", image=["img"]).is_text_only()
    )
    with pytest.raises(ValueError, match=r"wrap a single image in a list"):
        ToolResponse(image="img")


# ---------------------------------------------------------------- BaseTool


class Recorder(BaseTool):
    """Remembers what create / execute received."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema or {"type": "function", "function": {"name": "rec"}})
        self.seen: dict[str, Any] = {}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id, **kwargs)
        self.seen[instance_id] = self.create_kwargs(kwargs)
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return ToolResponse(text=json.dumps(sorted(kwargs))), 0.0, {}


def test_base_tool_create_forms_give_the_same_kwargs_and_execute_takes_agent_data():
    tool = Recorder()
    nested, _ = run(tool.create(create_kwargs={"ground_truth": "1"}))  # verl's agent loops
    flat, _ = run(tool.create("req-1", ground_truth="1"))             # verl's SGLang rollout
    assert flat == "req-1" and tool.seen[nested] == tool.seen[flat] == {"ground_truth": "1"}
    response, _, _ = run(tool.execute(flat, {}, agent_data=object()))
    assert response.text == '["agent_data"]'
    assert tool.get_openai_tool_schema().function.name == tool.name == "rec"


def test_base_tool_schema_from_an_override_or_a_clear_error():
    class Own(BaseTool):
        def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
            return TYPED

    assert Own({}, None).name == "typed"
    with pytest.raises(ConfigError, match="BaseTool has no tool schema"):
        BaseTool({})


# ---------------------------------------------------------------- function tools (verl 0.9.1)


@pytest.mark.parametrize(
    ("ret", "text", "reward", "metrics"),
    [
        ("plain", "plain", 0.0, {}), (ToolResponse(text="r"), "r", 0.0, {}),
        ({"a": [1]}, '{"a": [1]}', 0.0, {}), (("t",), "t", 0.0, {}), (("t", 2), "t", 2.0, {}),
        (("t", None, None), "t", 0.0, {}), (("t", 0.5, {"k": 1}), "t", 0.5, {"k": 1}),
        (({"a": 1}, 1), '{"a": 1}', 1.0, {}), (7, "7", 0.0, {}), (None, "None", 0.0, {}),
        (["a"], "['a']", 0.0, {}), (("t", False), "t", 0.0, {}),
    ],
)
def test_normalize_function_tool_return_shapes(ret, text, reward, metrics):
    response, got_reward, got_metrics = normalize_function_tool_return(ret)
    assert (response.text, got_reward, got_metrics) == (text, reward, metrics)
    assert isinstance(got_reward, float)


@pytest.mark.parametrize("ret", [(), ("a", 1, {}, "extra")])
def test_normalize_refuses_tuples_of_other_lengths(ret):
    with pytest.raises(TypeError, match=f"length {len(ret)}"):
        normalize_function_tool_return(ret)


@function_tool("verl_api_lookup")
async def _lookup(key: str, default: int = 0) -> tuple[str, float, dict[str, Any]]:
    """Look a key up.

    Args:
        key: The key.
        default: Returned when missing.
    """
    return f"{key}={default}", 0.25, {"hits": 1}


def test_function_tool_call_returns_the_raw_value_as_verls_loop_expects():
    tool = _lookup()
    assert isinstance(tool, FunctionTool) and isinstance(tool, BaseTool)
    assert tool.name == "verl_api_lookup" and tool.is_async
    raw = run(tool.call({"key": "k"}))
    assert raw == ("k=0", 0.25, {"hits": 1})
    response, reward, metrics = normalize_function_tool_return(raw)
    assert (response.text, reward, metrics) == ("k=0", 0.25, {"hits": 1})
    # our path gives the same triple
    assert run(tool.execute("i", {"key": "k"}))[1:] == (0.25, {"hits": 1})
    with pytest.raises(ValueError, match=r"missing required \['key'\]"):
        run(tool.call({}))
    assert get_function_tool("verl_api_lookup").name == "verl_api_lookup"


def test_function_tool_built_directly_and_with_a_given_schema():
    def double(x: int) -> int:
        """Double it."""
        return 2 * x

    direct = FunctionTool(name="double", fn=double, tool_schema=None)
    assert direct.name == "double" and not direct.is_async and run(direct.call({"x": 4})) == 8
    schema = {
        "type": "function",
        "function": {
            "name": "twice",
            "description": "given",
            "parameters": {
                "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
            },
        },
    }
    given = function_tool(schema=schema)(double)()
    assert given.name == "twice" and given.tool_schema.function.description == "given"
    assert run(given.execute("i", {"x": 2}))[0].text == "4"
    with pytest.raises(ConfigError, match="has no function"):
        FunctionTool()


TOOLS_FILE = '''
from agentloop.tools.function_tool import function_tool


@function_tool
def verl_api_echo(text: str) -> str:
    """Echo the text.

    Args:
        text: What to echo.
    """
    return text


@function_tool("verl_api_shout")
def shout(text: str) -> dict:
    """Shout the text.

    Args:
        text: What to shout.
    """
    return {"loud": text.upper()}
'''


def test_load_all_tools_from_a_yaml_and_a_python_file(tmp_path):
    yaml_path, py_path = tmp_path / "tools.yaml", tmp_path / "fns.py"
    yaml_path.write_text(GSM8K_YAML)
    py_path.write_text(TOOLS_FILE)
    tools = load_all_tools(tool_config_path=str(yaml_path), function_tool_path=str(py_path))
    assert [t.name for t in tools] == ["calc_gsm8k_reward", "verl_api_echo", "verl_api_shout"]
    assert isinstance(tools[0], Gsm8kTool) and all(isinstance(t, FunctionTool) for t in tools[1:])
    assert run(tools[2].call({"text": "hi"})) == {"loud": "HI"}
    assert [t.name for t in load_all_tools(function_tool_path=py_path)] == [
        "verl_api_echo",
        "verl_api_shout",
    ]
    assert load_all_tools() == [] and load_all_tools(None, None) == []
    assert "verl_api_shout" in FUNCTION_TOOL_REGISTRY


def test_load_all_tools_errors(tmp_path):
    clash_yaml, clash_py = tmp_path / "clash.yaml", tmp_path / "clash.py"
    clash_yaml.write_text(GSM8K_YAML)
    clash_py.write_text(
        "from agentloop.tools import function_tool\n\n"
        "@function_tool\ndef calc_gsm8k_reward(answer: str) -> str:\n    "
        "return answer\n"
    )
    with pytest.raises(ConfigError, match=r"\['calc_gsm8k_reward'\].*unique"):
        load_all_tools(clash_yaml, clash_py)
    dup = tmp_path / "dup.py"
    dup.write_text("from agentloop.tools import function_tool\n\n"
                   "@function_tool('same')\ndef a(x: int) -> int:\n    return x\n\n"
                   "@function_tool('same')\ndef b(x: int) -> int:\n    return x\n")
    with pytest.raises(ConfigError, match=r"several tools named \['same'\]"):
        load_function_tools_from_path(dup)
    with pytest.raises(ConfigError, match="is not a file"):
        load_function_tools_from_path(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match="broken.py.*failed to run: ModuleNotFoundError"):
        load_function_tools_from_path(broken)
    mcp = tmp_path / "mcp.yaml"
    mcp.write_text(
        "tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n    "
        "config: {type: mcp}\n"
    )
    # type: mcp is accepted (tests/unit/test_tools_mcp.py); its class must be an MCPTool
    with pytest.raises(ConfigError, match=r"mcp.yaml tools\[0\].*needs class_name to be an MCPTool"):
        load_all_tools(mcp)
    other = tmp_path / "other.yaml"
    other.write_text(
        "tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n    "
        "config: {type: sandbox}\n"
    )
    with pytest.raises(
        ConfigError, match=r"other.yaml tools\[0\].*config.type 'sandbox' is not supported"
    ):
        load_all_tools(other)


# ---------------------------------------------------------------- Gsm8kTool with verl's config and
# data


@pytest.mark.parametrize("form", ["create_kwargs", "spread"])
@pytest.mark.parametrize(
    ("answer", "reward"), [("72", 1.0), ("#### 72", 1.0), ("71", 0.0), ("no idea", 0.0)]
)
def test_gsm8k_tool_with_verls_config_and_dataset_tools_kwargs(tmp_path, form, answer, reward):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_YAML)
    (tool,) = load_all_tools(tool_config_path=path)
    create_kwargs = GSM8K_TOOLS_KWARGS[tool.name]["create_kwargs"]

    async def episode() -> tuple[float, float]:
        if form == "create_kwargs":  # verl's agent loops
            instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        else:                        # verl's SGLang rollout
            instance_id, _ = await tool.create("request-1", **create_kwargs)
        _, step_reward, _ = await tool.execute(instance_id, {"answer": answer}, agent_data=None)
        final = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return step_reward, final

    assert run(episode()) == (reward, reward)


# ---------------------------------------------------------------- interactions


class GradeInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "ok", 1.0, {}


def test_interactions_are_named_as_verl_names_them(tmp_path):
    path = tmp_path / "interactions.yaml"
    path.write_text(
        f"interaction:\n  - class_name: {__name__}.GradeInteraction\n    config: {{}}\n"
        f"  - name: second\n    class_name: {__name__}.GradeInteraction\n    "
        f"config: {{k: 1}}\n"
    )
    interactions = initialize_interactions_from_config(path)
    assert list(interactions) == ["grade", "second"]
    assert interactions["grade"].name == "grade" and interactions["second"].config == {
        "k": 1,
        "name": "second",
    }
    grade = interactions["grade"]
    instance_id = run(grade.start_interaction(None, ground_truth="1"))
    assert run(grade.generate_response(instance_id, [])) == (True, "ok", 1.0, {})
    # verl's arities
    assert run(grade.calculate_score()) == 0.0 and run(grade.finalize_interaction()) is None


# ---------------------------------------------------------------- gpt-oss helpers (verl 0.6.1)


def test_gpt_oss_tool_turn_text():
    one = format_gpt_oss_tool_response_manually("12 C", "get_weather")
    assert (
        one == "<|start|>functions.get_weather "
        "to=assistant<|channel|>commentary<|message|>12 C<|end|>"
    )
    assert add_generation_prompt_for_gpt_oss(one) == one + "<|start|>assistant"
    messages = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    text = build_gpt_oss_tool_response_text(messages, ["f", "g"])
    assert text == (
        format_gpt_oss_tool_response_manually("a", "f")
        + format_gpt_oss_tool_response_manually("b", "g")
        + "<|start|>assistant"
    )
    with pytest.raises(ConfigError, match="one name per message"):
        build_gpt_oss_tool_response_text(messages, ["f"])


# ---------------------------------------------------------------- a verl-shaped tool turn on our
# tools


async def verl_style_call(
    tool: Any, call: FunctionCall, tools_kwargs: dict[str, Any]
) -> tuple[ToolResponse, float]:
    """The contract verl 0.9.1's loop relies on: function tools are called, other tools go
    through their life cycle."""
    args = json.loads(call.arguments)
    if isinstance(tool, FunctionTool):
        response, reward, _ = normalize_function_tool_return(await tool.call(args))
        return response, reward
    instance_id, _ = await tool.create(
        create_kwargs=tools_kwargs.get(tool.name, {}).get("create_kwargs", {})
    )
    try:
        response, reward, _ = await tool.execute(instance_id, args, agent_data=SimpleNamespace())
    finally:
        await tool.release(instance_id)
    return response, reward


def test_a_verl_shaped_tool_turn_runs_on_tools_from_load_all_tools(tmp_path):
    (tmp_path / "tools.yaml").write_text(GSM8K_YAML)
    (tmp_path / "fns.py").write_text(TOOLS_FILE)
    tools = {t.name: t for t in load_all_tools(tmp_path / "tools.yaml", Path(tmp_path / "fns.py"))}
    ids = hermes_ids(("calc_gsm8k_reward", {"answer": "72"}), ("verl_api_echo", {"text": "x"}))
    schemas = [t.tool_schema for t in tools.values()]
    _, calls = run(get_tool_parser("hermes", TOK).extract_tool_calls(ids, schemas))
    results = [run(verl_style_call(tools[c.name], c, GSM8K_TOOLS_KWARGS)) for c in calls]
    assert [(r.text, reward) for r, reward in results] == [
        ("Parsed answer: 72. The answer is correct.", 1.0), ("x", 0.0)]
