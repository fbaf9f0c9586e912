"""@function_tool schemas and calls, Gsm8kTool rewards, YAML loading, and tool images in
ToolAgentLoop."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.config import default_config
from agentloop.errors import ConfigError
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.loops.tool_calls import ToolRunner
from agentloop.parsers.base import FunctionCall
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.tools import BaseTool, FunctionTool, Gsm8kTool, ToolResponse, function_tool
from agentloop.tools.function_tool import parse_docstring
from agentloop.tools.gsm8k import GSM8K_TOOL_DICT, extract_answer
from agentloop.tools.registry import initialize_tools_from_config

TOK = FakeTokenizer()
EXAMPLE_YAML = (
    Path(__file__).resolve().parents[2] / "examples" / "calculator_agent" / "gsm8k_tool.yaml"
)


# ---------------------------------------------------------------- tools used below (and loaded from
# YAML)

@function_tool
def everything(
    text: str,
    count: int,
    ratio: float,
    flag: bool,
    names: list[str],
    grid: list[list[int]],
    raw: list,
    meta: dict[str, Any],
    plain: dict,
    mode: Literal["fast", "slow"],
    level: Literal[1, 2, 3],
    either: int | str,
    maybe: Optional[int],  # noqa: UP045
    maybe_too: float | None,
    default: str = "x",
) -> str:
    """Exercise every supported annotation.

    Args:
        text: Some text.
        count (int): How many,
            on two lines.
        mode: The speed.
    """
    return json.dumps({"maybe": maybe, "maybe_too": maybe_too, "default": default})


@function_tool(name="add_numbers", description="Add two integers.", timeout=2.0)
def add(a: int, b: int = 0) -> int:
    """Ignored: description= wins."""
    return a + b


@function_tool
def which_thread(tag: str) -> tuple[str, float]:
    """Report the thread it runs in."""
    return f"{tag}:{threading.get_ident()}", 0.5


@function_tool
async def slow_echo(text: str, delay: float = 0.0) -> ToolResponse:
    """Echo after a delay."""
    await asyncio.sleep(delay)
    return ToolResponse(text=text.upper())


def not_decorated(x: int) -> int:
    return x


class ImageTool(BaseTool):
    """Returns one image (whatever object ``config.image`` names; a PIL image in the tests)."""

    image: Any = None

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="here is the picture", image=[ImageTool.image]), 0.0, {}


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- schema inference

def test_schema_covers_every_supported_annotation():
    fn = everything().tool_schema.function
    props = {k: v.model_dump(exclude_none=True) for k, v in fn.parameters.properties.items()}
    assert props == {
        "text": {"type": "string", "description": "Some text."},
        "count": {"type": "integer", "description": "How many, on two lines."},
        "ratio": {"type": "number"}, "flag": {"type": "boolean"},
        "names": {"type": "array", "items": {"type": "string"}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "raw": {"type": "array"}, "meta": {"type": "object"}, "plain": {"type": "object"},
        "mode": {"type": "string", "enum": ["fast", "slow"], "description": "The speed."},
        "level": {"type": "integer", "enum": [1, 2, 3]}, "either": {"type": ["integer", "string"]},
        "maybe": {"type": "integer"}, "maybe_too": {"type": "number"},
        "default": {"type": "string"},
    }
    assert fn.parameters.required == [
        "text", "count", "ratio", "flag", "names", "grid", "raw", "meta", "plain", "mode", "level",
        "either",
    ]
    assert fn.name == "everything" and fn.description == "Exercise every supported annotation."


def test_decorator_options_and_rendered_schema():
    tool = add()
    assert isinstance(tool, FunctionTool) and issubclass(add, BaseTool) and add.__name__ == "add"
    assert tool.name == "add_numbers" and tool.config["timeout"] == 2.0
    rendered = tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
    assert rendered == {
        "type": "function",
        "function": {
            "name": "add_numbers",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }
    assert add.fn(2, 3) == 5  # the plain function stays callable


def test_docstring_parsing():
    doc = (
        "Summary line one\nand two.\n\nDetails here.\n\nArgs:\n    a (int): First.\n    "
        "*rest: Ignored name.\n"
        "    b: Second,\n        continued.\n\n    c: After a blank line.\nReturns:\n    "
        "d: not an argument\n"
    )
    assert parse_docstring(doc) == (
        "Summary line one and two.",
        {
            "a": "First.", "rest": "Ignored name.", "b": "Second, continued.",
            "c": "After a blank line.",
        },
    )
    assert parse_docstring("Only a summary.\nArgs:\n  x: y") == ("Only a summary.", {"x": "y"})
    assert parse_docstring(None) == ("", {})


def _bad_any(x: Any) -> None: ...
def _bad_set(x: set[int]) -> None: ...
def _bad_missing(x) -> None: ...
def _bad_args(*xs: int) -> None: ...
def _bad_kwargs(**kw: int) -> None: ...
def _bad_class(x: FakeTokenizer) -> None: ...
def _bad_nested_none(x: list[int | None]) -> None: ...
def _bad_literal(x: Literal[None]) -> None: ...
def _bad_posonly(x: int, /) -> None: ...


@pytest.mark.parametrize(
    "fn",
    [
        _bad_any, _bad_set, _bad_missing, _bad_args, _bad_kwargs, _bad_class, _bad_nested_none,
        _bad_literal, _bad_posonly,
    ],
)
def test_unsupported_annotation_names_function_and_parameter(fn):
    param = next(iter(inspect.signature(fn).parameters))
    with pytest.raises(ConfigError, match=rf"{fn.__name__}.*parameter '{param}'"):
        function_tool(fn)


def test_bad_tool_name_and_non_functions_are_refused():
    with pytest.raises(ConfigError, match="tool name 'has space'"):
        function_tool(name="has space")(add.fn)
    with pytest.raises(ConfigError, match="decorates a function"):
        function_tool(FakeTokenizer)

    def gen(x: int):
        yield x

    with pytest.raises(ConfigError, match="generator"):
        function_tool(gen)


# ---------------------------------------------------------------- calling

def test_sync_tool_runs_in_a_worker_thread_and_returns_a_reward():
    response, reward, metrics = run(which_thread().execute("i", {"tag": "t"}))
    tag, ident = response.text.split(":")
    assert tag == "t" and int(ident) != threading.get_ident() and reward == 0.5 and metrics == {}


def test_async_tool_and_optional_arguments():
    response, reward, _ = run(slow_echo().execute("i", {"text": "hi"}))
    assert response.text == "HI" and reward == 0.0
    required = everything.default_schema.function.parameters.required
    response, _, _ = run(everything().execute("i", dict.fromkeys(required)))
    assert json.loads(response.text) == {"maybe": None, "maybe_too": None, "default": "x"}


@pytest.mark.parametrize(
    ("value", "text", "reward"),
    [
        ("plain", "plain", 0.0), (ToolResponse(text="r"), "r", 0.0), (("t", 2), "t", 2.0),
        ((ToolResponse(text="u"), -0.5), "u", -0.5), (7, "7", 0.0), ({"a": [1]}, '{"a": [1]}', 0.0),
        (None, "null", 0.0),
    ],
)
def test_return_values(value, text, reward):
    tool = function_tool(name="ret")(lambda: value)()
    response, got, _ = run(tool.execute("i", {}))
    assert response.text == text and got == reward


@pytest.mark.parametrize("value", [("a", "b"), ("a", 1.0, 2), ("a", True), object()])
def test_bad_return_values_raise_type_error(value):
    tool = function_tool(name="ret")(lambda: value)()
    with pytest.raises(TypeError, match="function tool 'ret'"):
        run(tool.execute("i", {}))


def test_unknown_and_missing_arguments_are_errors():
    with pytest.raises(ValueError, match=r"unknown \['c'\], missing required \['a'\]"):
        run(add().execute("i", {"c": 1}))


def test_timeout_from_decorator_and_from_config():
    with pytest.raises(asyncio.TimeoutError):
        run(slow_echo({"timeout": 0.05}).execute("i", {"text": "x", "delay": 1.0}))
    assert run(add({"timeout": None}).execute("i", {"a": 1}))[0].text == "1"


# ---------------------------------------------------------------- YAML loading

def test_yaml_loads_function_tools_and_explains_plain_functions(tmp_path):
    good = tmp_path / "tools.yaml"
    good.write_text(f"tools:\n  - class_name: {__name__}.add\n    config: {{timeout: 9}}\n"
                    f"  - class_name: {__name__}.slow_echo\n")
    adder, echo = initialize_tools_from_config(good)
    assert adder.name == "add_numbers" and adder.config["timeout"] == 9 and echo.name == "slow_echo"
    assert run(adder.execute("i", {"a": 2, "b": 5}))[0].text == "7"

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"tools:\n  - class_name: {__name__}.not_decorated\n")
    hint = r"bad.yaml tools\[0\].*not a BaseTool subclass.*@agentloop.tools.function_tool"
    with pytest.raises(ConfigError, match=hint):
        initialize_tools_from_config(bad)


def test_yaml_loads_gsm8k_tool_from_the_example():
    (tool,) = initialize_tools_from_config(EXAMPLE_YAML)
    assert (
        isinstance(tool, Gsm8kTool)
        and tool.name == "calc_gsm8k_reward"
        and tool.no_improvement_reward == -0.05
    )
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == GSM8K_TOOL_DICT


# ---------------------------------------------------------------- gsm8k

@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("#### 72", "72"), ("72", "72"), ("$1,234.50", "1234.5"), ("The answer is 72.", "72"),
        ("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"), ("#### -3", "-3"), ("-$5", "-5"),
        ("10 - 3 = 7", "7"), ("5-3=2", "2"), ("72.0", "72"), ("#### 1,000 then 3", "1000"),
        ("it costs $ 12", "12"), ("nothing here", None), ("", None),
    ],
)
def test_gsm8k_extract_answer(text, value):
    got = extract_answer(text)
    assert (got is None and value is None) or got == Decimal(value)


def test_gsm8k_rewards_per_instance():
    tool = Gsm8kTool()

    async def go():
        iid, _ = await tool.create(ground_truth="Some working.\n#### 1,234")
        steps = [
            await tool.execute(iid, {"answer": a}) for a in ("12", "no idea", "$1,234.00", "1234")
        ]
        best = await tool.calc_reward(iid)
        await tool.release(iid)
        return steps, best, await tool.calc_reward(iid)

    steps, best, after_release = run(go())
    assert [s[1] for s in steps] == [0.0, -0.05, 1.0, -0.05]
    assert "incorrect" in steps[0][0].text and "No number" in steps[1][0].text
    assert (
        steps[2][0].text == "Parsed answer: 1234. The answer is correct."
        and steps[2][2]["score"] == 1.0
    )
    assert best == 1.0 and after_release == 0.0


def test_gsm8k_ground_truth_from_create_kwargs_and_errors():
    tool = Gsm8kTool({"no_improvement_reward": -0.1})

    async def go():
        iid, _ = await tool.create(create_kwargs={"ground_truth": 72})
        first = await tool.execute(iid, {"answer": 72})
        again = await tool.execute(iid, {"answer": "#### 72"})
        return first[1], again[1]

    assert run(go()) == (1.0, -0.1)
    with pytest.raises(ValueError, match="create_kwargs.ground_truth"):
        run(tool.create(create_kwargs={}))
    with pytest.raises(ValueError, match="contains no number"):
        run(tool.create(ground_truth="seventy-two"))


# ---------------------------------------------------------------- ToolAgentLoop runs

def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def call(name: str, **args: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def run_loop(tool_yaml: Path, script: list, response_length: int = 600, **sample: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 512
    cfg.data.max_response_length = response_length
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = str(tool_yaml)
    rollout.multi_turn.tool_timeout = 1.0
    server = ScriptedServer(script, eos_token_id=IM_END)

    async def go():
        ToolAgentLoop.init_class(rollout, TOK)
        loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run(
            {}, raw_prompt=[{"role": "user", "content": "Natalia's clips?"}], **sample
        )

    return run(go()), server


def tool_text(out) -> str:
    ids = np.array(out.response_ids)
    return TOK.decode(ids[np.array(out.response_mask) == 0].tolist())


def test_tool_agent_loop_gsm8k_reward_lands_in_tool_rewards():
    script = [
        say(call("calc_gsm8k_reward", answer="71")),
        say(call("calc_gsm8k_reward", answer="#### 72")), say("The answer is 72."),
    ]
    tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "#### 72"}}}
    out, server = run_loop(EXAMPLE_YAML, script, tools_kwargs=tools_kwargs)
    assert out.status == "stop" and len(server.calls) == 3
    assert (
        out.extra_fields["tool_rewards"] == [0.0, 1.0] and out.extra_fields["num_tool_errors"] == 0
    )
    assert "is incorrect" in tool_text(out) and "is correct" in tool_text(out)
    assert out.multi_modal_data is None and server.calls[1]["image_data"] is None


def test_tool_agent_loop_runs_function_tools(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(f"tools:\n  - class_name: {__name__}.add\n"
                     f"  - class_name: {__name__}.slow_echo\n    config: {{timeout: 0.05}}\n")
    script = [
        say(call("add_numbers", a=2, b=40)), say(call("slow_echo", text="a", delay=0.5)), say("42"),
    ]
    out, _ = run_loop(tools, script)
    assert "42" in tool_text(out) and out.extra_fields["num_tool_timeouts"] == 1
    assert out.extra_fields["tool_rewards"] == [0.0]


# ---------------------------------------------------------------- images returned by tools

@pytest.fixture
def image_yaml(tmp_path):
    from PIL import Image

    ImageTool.image = Image.new("RGB", (4, 4), "red")
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {__name__}.ImageTool\n"
                    "    tool_schema: {type: function, function: {name: draw, description: d}}\n")
    return path


def test_tool_runner_renders_images_as_image_parts(image_yaml):
    (tool,) = initialize_tools_from_config(image_yaml)
    result = run(
        ToolRunner({"draw": tool}).run_turn(
            [FunctionCall(name="draw", arguments="{}", id="c1")], None
        )
    )
    assert result.images == [ImageTool.image]
    assert result.messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "here is the picture"},
    ]


def test_tool_images_reach_the_next_generation_and_the_output(image_yaml):
    prompt_image = object()
    script = [say(call("draw")), say(call("draw")), say("Red.")]
    out, server = run_loop(image_yaml, script, multi_modal_data={"image": [prompt_image]})
    # the fake template renders the content parts verbatim
    assert "{'type': 'image'}" in tool_text(out)
    sent = [c["image_data"] for c in server.calls]
    assert sent == [
        [prompt_image], [prompt_image, ImageTool.image],
        [prompt_image, ImageTool.image, ImageTool.image],
    ]
    assert out.multi_modal_data == {"image": [prompt_image, ImageTool.image, ImageTool.image]}


def test_tool_images_are_dropped_with_a_tool_turn_that_does_not_fit(image_yaml):
    first = say(call("draw"))
    out, server = run_loop(image_yaml, [first], response_length=len(first) + 10)
    assert (
        out.status == "length"
        and out.multi_modal_data is None
        and server.calls[0]["image_data"] is None
    )
