"""One registration pattern (agentloop.utils.registry) for loops, parsers, tools, interactions
and runners."""

from __future__ import annotations

from typing import Any

import pytest

from agentloop.errors import ConfigError, UnknownAgentError
from agentloop.gateway.framework import OpenAIAgentLoop, register_agent_runner
from agentloop.interactions import (
    INTERACTIONS,
    BaseInteraction,
    initialize_interactions_from_config,
    register_interaction,
)
from agentloop.loops.base import (
    AGENT_LOOPS,
    AgentLoopBase,
    _agent_loop_registry,
    lookup,
    register,
    registered_agent_names,
    resolve_registry,
)
from agentloop.loops.runners import AGENT_RUNNERS, resolve_runner
from agentloop.parsers import ToolParser, get_tool_parser
from agentloop.parsers.base import TOOL_PARSERS
from agentloop.tools import (
    TOOLS,
    BaseTool,
    function_tool,
    initialize_tools_from_config,
    register_tool,
)
from agentloop.tools.function_tool import FUNCTION_TOOL_REGISTRY, FUNCTION_TOOLS, get_function_tool
from agentloop.utils.registry import Registry, target_of


class Tok:
    """The least a parser's constructor needs."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return ""

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return []


class Base:
    pass


class One(Base):
    pass


class Two(Base):
    pass


def registry(**kwargs: Any) -> Registry:
    return Registry(
        "widget", decorator="register_widget", how="Register one with @register_widget(name).",
        base=Base, **kwargs,
    )


# ---------------------------------------------------------------- the Registry itself


def test_decorator_registers_and_returns_the_object():
    reg = registry()
    assert reg.register("one")(One) is One
    assert reg["one"] is One and reg.get("one") is One and "one" in reg and reg.names() == ["one"]
    reg.register("one")(One)  # the same object again (a module imported twice): fine
    assert reg.entry("one").target == target_of(One) == f"{__name__}.One"


def test_a_name_taken_by_another_object_is_refused():
    reg = registry()
    reg.register("w")(One)
    with pytest.raises(
        ConfigError,
        match=rf"widget 'w' is already registered as " rf"{__name__}.One.*{__name__}.Two",
    ):
        reg.register("w")(Two)
    assert reg["w"] is One
    reg.add("w", Two, replace=True)  # an explicit replacement is allowed
    assert reg["w"] is Two


def test_wrong_kind_names_the_decorator():
    with pytest.raises(
        ConfigError, match=r"@register_widget\('x'\) must decorate a Base " r"subclass, got"
    ):
        registry().register("x")(str)


def test_unknown_name_lists_names_suggests_and_says_how():
    reg = registry()
    reg.register("sprocket")(One)
    reg.register("gear")(Two)
    with pytest.raises(ConfigError) as info:
        reg.entry("sprokcet")
    text = str(info.value)
    assert "unknown widget 'sprokcet'" in text and "did you mean 'sprocket'?" in text
    assert "registered: ['gear', 'sprocket']" in text and "@register_widget(name)" in text
    with pytest.raises(ConfigError, match="did you mean") as info:
        reg.resolve("gaer", "cfg.widget")
    assert str(info.value).startswith("cfg.widget: unknown widget 'gaer'")


def test_resolve_by_name_or_import_path():
    reg = registry()
    reg.register("one")(One)
    assert reg.resolve("one") is One
    assert reg.resolve(f"{__name__}.Two") is Two  # not registered: imported by path
    with pytest.raises(
        ConfigError, match=r"w: 'agentloop.errors.ConfigError' is not a Base " r"subclass"
    ):
        reg.resolve("agentloop.errors.ConfigError", "w")
    with pytest.raises(ConfigError, match="cannot import 'no.such.Thing'"):
        reg.resolve("no.such.Thing")


def test_path_entries_are_imported_on_first_use_and_kept():
    reg = registry()
    reg.add("lazy", f"{__name__}.Two")
    assert reg.entry("lazy").obj is None and "lazy" in reg
    assert reg["lazy"] is Two and reg.entry("lazy").obj is Two
    reg.register("lazy")(Two)  # the module's own decorator later: same target, accepted


def test_fallback_layer_is_shadowed_not_refused():
    builtin = registry()
    user = registry(fallback=builtin)
    builtin.register("w")(One)
    user.register("w")(Two)  # a user's registration wins over a built-in one of the same name
    assert user["w"] is Two and builtin["w"] is One and list(user) == ["w"]
    del user["w"]
    assert user["w"] is One
    with pytest.raises(KeyError):  # unregistering never reaches into the fallback
        del user["w"]


# ---------------------------------------------------------------- agent loops


class LoopA(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        raise NotImplementedError


class LoopB(LoopA):
    pass


@pytest.fixture
def loop_names():
    names: list[str] = []
    yield names
    for name in names:
        _agent_loop_registry.pop(name, None)


def test_verl_registry_view_reads_and_writes_the_loop_registry(loop_names):
    loop_names += ["t_reg_a", "t_reg_written"]
    register("t_reg_a")(LoopA)
    assert _agent_loop_registry["t_reg_a"] == {"_target_": f"{__name__}.LoopA", "_class_": LoopA}
    assert AGENT_LOOPS["t_reg_a"] is LoopA
    # users' loops only
    assert "t_reg_a" in _agent_loop_registry and "tool_agent" not in _agent_loop_registry
    # verl users write it
    _agent_loop_registry["t_reg_written"] = {"_target_": f"{__name__}.LoopB", "foo": 1}
    resolved = resolve_registry()
    assert resolved["t_reg_a"].cls is LoopA
    assert resolved["t_reg_written"].cls is LoopB and resolved["t_reg_written"].kwargs == {"foo": 1}
    assert _agent_loop_registry.pop("t_reg_a")["_class_"] is LoopA
    assert "t_reg_a" not in resolve_registry() and "t_reg_a" not in registered_agent_names()


def test_verl_import_path_is_the_same_registry():
    from agentloop.compat import agent_loop as verl_agent_loop

    assert verl_agent_loop._agent_loop_registry is _agent_loop_registry
    assert verl_agent_loop.register is register


def test_loop_decorator_checks_kind_and_duplicates(loop_names):
    loop_names.append("t_reg_dup")
    with pytest.raises(
        ConfigError, match=r"@register\('t_reg_bad'\) must decorate an " r"AgentLoopBase subclass"
    ):
        register("t_reg_bad")(object)
    register("t_reg_dup")(LoopA)
    with pytest.raises(ConfigError, match="agent loop 't_reg_dup' is already registered"):
        register("t_reg_dup")(LoopB)


def test_a_user_loop_named_like_a_builtin_wins(loop_names):
    loop_names.append("single_turn_agent")
    register("single_turn_agent")(LoopA)
    assert resolve_registry()["single_turn_agent"].cls is LoopA
    _agent_loop_registry.pop("single_turn_agent")
    assert resolve_registry()["single_turn_agent"].cls.__name__ == "SingleTurnAgentLoop"


def test_yaml_entries_take_a_name_a_path_or_class_name(tmp_path):
    path = tmp_path / "agents.yaml"
    path.write_text("- {name: by_name, _target_: single_turn_agent, x: 1}\n"
                    f"- {{name: by_alias, class_name: {__name__}.LoopB}}\n")
    resolved = resolve_registry(str(path))
    assert resolved["by_name"].cls is resolved["single_turn_agent"].cls and resolved[
        "by_name"
    ].kwargs == {"x": 1}
    assert resolved["by_alias"].cls is LoopB
    path.write_text("- {name: missing}\n")
    with pytest.raises(ConfigError, match=r"agents.yaml: entry 0 must have 'name' and '_target_'"):
        resolve_registry(str(path))
    path.write_text("- {name: typo, _target_: singel_turn_agent}\n")
    with pytest.raises(ConfigError, match="did you mean 'single_turn_agent'"):
        resolve_registry(str(path))


def test_unknown_agent_name_suggests_the_closest():
    with pytest.raises(
        UnknownAgentError, match=r"'tool_agnet' is not registered; did you " r"mean 'tool_agent'\?"
    ):
        lookup(resolve_registry(), "tool_agnet")


# ---------------------------------------------------------------- parsers


def test_parser_registry_is_verls_classvar_and_lists_every_builtin():
    import agentloop.parsers  # noqa: F401 - the built-in modules register themselves (again)

    assert ToolParser._registry is TOOL_PARSERS
    for name, entry in TOOL_PARSERS.entries().items():
        if entry.target.startswith("agentloop.parsers."):
            assert target_of(TOOL_PARSERS[name]) == entry.target
    decorated = {
        n for n, e in TOOL_PARSERS.entries().items() if e.target.startswith("agentloop.parsers.")
    }
    assert {
        "hermes", "qwen3_coder", "llama3_json", "gpt-oss", "gpt_oss", "glm", "seed", "minimax",
        "kimi", "deepseek_v4", "gemma4",
    } == decorated


def test_parsers_by_name_path_and_suggestion():
    @ToolParser.register("t_reg_parser")
    class Mine(ToolParser):
        pass

    try:
        assert type(get_tool_parser("t_reg_parser", Tok())) is Mine
        assert (
            type(get_tool_parser("agentloop.parsers.hermes.HermesToolParser", Tok())).__name__
            == "HermesToolParser"
        )
        with pytest.raises(ConfigError, match="already registered"):
            ToolParser.register("t_reg_parser")(type("Other", (ToolParser,), {}))
        with pytest.raises(ConfigError, match=r"multi_turn.format\); did you mean 'hermes'\?"):
            get_tool_parser("hermse", Tok())
    finally:
        del TOOL_PARSERS["t_reg_parser"]


# ---------------------------------------------------------------- tools and interactions


class TRegTool(BaseTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(
            config,
            tool_schema
            or {
                "type": "function",
                "function": {
                    "name": "t_reg_tool", "description": "d",
                    "parameters": {"type": "object", "properties": {}},
                },
            },
        )


def test_tools_by_registered_name_target_alias_and_function_tool(tmp_path):
    register_tool("t_reg_tool")(TRegTool)

    @function_tool
    def t_reg_fn(x: int) -> str:
        """Echo x."""
        return str(x)

    try:
        path = tmp_path / "tools.yaml"
        path.write_text(
            "tools:\n  - _target_: t_reg_tool\n  - class_name: calculator\n  - _target_: t_reg_fn\n"
        )
        assert [t.name for t in initialize_tools_from_config(path)] == [
            "t_reg_tool", "calculator", "t_reg_fn",
        ]
        path.write_text("tools:\n  - _target_: calculater\n")
        with pytest.raises(
            ConfigError, match=r"tools\[0\] _target_: unknown tool " r"'calculater'; did you mean"
        ):
            initialize_tools_from_config(path)
        path.write_text("tools:\n  - {_target_: calculator, class_name: t_reg_tool}\n")
        with pytest.raises(ConfigError, match="disagree"):
            initialize_tools_from_config(path)
    finally:
        del TOOLS["t_reg_tool"]
        FUNCTION_TOOLS.pop("t_reg_fn", None)


def test_function_tools_register_in_a_registry_that_tools_consults(tmp_path):
    @function_tool
    def t_reg_fn_one(x: int) -> str:
        """Echo x."""
        return str(x)

    try:
        assert (
            isinstance(FUNCTION_TOOLS, Registry) and FUNCTION_TOOLS["t_reg_fn_one"] is t_reg_fn_one
        )
        # one lookup for both kinds
        assert "t_reg_fn_one" in TOOLS and TOOLS["t_reg_fn_one"] is t_reg_fn_one
        assert "t_reg_fn_one" in TOOLS.names() and "calculator" in TOOLS.names()
        # the deprecated name: a read-only mapping name -> one instance of the latest tool of that
        # name
        old = FUNCTION_TOOL_REGISTRY["t_reg_fn_one"]
        assert type(old) is t_reg_fn_one and FUNCTION_TOOL_REGISTRY["t_reg_fn_one"] is old
        assert get_function_tool("t_reg_fn_one") is old and "t_reg_fn_one" in dict(
            FUNCTION_TOOL_REGISTRY
        )
        assert not hasattr(FUNCTION_TOOL_REGISTRY, "pop") and not hasattr(
            FUNCTION_TOOL_REGISTRY, "__setitem__"
        )

        @function_tool(name="t_reg_fn_one")
        def again(x: int) -> str:
            """Echo x again."""
            return str(x)

        assert (
            TOOLS["t_reg_fn_one"] is again and type(FUNCTION_TOOL_REGISTRY["t_reg_fn_one"]) is again
        )
        path = tmp_path / "tools.yaml"
        path.write_text("tools:\n  - _target_: t_reg_fn_onee\n")
        with pytest.raises(
            ConfigError,
            match=r"unknown tool 't_reg_fn_onee'; did you mean "
            r"'t_reg_fn_one'\? "
            r"registered: "
            r"\[.*'calculator'.*'t_reg_fn_one'.*\]\. "
            r"Register one",
        ):
            initialize_tools_from_config(path)
    finally:
        del FUNCTION_TOOLS["t_reg_fn_one"]
    assert "t_reg_fn_one" not in TOOLS and "t_reg_fn_one" not in FUNCTION_TOOL_REGISTRY
    with pytest.raises(ConfigError, match="no function tool named 't_reg_fn_one' is registered"):
        get_function_tool("t_reg_fn_one")


class TRegInteraction(BaseInteraction):
    pass


def test_interactions_by_registered_name_and_target(tmp_path):
    register_interaction("t_reg_grader")(TRegInteraction)
    try:
        path = tmp_path / "interactions.yaml"
        path.write_text(
            "interaction:\n  - _target_: t_reg_grader\n  - {name: second, "
            "class_name: answer_check}\n"
        )
        out = initialize_interactions_from_config(path)
        assert type(out["t_reg_grader"]) is TRegInteraction and type(out["second"]).__name__ == \
            "AnswerCheckInteraction"
        with pytest.raises(
            ConfigError, match=r"@register_interaction\('x'\) must decorate " r"a BaseInteraction"
        ):
            register_interaction("x")(TRegTool)
    finally:
        del INTERACTIONS["t_reg_grader"]


# ---------------------------------------------------------------- agent runners


async def t_reg_runner(**kwargs: Any) -> float:
    return 1.0


async def t_reg_other(**kwargs: Any) -> float:
    return 0.0


def test_runner_registers_a_runner_and_an_openai_agent_loop(loop_names, tmp_path):
    loop_names.append("t_reg_sdk")
    assert register_agent_runner("t_reg_sdk")(t_reg_runner) is t_reg_runner
    register_agent_runner("t_reg_sdk")(t_reg_runner)  # the same runner again: fine
    entry = resolve_registry()["t_reg_sdk"]
    assert entry.cls is OpenAIAgentLoop and entry.kwargs == {"runner": t_reg_runner}
    assert resolve_runner("t_reg_sdk", "w") is t_reg_runner
    path = tmp_path / "agents.yaml"  # a YAML entry naming the registered loop gets its runner too
    path.write_text("- {name: t_reg_yaml, _target_: t_reg_sdk, session_timeout: 5}\n")
    assert resolve_registry(str(path))["t_reg_yaml"].kwargs == {
        "runner": t_reg_runner,
        "session_timeout": 5,
    }
    assert resolve_runner(f"{__name__}:t_reg_other", "w") is t_reg_other
    with pytest.raises(ConfigError, match="agent runner 't_reg_sdk' is already registered"):
        register_agent_runner("t_reg_sdk")(t_reg_other)
    with pytest.raises(
        ConfigError, match=r"w: unknown agent runner 't_reg_skd'; did you " r"mean 't_reg_sdk'\?"
    ):
        resolve_runner("t_reg_skd", "w")
    with pytest.raises(
        ConfigError, match=r"@register_agent_runner\('x'\) must decorate an " r"async callable"
    ):
        register_agent_runner("x")(42)
    _agent_loop_registry.pop("t_reg_sdk")  # unregistered the verl way: the name is free again
    register_agent_runner("t_reg_sdk")(t_reg_other)
    assert resolve_registry()["t_reg_sdk"].kwargs == {"runner": t_reg_other}
    del AGENT_RUNNERS["t_reg_sdk"]


def test_runner_name_taken_by_a_loop_is_refused(loop_names):
    loop_names.append("t_reg_loop_name")
    register("t_reg_loop_name")(LoopA)
    with pytest.raises(ConfigError, match="agent loop 't_reg_loop_name' is already registered"):
        register_agent_runner("t_reg_loop_name")(t_reg_runner)
    assert "t_reg_loop_name" not in AGENT_RUNNERS  # nothing half-registered
