"""Gateway hardening: client errors are 4xx with OpenAI bodies, our faults are 5xx with a request
id, the response budget is enforced per branch (never cut silently), and agent processes spawn off
the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from gateway_helpers import LiveGateway, client_for
from omegaconf import OmegaConf
from ray.exceptions import ActorDiedError, RayTaskError

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.gateway.actor import GatewayActor
from agentloop.gateway.framework import OpenAIAgentLoop
from agentloop.loops.base import ResolvedAgentLoop
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.servers.base import ServerDeadError
from agentloop.testing import ScriptedServer
from agentloop.utils import process


@pytest.fixture
def gateway(tokenizer):
    gw = LiveGateway(tokenizer)
    yield gw
    gw.close()


HELLO = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
INTERNALS = ("pid=", "10.1.2.3", "actor_id", "Traceback", "ray::")


def post(handle: Any, body: Any = None, *, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        f"{handle.base_url}/chat/completions", content=content, timeout=30,
        headers={"Authorization": f"Bearer {handle.api_key}", "Content-Type": "application/json"},
    )


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert r.headers["x-request-id"] and err["request_id"] == r.headers["x-request-id"]
    assert not any(s in r.text for s in INTERNALS), r.text
    return err


# ---- 1. client errors: 400 naming the parameter, before any engine call
# ----------------------------------------

@pytest.mark.parametrize(("extra", "param"), [
    ({"top_k": -5}, "top_k"), ({"seed": 2**70}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": ""}, "stop"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"), ({"stop": ["x" * 1001]}, "stop"),
    ({"stop": [1]}, "stop"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"), ({"n": 0}, "n"),
    ({"top_logprobs": 21}, "top_logprobs"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
])
def test_out_of_range_sampling_values_are_400_naming_the_parameter(gateway, extra, param):
    err = assert_openai_error(post(gateway.session(), {**HELLO, **extra}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert gateway.server.calls == []


def test_accepted_edge_values_reach_the_engine(gateway):
    handle = gateway.session()
    body = {
        **HELLO, "top_k": -1, "seed": 2**63 - 1, "stop": ["END"], "top_p": 1.0, "temperature": 0.0,
        "top_logprobs": 0, "presence_penalty": 2.0,
    }
    r = post(handle, body)
    assert r.status_code == 200, r.text
    sent = gateway.server.calls[-1]["sampling_params"]
    assert sent["top_k"] == -1 and sent["seed"] == 2**63 - 1 and sent["stop"] == ["END"]


@pytest.mark.parametrize("raw", [
    b"[" * 4096,                                     # RecursionError inside the JSON decoder
    # parses, but too deep
    json.dumps({**HELLO, "metadata": json.loads("[" * 70 + "]" * 70)}).encode(),
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    # over Python's int-digits limit
    b'{"model": "m", "messages": [], "seed": ' + b"9" * 5000 + b"}",
    b'\xff\xfe{"a": 1}',
])
def test_hostile_json_bodies_are_400_not_500(gateway, raw):
    assert_openai_error(post(gateway.session(), raw=raw), 400)
    assert gateway.server.calls == []


def test_moderate_nesting_is_accepted(gateway):
    body = {**HELLO, "metadata": json.loads('{"a": ' * 30 + "1" + "}" * 30)}
    assert post(gateway.session(), body).status_code == 200


def test_every_response_has_a_request_id(gateway):
    handle = gateway.session()
    ok = post(handle, HELLO)
    unknown = httpx.post(
        handle.base_url.replace(handle.session_id, "nope") + "/chat/completions", json=HELLO
    )
    ids = {ok.headers["x-request-id"], unknown.headers["x-request-id"]}
    assert len(ids) == 2 and all(i.startswith("req_") for i in ids)
    assert unknown.json()["error"]["request_id"] == unknown.headers["x-request-id"]


# ---- 2. our faults: 5xx with a request id that is in the log, details only in the log
# ---------------------------

def ray_task_error() -> Exception:
    cause = ValueError("top_k must be 0 (disable), or at least 1, got -5.")
    err = RayTaskError(
        "generate", "Traceback (most recent call last):\n  File engine.py\nValueError: top_k",
        cause, proctitle="ray::VLLMServer.generate()", pid=4242, ip="10.1.2.3",
        actor_repr="VLLMServer(actor_id=abcdef0123)",
    )
    return err.as_instanceof_cause()


@pytest.mark.parametrize(("error", "status"), [
    (ray_task_error(), 502), (ActorDiedError(), 503),
    (ServerDeadError("engine process 4242 died"), 503),
])
def test_engine_failures_are_generic_5xx_with_the_request_id_in_the_log(
    tokenizer, caplog, error, status
):
    gw = LiveGateway(tokenizer, ScriptedServer([error], eos_token_id=tokenizer.eos_token_id))
    try:
        handle = gw.session()
        with caplog.at_level(logging.ERROR, logger="agentloop.gateway"):
            r = post(handle, HELLO)
        err = assert_openai_error(r, status)
        rid = r.headers["x-request-id"]
        assert rid in err["message"] and err["type"] == "server_error"
        lines = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
        assert lines and lines[0].startswith(f"request {rid}")
        assert gw.finalize(handle.session_id)["stats"]["num_nodes"] == 0  # nothing committed
    finally:
        gw.close()


def test_streamed_engine_failure_ends_the_stream_with_an_error_event(tokenizer):
    gw = LiveGateway(
        tokenizer, ScriptedServer([ray_task_error()], eos_token_id=tokenizer.eos_token_id)
    )
    try:
        handle = gw.session()
        with httpx.stream(
            "POST", f"{handle.base_url}/chat/completions", json={**HELLO, "stream": True},
            headers={"Authorization": f"Bearer {handle.api_key}"}, timeout=30,
        ) as r:
            rid = r.headers["x-request-id"]
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["request_id"] == rid
        assert not any(s in json.dumps(events) for s in INTERNALS)
    finally:
        gw.close()


def test_a_gateway_bug_is_a_500_with_the_request_id_and_no_traceback(tokenizer, caplog):
    class BrokenParser:
        tool_call_start = "<tool_call>"

        async def extract_tool_calls(self, ids, tools):
            raise ZeroDivisionError("secret internal state at 0xdeadbeef")

    gw = LiveGateway(tokenizer)
    gw.actor.service.parser = BrokenParser()  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.ERROR, logger="agentloop.gateway"):
            r = post(gw.session(), HELLO)
        err = assert_openai_error(r, 500)
        assert "deadbeef" not in r.text and r.headers["x-request-id"] in err["message"]
        assert any(
            r.headers["x-request-id"] in rec.getMessage() and rec.exc_info for rec in caplog.records
        )
    finally:
        gw.close()


# ---- 3. the response budget, per branch
# ------------------------------------------------------------------------

def long_policy(tokenizer: Any, n: int = 150):
    a = tokenizer.encode("a", add_special_tokens=False)[0]

    def reply(prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        return [a] * n + [tokenizer.eos_token_id]

    return reply


def test_a_branch_is_clamped_to_response_length_then_answered_length_without_the_engine(tokenizer):
    gw = LiveGateway(tokenizer, policy=long_policy(tokenizer))  # response_length 256
    try:
        handle = gw.session()
        client = client_for(handle)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        finishes = []
        for turn in range(3):
            resp = client.chat.completions.create(model="m", messages=msgs)
            finishes.append(resp.choices[0].finish_reason)
            msgs += [{"role": "assistant", "content": resp.choices[0].message.content},
                     {"role": "user", "content": f"more {turn}"}]
        assert finishes == ["stop", "length", "length"]
        assert len(gw.server.calls) == 2  # the third request found no budget: no engine call
        asked = gw.server.calls[1]["sampling_params"]["max_tokens"]
        assert 0 < asked < 256 - 151
        [traj] = gw.finalize(handle.session_id)["trajectories"]
        assert len(traj.response_ids) == 256 and traj.response_mask[-1] == 1
        assert traj.finish_reason == "length"
    finally:
        gw.close()


def test_context_that_does_not_fit_is_dropped_and_the_branch_ends_length(tokenizer):
    gw = LiveGateway(tokenizer, policy=long_policy(tokenizer))
    try:
        handle = gw.session()
        client = client_for(handle)
        first = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert first.choices[0].finish_reason == "stop"
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "tool", "content": "x " * 200, "tool_call_id": "c1"},
        ]
        second = client.chat.completions.create(model="m", messages=msgs)
        assert (
            second.choices[0].finish_reason == "length" and second.choices[0].message.content == ""
        )
        assert len(gw.server.calls) == 1
        [traj] = gw.finalize(handle.session_id)["trajectories"]
        assert traj.finish_reason == "length"  # was "stop": the cut is recorded, not silent
        # the tool turn is not in the row
        assert sum(traj.response_mask) == len(traj.response_ids) == 151
    finally:
        gw.close()


def test_a_prompt_over_prompt_length_is_answered_length_without_the_engine(gateway, tokenizer):
    handle = gateway.session()
    text = "word " * 600  # ~600 tokens: under prompt+response (768) but over prompt_length (512)
    resp = client_for(handle).chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}]
    )
    assert resp.choices[0].finish_reason == "length"
    assert gateway.server.calls == []
    stats = gateway.finalize(handle.session_id)["stats"]
    assert stats["prompt_over_length"] > 512 and stats["num_length_refusals"] == 1


def worker_rollout(**gateway: Any) -> Any:
    cfg = default_config()
    cfg.data.max_prompt_length = 400
    cfg.data.max_response_length = 200
    OmegaConf.resolve(cfg)
    r = cfg.actor_rollout_ref.rollout
    r.calculate_log_probs = True
    r.multi_turn.format = "hermes"
    for k, v in gateway.items():
        OmegaConf.update(r, f"gateway.{k}", v)
    return r


def one_sample_batch(*agents: str) -> DataProto:
    n = len(agents)
    prompts = np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": "hi"}] for _ in range(n)]
    extra = np.empty(n, dtype=object)
    extra[:] = [{} for _ in range(n)]
    nt = {
        "raw_prompt": prompts, "agent_name": np.array(list(agents), dtype=object),
        "uid": np.array([f"u{i}" for i in range(n)], dtype=object), "index": np.arange(n),
        "extra_info": extra,
    }
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


async def run_worker(
    tokenizer: Any, entries: dict[str, dict[str, Any]], data: DataProto, policy: Any, **gateway: Any
) -> DataProto:
    r = worker_rollout(**gateway)
    server = ScriptedServer(policy, eos_token_id=tokenizer.eos_token_id)
    gw = GatewayActor.from_slices(
        r, OmegaConf.create({"path": "tiny"}), [server], tokenizer=tokenizer
    )
    await gw.start()
    registry = {
        name: ResolvedAgentLoop(name, OpenAIAgentLoop, kwargs) for name, kwargs in entries.items()
    }
    try:
        worker = AgentLoopWorker.from_slices(
            r, OmegaConf.create({"path": "tiny"}), [server], registry=registry, tokenizer=tokenizer,
            gateways=[gw],
        )
        return await worker.generate_sequences(data)
    finally:
        await gw.shutdown()


async def greedy_agent(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> float:
    """Keeps asking for more until the gateway says length; reward 1.0."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    msgs = list(raw_prompt)
    for turn in range(5):
        resp = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": resp.choices[0].message.content},
                 {"role": "user", "content": f"more {turn}"}]
        if resp.choices[0].finish_reason == "length":
            break
    return 1.0


