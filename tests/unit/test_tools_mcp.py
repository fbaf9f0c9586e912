"""MCP tool servers as tools: a FastMCP server written here, started over stdio (and streamable
HTTP) by the mcp SDK; listing, calls, timeouts, a hung and a crashed server, verl's YAML shape,
bad configs, and a tool_agent rollout on the scripted engine (issue 31)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.cli.rollout import build_config
from agentloop.config import default_config, resolve_config
from agentloop.errors import ConfigError
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.loops.tool_calls import ToolRunner
from agentloop.parsers import FunctionCall
from agentloop.rollout import manager as manager_module
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.tools import BaseTool
from agentloop.tools.mcp import MCPTool, MCPToolError
from agentloop.tools.registry import check_tool_config, initialize_tools_from_config

pytest.importorskip("mcp")

SERVER = '''
import asyncio, os, sys
try:
    from mcp.server.mcpserver import MCPServer as FastMCP  # mcp 2.x
except ImportError:
    from mcp.server.fastmcp import FastMCP  # mcp 1.x

server = FastMCP("probe")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return "slept"


@server.tool()
def crash() -> str:
    """Kill the server process."""
    os._exit(3)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        port = int(sys.argv[1])
        try:
            server.run("streamable-http", port=port)
        except TypeError:  # mcp 1.x: the port is a setting
            server.settings.port = port
            server.run("streamable-http")
    else:
        server.run()
'''

TOK = FakeTokenizer()


@pytest.fixture(scope="module")
def server_py(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mcp") / "probe_server.py"
    path.write_text(SERVER)
    return str(path)


def stdio_entry(server_py: str, **config: Any) -> dict[str, Any]:
    return {"config": {"type": "mcp", **config},
            "mcp": {"mcp_servers": {"probe": {"command": sys.executable, "args": [server_py]}}}}


def write_tools(tmp_path: Path, *entries: dict[str, Any]) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(OmegaConf.to_yaml({"tools": list(entries)}))
    return str(path)


def load(tmp_path: Path, *entries: dict[str, Any]) -> dict[str, BaseTool]:
    return {t.name: t for t in initialize_tools_from_config(write_tools(tmp_path, *entries))}


def run_calls(tools: dict[str, BaseTool], calls: list[tuple[str, dict]]) -> list[str]:
    """Each call through the tool_agent's ToolRunner, one event loop for all (one worker)."""
    runner = ToolRunner(tools=tools, timeout=30.0)

    async def go() -> list[str]:
        texts = []
        for name, args in calls:
            call = FunctionCall(name=name, arguments=json.dumps(args))
            result = await runner.run_turn([call], None)
            texts.append(result.texts[0])
        return texts

    return asyncio.run(go())


def test_tools_are_listed_with_their_schemas(tmp_path, server_py):
    tools = load(tmp_path, stdio_entry(server_py))
    assert sorted(tools) == ["add", "crash", "pid", "sleep"]
    assert all(isinstance(t, MCPTool) for t in tools.values())
    schema = tools["add"].tool_schema.model_dump(exclude_unset=True, exclude_none=True)
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    assert tools["add"].config["timeout"] == 30.0  # the default per-call limit


def test_call_returns_the_text_content_and_shares_one_server(tmp_path, server_py):
    tools = load(tmp_path, stdio_entry(server_py))

    async def go() -> tuple[Any, ...]:
        added = await tools["add"].execute("i", {"a": 2, "b": 3})
        pids = [(await tools["pid"].execute(f"i{k}", {}))[0].text for k in range(3)]
        return added, pids

    (response, reward, metrics), pids = asyncio.run(go())
    assert (response.text, reward, metrics) == ("5", 0.0, {})
    assert len(set(pids)) == 1 and tools["add"].server is tools["pid"].server


def test_tool_error_is_raised_with_its_text(tmp_path, server_py):
    tools = load(tmp_path, stdio_entry(server_py))
    with pytest.raises(MCPToolError):
        asyncio.run(tools["add"].execute("i", {"a": "not a number", "b": 1}))


def test_timeout_is_an_error_message_and_the_server_stays(tmp_path, server_py):
    tools = load(tmp_path, stdio_entry(server_py, timeout=1))
    runner = ToolRunner(tools=tools, timeout=30.0)

    async def go() -> tuple[Any, ...]:
        await tools["pid"].server.connection()  # started (a loaded machine needs seconds)
        pid = await runner.run_turn([FunctionCall(name="pid", arguments="{}")], None)
        slow = await runner.run_turn([FunctionCall(name="sleep", arguments='{"seconds": 30}')],
                                     None)
        again = await runner.run_turn([FunctionCall(name="pid", arguments="{}")], None)
        return pid, slow, again

    pid, slow, again = asyncio.run(go())
    assert slow.texts == ["Error: tool 'sleep' timed out after 1s"]
    assert (slow.num_timeouts, slow.num_errors) == (1, 1)
    # a slow tool is not a hung server: it still answers a ping, so it is kept
    assert again.texts == pid.texts and tools["pid"].server.restarts == 0


