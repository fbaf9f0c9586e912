"""Tools: the calculator never evals, YAML loading fails early with the file and entry named."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.errors import ConfigError
from agentloop.tools import CalculatorTool
from agentloop.tools.calculator import evaluate
from agentloop.tools.registry import initialize_tools_from_config


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("2 + 3", 5), ("12 * (3 + 4)", 84), ("-7 // 2", -4), ("2 ** 10", 1024), ("7 / 2", 3.5),
        ("10 % 4", 2),
    ],
)
def test_calculator_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("1/0", "division by zero"), ("9 ** 99", "exponent"),
        ("__import__('os').system('x')", "unsupported"), ("3 -", "not an arithmetic"),
        ("'a' * 3", "unsupported"),
    ],
)
def test_calculator_refuses_bad_input_as_text(expr, error):
    response, reward, metrics = asyncio.run(CalculatorTool().execute("i", {"expression": expr}))
    assert (
        response.text.startswith("Error:") and error in response.text and metrics == {"ok": False}
    )


def test_calculator_formats_results():
    response, _, _ = asyncio.run(CalculatorTool().execute("i", {"expression": "6 / 3"}))
    assert response.text == "2"


def test_yaml_registry_loads_and_validates(tmp_path):
    good = tmp_path / "tools.yaml"
    good.write_text(
        "tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n    "
        "config: {type: native}\n"
    )
    (tool,) = initialize_tools_from_config(good)
    assert tool.name == "calculator"

    bad_class = tmp_path / "bad_class.yaml"
    bad_class.write_text("tools:\n  - class_name: agentloop.tools.nope.Missing\n")
    with pytest.raises(ConfigError, match=r"bad_class.yaml tools\[0\].*cannot import"):
        initialize_tools_from_config(bad_class)

    bad_schema = tmp_path / "bad_schema.yaml"
    bad_schema.write_text("tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n"
                          "    tool_schema: {type: function, function: {description: no name}}\n")
    with pytest.raises(ConfigError, match=r"bad_schema.yaml tools\[0\].*does not validate"):
        initialize_tools_from_config(bad_schema)

    dup = tmp_path / "dup.yaml"
    dup.write_text("tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n"
                   "  - class_name: agentloop.tools.calculator.CalculatorTool\n")
    with pytest.raises(ConfigError, match="duplicate tool name 'calculator'"):
        initialize_tools_from_config(dup)