def test_row_of_an_over_budget_session_is_length_with_the_reward_on_the_last_sampled_token(
    tokenizer,
):
    out = asyncio.run(
        run_worker(
            tokenizer, {"greedy": {"runner": greedy_agent}}, one_sample_batch("greedy"),
            long_policy(tokenizer, 120),
        )
    )  # response_length 200
    assert out.non_tensor_batch["status"].tolist() == ["length"]
    mask = out.batch["response_mask"][0]
    scores = out.batch["rm_scores"][0]
    where = int(scores.nonzero()[0][0])
    assert float(scores.sum()) == 1.0 and int(mask[where]) == 1
    width = out.batch["prompts"].shape[1]
    valid = out.batch["attention_mask"][0][width:]
    last_valid = int(valid.nonzero()[-1][0])
    # the row ends with its last sampled token
    assert where == last_valid == int(mask.nonzero()[-1][0])
    assert last_valid < 200 or int(mask[-1]) == 1


def test_session_whose_prompt_is_too_long_gives_a_length_row_saying_why(tokenizer):
    async def long_prompt(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "word " * 500}]
        )

    out = asyncio.run(
        run_worker(
            tokenizer, {"long": {"runner": long_prompt}}, one_sample_batch("long"),
            long_policy(tokenizer),
        )
    )
    assert out.non_tensor_batch["status"].tolist() == ["length"]
    assert "prompt_length" in out.non_tensor_batch["error"][0]