def test_hung_server_is_restarted_on_the_next_call(tmp_path, server_py):
    # the call after the hang pings (a quarter of the timeout), then restarts in the rest
    tools = load(tmp_path, stdio_entry(server_py, timeout=6))
    runner = ToolRunner(tools=tools, timeout=30.0)

    async def go() -> tuple[Any, ...]:
        first = (await tools["pid"].execute("i", {}))[0].text
        os.kill(int(first), signal.SIGSTOP)  # hung: alive, answers nothing
        try:
            add = FunctionCall(name="add", arguments='{"a": 1, "b": 2}')
            hung = await runner.run_turn([add], None)
            after = await runner.run_turn([FunctionCall(name="pid", arguments="{}")], None)
        finally:  # the restart already stopped it, normally
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(first), signal.SIGKILL)
        return first, hung, after

    first, hung, after = asyncio.run(go())
    assert hung.texts == ["Error: tool 'add' timed out after 6s"] and hung.num_timeouts == 1
    assert after.num_errors == 0 and after.texts[0] != first
    assert tools["pid"].server.restarts == 1


def test_crashed_server_is_an_error_then_restarted(tmp_path, server_py):
    tools = load(tmp_path, stdio_entry(server_py, timeout=5))
    texts = run_calls(tools, [("pid", {}), ("crash", {}), ("add", {"a": 1, "b": 2}),
                              ("pid", {})])
    assert texts[1].startswith("Error: tool 'crash' failed: MCPServerError: MCP server 'probe'")
    assert texts[2] == "3" and texts[3] != texts[0]
    server = tools["pid"].server
    assert (server.restarts, server.failures) == (1, 1)


def test_killed_server_is_restarted_on_the_next_call(tmp_path, server_py):
    tools = load(tmp_path, stdio_entry(server_py, timeout=5))

    async def go() -> list[str]:
        first = (await tools["pid"].execute("i", {}))[0].text
        os.kill(int(first), signal.SIGKILL)
        await asyncio.sleep(0.5)
        texts = [first]
        for _ in range(2):  # the call that meets the dead server may fail; the next one works
            try:
                texts.append((await tools["pid"].execute("i", {}))[0].text)
            except Exception as e:  # noqa: BLE001
                texts.append(f"error: {e}")
        return texts

    texts = asyncio.run(go())
    assert texts[-1].isdigit() and texts[-1] != texts[0]
    assert tools["pid"].server.restarts == 1


def test_verl_tool_yaml_shape(tmp_path, server_py):
    (tmp_path / "mcp_server.json").write_text(json.dumps(
        {"mcpServers": {"probe": {"command": sys.executable, "args": [server_py]}}}))
    tools = load(tmp_path, {
        "class_name": "verl.tools.mcp_search_tool.MCPSearchTool",
        "config": {"rate_limit": 120, "timeout": 120, "type": "mcp"},
        "mcp": {"mcp_servers_config_path": "mcp_server.json", "tool_selected_list": ["add"]},
    })
    assert list(tools) == ["add"] and type(tools["add"]) is MCPTool
    assert tools["add"].config == {"rate_limit": 120, "timeout": 120, "type": "mcp"}
    assert run_calls(tools, [("add", {"a": 20, "b": 22})]) == ["42"]


@pytest.mark.parametrize("mcp, message", [
    (None, "needs an 'mcp:' mapping"),
    ({"mcp_servers": {"probe": {"args": ["x"]}}}, "needs either 'command'"),
    ({"mcp_servers": {"p": {"command": "x"}}, "servers": ["q"]}, "unknown MCP server(s) ['q']"),
    ({"mcp_servers_config_path": "nowhere.json"}, "does not exist"),
    ({"mcp_servers": {"p": {"command": "x", "port": 1}}}, "unknown key(s) ['port']"),
    ({"servers_file": "x"}, "mcp has unknown key(s) ['servers_file']"),
    ({"mcp_servers": {}}, "no MCP servers"),
])
def test_bad_config_is_a_config_error_before_any_server_starts(tmp_path, mcp, message):
    entry: dict[str, Any] = {"config": {"type": "mcp"}}
    if mcp is not None:
        entry["mcp"] = mcp
    with pytest.raises(ConfigError) as e:
        load(tmp_path, entry)
    assert message in str(e.value) and "tools[0]" in str(e.value)


