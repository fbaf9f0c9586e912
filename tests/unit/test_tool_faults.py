"""Tool faults: hanging tools (async, sync, function tools) are bounded, sync tools never block the
event loop, a tool's own timeout wins, the tool executor is configurable, and tool output never
overruns the budget."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.config import default_config
from agentloop.errors import ConfigError
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.loops.tool_calls import ToolRunner, effective_timeout
from agentloop.parsers.base import FunctionCall
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.tools import FUNCTION_TOOLS, BaseTool, FunctionTool, ToolResponse, function_tool
from agentloop.tools.executor import (
    configure_tool_executor,
    function_reference,
    shutdown_tool_executor,
    tool_executor,
)

TOK = FakeTokenizer()
# seconds: only so that a regression fails instead of hanging the suite; never asserted on
GUARD = 20.0

# ---------------------------------------------------------------- tools (module level: YAML loads
# them by path)

UNBLOCK = threading.Event()  # set by the tests once they have seen what they wanted
TOOL_STARTED = threading.Event()
TOOL_DONE = threading.Event()


@function_tool
async def hang_async() -> str:
    """Never returns."""
    await asyncio.Event().wait()
    return "never"


@function_tool
def block_sync() -> str:
    """Blocks its thread until the test lets it go."""
    TOOL_STARTED.set()
    UNBLOCK.wait(GUARD)
    TOOL_DONE.set()
    return "unblocked"


class SyncBlockTool(BaseTool):
    """A BaseTool whose execute is a plain def that blocks."""

    def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=block_sync.fn()), 0.0, {}


class SyncThreadTool(BaseTool):
    """A BaseTool whose execute is a plain def: reports the thread it ran in."""

    def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=str(threading.get_ident())), 1.0, {}


@function_tool(timeout=0.05)
async def nap(delay: float) -> str:
    """Sleeps, then answers (own timeout 0.05 s)."""
    await asyncio.sleep(delay)
    return "rested"


@function_tool
async def nap_free(delay: float) -> str:
    """Sleeps, then answers (no timeout of its own)."""
    await asyncio.sleep(delay)
    return "rested"


@function_tool
def echo_long(n: int) -> str:
    """Returns n characters."""
    return "".join(chr(ord("a") + i % 26) for i in range(n))


MODULE_TOOLS = ["hang_async", "block_sync", "nap", "nap_free", "echo_long"]


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    UNBLOCK.set()
    for name in MODULE_TOOLS:
        FUNCTION_TOOLS.pop(name, None)
    shutdown_tool_executor()


@pytest.fixture(autouse=True)
def _fresh_events():
    for event in (UNBLOCK, TOOL_STARTED, TOOL_DONE):
        event.clear()
    yield
    UNBLOCK.set()  # let a blocked thread go before the next test
    if TOOL_STARTED.is_set():
        TOOL_DONE.wait(GUARD)


# ---------------------------------------------------------------- helpers

def schema(name: str) -> str:
    return f"{{type: function, function: {{name: {name}, description: d}}}}"


def write_tools(tmp_path, *entries: str):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n" + "".join(entries))
    return str(path)


def fn_entry(name: str, config: str | None = None) -> str:
    return f"  - class_name: {__name__}.{name}\n" + (f"    config: {config}\n" if config else "")


def cls_entry(cls: str, name: str, config: str | None = None) -> str:
    return (f"  - class_name: {__name__}.{cls}\n    tool_schema: {schema(name)}\n"
            + (f"    config: {config}\n" if config else ""))


def call(name: str, **args: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def rollout_config(tool_yaml: str, response_length: int = 400, **multi_turn: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = response_length
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = tool_yaml
    for k, v in multi_turn.items():
        rollout.multi_turn[k] = v
    return rollout


async def run_one(rollout, script: list) -> tuple[Any, ScriptedServer]:
    server = ScriptedServer(script, eos_token_id=IM_END)
    loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
    out = await loop.run({"logprobs": True}, raw_prompt=[{"role": "user", "content": "go"}])
    return out, server


def run_loop(tool_yaml: str, script: list, response_length: int = 400, **multi_turn: Any):
    rollout = rollout_config(tool_yaml, response_length, **multi_turn)

    async def go():
        ToolAgentLoop.init_class(rollout, TOK)
        return await asyncio.wait_for(run_one(rollout, script), GUARD)

    return asyncio.run(go())


def tool_text(out) -> str:
    ids = np.array(out.response_ids)
    return TOK.decode(ids[np.array(out.response_mask) == 0].tolist())


def run_calls(tools: dict[str, BaseTool], *calls: FunctionCall, timeout: float | None):
    runner = ToolRunner(tools, max_parallel_calls=len(calls), timeout=timeout)
    return asyncio.run(asyncio.wait_for(runner.run_turn(list(calls), None), GUARD))


# ---------------------------------------------------------------- hanging tools

def test_hanging_async_function_tool_is_bounded_by_tool_timeout(tmp_path):
    out, server = run_loop(
        write_tools(tmp_path, fn_entry("hang_async")), [say(call("hang_async")), say("ok")],
        tool_timeout=0.2,
    )
    assert "tool 'hang_async' timed out after 0.2s" in tool_text(out)
    assert out.status == "stop" and len(server.calls) == 2, "the sample goes on after the timeout"
    assert out.extra_fields["num_tool_timeouts"] == 1 and out.extra_fields["num_tool_errors"] == 1


@pytest.mark.parametrize(
    "entry", [fn_entry("block_sync"), cls_entry("SyncBlockTool", "block_sync")],
    ids=["function_tool", "basetool_sync_execute"],
)
def test_hanging_sync_tool_is_bounded_and_other_samples_progress_meanwhile(tmp_path, entry):
    rollout = rollout_config(write_tools(tmp_path, entry), tool_timeout=0.5)
    seen: dict[str, bool] = {}

    async def other_sample():
        while not TOOL_STARTED.is_set():  # cannot run while the event loop is blocked by the tool
            await asyncio.sleep(0.005)
        out, _ = await run_one(rollout, [say("I am done.")])
        seen["other_done_while_tool_blocked"] = not TOOL_DONE.is_set()
        return out

    async def go():
        ToolAgentLoop.init_class(rollout, TOK)
        blocked = run_one(rollout, [say(call("block_sync")), say("ok")])
        return await asyncio.wait_for(asyncio.gather(blocked, other_sample()), GUARD)

    (blocked_out, _), other_out = asyncio.run(go())
    seen["timed_out_while_tool_blocked"] = not TOOL_DONE.is_set()
    assert seen == {"other_done_while_tool_blocked": True, "timed_out_while_tool_blocked": True}
    assert other_out.status == "stop"
    assert "timed out after 0.5s" in tool_text(blocked_out) and blocked_out.status == "stop"
    assert blocked_out.extra_fields["num_tool_timeouts"] == 1
    UNBLOCK.set()
    assert TOOL_DONE.wait(GUARD), (
        "the abandoned call runs on in the background and finishes when it can"
    )


def test_sync_basetool_execute_runs_in_a_worker_thread():
    result = run_calls(
        {
            "t": SyncThreadTool(
                {}, {"type": "function", "function": {"name": "t", "description": "d"}}
            )
        },
        FunctionCall(name="t", arguments="{}", id="c"),
        timeout=None,
    )
    assert result.num_errors == 0 and result.rewards == [1.0]
    assert int(result.texts[0]) != threading.get_ident()


# ---------------------------------------------------------------- own timeout vs tool_timeout

def test_tool_timeout_applies_to_function_tools_without_their_own():
    (tool,) = [nap_free()]
    assert tool.config["timeout"] is None and effective_timeout(tool, 0.05) == 0.05
    result = run_calls(
        {"nap_free": tool}, FunctionCall(name="nap_free", arguments='{"delay": 5}', id="c"),
        timeout=0.05,
    )
    assert result.num_timeouts == 1 and "timed out after 0.05s" in result.texts[0]


def test_own_shorter_timeout_wins_over_tool_timeout():
    result = run_calls(
        {"nap": nap()}, FunctionCall(name="nap", arguments='{"delay": 5}', id="c"), timeout=30
    )
    assert result.num_timeouts == 1 and "timed out after 0.05s" in result.texts[0]


@pytest.mark.parametrize("own", [5, 0], ids=["longer", "zero_means_no_limit"])
def test_own_longer_or_no_limit_wins_over_a_short_tool_timeout(tmp_path, own):
    out, _ = run_loop(write_tools(tmp_path, fn_entry("nap", f"{{timeout: {own}}}")),
                      [say(call("nap", delay=0.3)), say("ok")], tool_timeout=0.05)
    assert "rested" in tool_text(out) and out.extra_fields["num_tool_timeouts"] == 0


def test_basetool_yaml_timeout_wins_and_null_falls_back_to_tool_timeout(tmp_path):
    entries = cls_entry("SyncBlockTool", "block_sync", "{timeout: 0.1}")
    out, _ = run_loop(
        write_tools(tmp_path, entries), [say(call("block_sync")), say("ok")], tool_timeout=30
    )
    assert "timed out after 0.1s" in tool_text(out)
    assert (
        effective_timeout(nap({"timeout": None}), 7) == 7 and effective_timeout(nap(), None) == 0.05
    )


@pytest.mark.parametrize("bad", ["ten", -1, True])
def test_bad_tool_timeout_is_refused_when_tools_load(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"tool 'nap': config.timeout=.*number of seconds"):
        run_loop(write_tools(tmp_path, fn_entry("nap", json.dumps({"timeout": bad}))), [])


# ---------------------------------------------------------------- the tool executor

def test_executor_settings_come_from_the_config_and_bad_ones_fail_at_load(tmp_path):
    path = write_tools(tmp_path, fn_entry("echo_long"))
    out, _ = run_loop(path, [say(call("echo_long", n=3)), say("ok")], tool_max_workers=2)
    assert "abc" in tool_text(out) and (tool_executor().kind, tool_executor().max_workers) == (
        "thread",
        2,
    )
    with pytest.raises(
        ConfigError, match=r"multi_turn.tool_executor='fiber': expected one " r"of thread, process"
    ):
        run_loop(path, [], tool_executor="fiber")
    with pytest.raises(
        ConfigError, match=r"multi_turn.tool_max_workers=0: expected a " r"positive int"
    ):
        run_loop(path, [], tool_max_workers=0)


def test_process_executor_refuses_functions_a_new_process_cannot_find_at_load_time():
    def nested() -> str:
        return "x"

    configure_tool_executor("process", 1)
    try:
        for tool in (
            function_tool(name="nested_fn")(nested)(),
            function_tool(name="lam")(lambda: "x")(),
        ):
            with pytest.raises(
                ConfigError,
                match="is a lambda or is defined inside a function.*tool_executor=thread",
            ):
                ToolRunner({tool.name: tool})
        # module level / async: fine
        ToolRunner({"echo_long": echo_long(), "hang_async": hang_async()})
    finally:
        FUNCTION_TOOLS.pop("nested_fn", None), FUNCTION_TOOLS.pop("lam", None)
        configure_tool_executor()


def test_process_executor_finds_decorated_and_function_tool_path_functions(tmp_path):
    from agentloop.tools.executor import call_ref
    from agentloop.tools.function_tool import load_function_tools_from_path

    ref = function_reference(echo_long.fn, "echo_long")
    # via the tool class that replaced the function
    assert not ref.direct and call_ref(ref, {"n": 2}) == "ab"
    file = tmp_path / "my_tools.py"
    file.write_text(
        "from agentloop.tools import function_tool\n\n\n@function_tool\n"
        'def shout_in_file(text: str) -> str:\n    """Shout."""\n    '
        "return text.upper()\n"
    )
    (tool,) = load_function_tools_from_path(file)
    try:
        ref = function_reference(tool.fn, "shout_in_file")
        assert ref.path == str(file.resolve())
        # as in a new process: the module is found again from its file
        module = sys.modules.pop(ref.module)
        try:
            assert call_ref(ref, {"text": "hi"}) == "HI"
        finally:
            sys.modules[ref.module] = module
    finally:
        FUNCTION_TOOLS.pop("shout_in_file", None)


def test_process_executor_runs_a_sync_function_in_another_process(tmp_path, monkeypatch):
    # a module that does not import agentloop, so the spawned process starts fast
    (tmp_path / "plain_tools_for_process.py").write_text("import os\n\n\ndef my_pid() -> str:\n"
                                                         "    return str(os.getpid())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import plain_tools_for_process

    tool = FunctionTool(fn=plain_tools_for_process.my_pid)
    configure_tool_executor("process", 1)
    try:
        result = run_calls(
            {"my_pid": tool}, FunctionCall(name="my_pid", arguments="{}", id="c"), timeout=None
        )
    finally:
        configure_tool_executor()
        sys.modules.pop("plain_tools_for_process", None)
    assert result.num_errors == 0, result.texts
    assert int(result.texts[0]) != os.getpid()


# ---------------------------------------------------------------- tool output vs the remaining
# budget

def tool_turn_len(text: str) -> int:
    """Tokens of a tool turn carrying ``text`` (fake template: tool message + next assistant
    header)."""
    return len(
        TOK.apply_chat_template([{"role": "tool", "content": text}], add_generation_prompt=True)
    )


def test_tool_text_is_cut_to_fit_the_remaining_budget(tmp_path):
    first = say(call("echo_long", n=200))
    full = tool_turn_len(echo_long.fn(200))
    length = len(first) + full - 40  # the whole tool turn does not fit; a shorter cut does
    out, server = run_loop(
        write_tools(tmp_path, fn_entry("echo_long")), [first, say("fine, that will do")],
        response_length=length, max_tool_response_length=256,
    )
    text = tool_text(out)
    assert "...(truncated)..." in text and "tool\nabc" in text and echo_long.fn(200) not in text
    assert out.extra_fields["num_budget_truncations"] == 1
    assert len(server.calls) == 2 and server.calls[1]["sampling_params"]["max_tokens"] in (1, 2), \
        "the cut keeps as much tool text as fits, leaving the next generation at least one token"
    assert len(out.response_ids) == length and out.status == "length"
    assert out.response_ids[: len(first)] == first


def test_cut_respects_the_side_and_every_call_of_the_turn(tmp_path):
    first = say(call("echo_long", n=150) + call("echo_long", n=10))
    length = len(first) + tool_turn_len("x" * 160) - 30
    out, server = run_loop(
        write_tools(tmp_path, fn_entry("echo_long")), [first, say("ok")], response_length=length,
        max_parallel_calls=2, tool_response_truncate_side="left",
    )
    text = tool_text(out)
    assert text.count("...(truncated)") == 1 and "abcdefghij<|im_end|>" in text, (
        "the short text is left whole"
    )
    assert "tool\nabcdefghijklmnopqrstuvwxyz" in text, "left: the start of the long text is kept"
    assert len(server.calls) == 2 and len(out.response_ids) == length
    assert out.extra_fields["num_budget_truncations"] == 1


def test_tool_turn_that_cannot_fit_at_all_ends_with_length_and_is_not_appended(tmp_path):
    first = say(call("echo_long", n=200))
    out, server = run_loop(
        write_tools(tmp_path, fn_entry("echo_long")), [first], response_length=len(first) + 8
    )
    assert out.status == "length" and out.response_ids == first and len(server.calls) == 1
    assert out.extra_fields["num_budget_truncations"] == 0


def test_tool_turn_that_fits_is_not_cut(tmp_path):
    first = say(call("echo_long", n=30))
    out, _ = run_loop(
        write_tools(tmp_path, fn_entry("echo_long")), [first, say("ok")], response_length=400
    )
    assert echo_long.fn(30) in tool_text(out) and "truncated" not in tool_text(out)
    assert out.extra_fields["num_budget_truncations"] == 0 and out.status == "stop"