# ---- 4. agent processes: spawned off the event loop, timeouts fire even when a spawn hangs
# ----------------------

class HangingSpawn:
    """Replaces process.spawn_process: blocks until released, then really starts the process."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[Any] = []
        self.threads: list[str] = []
        self.real = process.spawn_process

    def __call__(self, argv, env, stderr):
        self.threads.append(threading.current_thread().name)
        self.release.wait(30)
        # the runner's stderr file is closed by now (the sample gave up): start without it
        proc = self.real(
            [sys.executable, "-c", "import time; time.sleep(60)"], env, subprocess.DEVNULL
        )
        self.started.append(proc)
        return proc


def test_session_timeout_fires_while_a_spawn_hangs_and_the_late_process_is_killed(
    tokenizer, monkeypatch
):
    spawn = HangingSpawn()
    monkeypatch.setattr(process, "spawn_process", spawn)
    entries = {"cli": {"command": ["python", "agent.py"]}, "sdk": {"runner": greedy_agent}}
    both = one_sample_batch("cli", "sdk")
    out = asyncio.run(
        run_worker(tokenizer, entries, both, long_policy(tokenizer, 5), session_timeout=1.0)
    )
    status = out.non_tensor_batch["status"].tolist()
    # the other sample was not blocked
    assert status[0] == "timeout" and status[1] in ("stop", "length")
    # not the event loop's thread
    assert spawn.threads and spawn.threads[0].startswith("agentloop-spawn")
    spawn.release.set()
    deadline = time.monotonic() + 10
    while not spawn.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spawn.started and spawn.started[0].wait(timeout=10) != 0  # killed, not left running


def test_sample_timeout_cancels_a_waiting_agent_process_and_kills_it(
    tokenizer, monkeypatch, tmp_path
):
    pidfile = tmp_path / "pid"
    script = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"

    async def go() -> DataProto:
        r = worker_rollout()
        r.agent.sample_timeout = 1.0
        server = ScriptedServer(long_policy(tokenizer, 5), eos_token_id=tokenizer.eos_token_id)
        gw = GatewayActor.from_slices(
            r, OmegaConf.create({"path": "tiny"}), [server], tokenizer=tokenizer
        )
        await gw.start()
        registry = {
            "cli": ResolvedAgentLoop("cli", OpenAIAgentLoop, {"command": ["python", "-c", script]})
        }
        try:
            worker = AgentLoopWorker.from_slices(
                r, OmegaConf.create({"path": "tiny"}), [server], registry=registry,
                tokenizer=tokenizer, gateways=[gw],
            )
            return await worker.generate_sequences(one_sample_batch("cli"))
        finally:
            await gw.shutdown()

    out = asyncio.run(go())
    assert out.non_tensor_batch["status"].tolist() == ["timeout"]
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False


def test_a_failing_agent_command_reports_its_exit_code_and_stderr(tokenizer):
    script = "import sys; sys.stderr.write('could not import the agent package'); sys.exit(3)"
    out = asyncio.run(run_worker(tokenizer, {"cli": {"command": ["python", "-c", script]}},
                                 one_sample_batch("cli"), long_policy(tokenizer, 5)))
    assert out.non_tensor_batch["status"].tolist() == ["error"]
    error = out.non_tensor_batch["error"][0]
    assert "exited with 3" in error and "could not import the agent package" in error