def test_the_manager_refuses_a_bad_mcp_config_before_starting_servers(tmp_path, monkeypatch):
    def no_servers(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("servers started")

    monkeypatch.setattr(manager_module, "open_servers", no_servers)
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    bad = {"config": {"type": "mcp"}, "mcp": {"mcp_servers": {"p": {"command": "x"}},
                                              "servers": ["q"]}}
    cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path = write_tools(tmp_path, bad)
    with pytest.raises(ConfigError, match=r"tools\[0\]: unknown MCP server\(s\) \['q'\]"):
        manager_module.AgentLoopManager(cfg)
    check_tool_config(None)  # no tool file: nothing to check
    good = {"config": {"type": "mcp"}, "mcp": {"mcp_servers": {"p": {"command": "x"}}}}
    check_tool_config(write_tools(tmp_path, good))  # checked without starting 'x'


def test_bad_server_or_selection_is_a_config_error(tmp_path, server_py):
    entry = stdio_entry(server_py)
    entry["mcp"]["tool_selected_list"] = ["add", "search"]
    with pytest.raises(ConfigError, match=r"names \['search'\], which no server offers"):
        load(tmp_path, entry)
    missing = {"config": {"type": "mcp", "timeout": 5}, "mcp": {"mcp_servers": {
        "gone": {"command": str(tmp_path / "no-such-binary")}}}}
    with pytest.raises(ConfigError, match="listing the MCP servers' tools failed"):
        load(tmp_path, missing)
    wrong = {**stdio_entry(server_py), "class_name": "agentloop.tools.calculator.CalculatorTool"}
    with pytest.raises(ConfigError, match="needs class_name to be an MCPTool subclass"):
        load(tmp_path, wrong)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_streamable_http_server(tmp_path, server_py):
    port = free_port()
    proc = subprocess.Popen([sys.executable, server_py, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        entry = {"config": {"type": "mcp"},
                 "mcp": {"mcp_servers": {"web": {"url": f"http://127.0.0.1:{port}/mcp"}}}}
        tools = load(tmp_path, entry)
        assert sorted(tools) == ["add", "crash", "pid", "sleep"]
        assert run_calls(tools, [("add", {"a": 2, "b": 2}), ("pid", {})]) == ["4", str(proc.pid)]
    finally:
        proc.kill()
        proc.wait()


def call(name: str, **args: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def test_tool_agent_rollout_calls_an_mcp_tool_with_exact_tokens(tmp_path, server_py):
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = 400
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = write_tools(tmp_path, stdio_entry(server_py))
    first, second = say(call("add", a=2, b=3)), say("The answer is 5.")
    server = ScriptedServer([first, second], eos_token_id=IM_END)
    user = {"role": "user", "content": "What is 2 + 3?"}

    async def go() -> Any:
        ToolAgentLoop.init_class(rollout, TOK)
        loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run({"temperature": 1.0, "logprobs": True}, raw_prompt=[user])

    out = asyncio.run(go())
    assert out.status == "stop" and out.extra_fields["num_tool_calls"] == 1
    assert out.extra_fields["num_tool_errors"] == 0
    # the second request is the chat template's render of the conversation with the tool's answer
    messages = [user, {"role": "assistant", "content": TOK.decode(first[:-1])},
                {"role": "tool", "content": "5"}]
    expected = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert server.calls[1]["prompt_ids"] == expected
    assert out.prompt_ids + out.response_ids == expected + second
    mask = np.array(out.response_mask)
    assert mask[: len(first)].all() and mask[-len(second):].all()
    assert (mask == 0).sum() == len(expected) - len(out.prompt_ids) - len(first)
    assert [s["function"]["name"] for s in ToolAgentLoop.tool_schemas or []] == [
        "add", "pid", "sleep", "crash"]  # the server's order


REPO = Path(__file__).resolve().parents[2]


def test_the_example_config_and_its_server(monkeypatch):
    monkeypatch.chdir(REPO)  # the example names its files relative to the repository
    model = f"actor_rollout_ref.model.path={ensure_tiny_model()}"
    cfg = build_config("examples/environments/mcp.yaml", [model])
    resolved = resolve_config(cfg)
    tools = {t.name: t for t in initialize_tools_from_config(
        resolved.multi_turn.tool_config_path)}
    assert list(tools) == ["calculator"] and type(tools["calculator"]) is MCPTool
    assert run_calls(tools, [("calculator", {"expression": "480 + 115"}),
                             ("calculator", {"expression": "7 / 2"})]) == ["595", "3.5"]
