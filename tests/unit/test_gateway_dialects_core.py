"""The gateway's dialect core (docs/gateway.md#dialects): one route per dialect, x-api-key auth,
errors in the shape of the dialect whose route was hit, per-session dialect state, count_tokens,
stop sequences and several dialects in one session (fake engine, real tokenizer, real HTTP on
loopback)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import numpy as np
import pytest
from gateway_helpers import (
    CALC_TOOL,
    FakePolicy,
    LiveGateway,
    client_for,
    full_render_ids,
    run_calculator_agent,
)
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.gateway.actor import GatewayActor
from agentloop.gateway.dialects import DIALECTS, dialect_for_path
from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.service import GatewayService
from agentloop.gateway.turn import TextDelta, TurnRequest, TurnResult
from agentloop.loops.base import ResolvedAgentLoop, resolve_registry
from agentloop.loops.runners import accepts_keyword
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.types import StopReason, TokenDelta, TokenOutput


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


@pytest.fixture
def gateway(tokenizer: Any) -> Any:
    gw = LiveGateway(tokenizer)
    yield gw
    gw.close()


def _post(url: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=30)


def _root(gw: LiveGateway, handle: Any) -> str:
    return f"{gw.url}/sessions/{handle.session_id}"


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "Say a word."}]}
MESSAGES_BODY = {
    "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Say a word."}],
}


def test_dialect_for_path_names_the_route_it_serves() -> None:
    assert dialect_for_path("/sessions/s1/v1/chat/completions") is DIALECTS["chat"]
    assert dialect_for_path("/sessions/s1/v1/v1/messages") is DIALECTS["messages"]
    assert dialect_for_path("/sessions/s1/v1/messages/count_tokens") is DIALECTS["messages"]
    assert dialect_for_path("/sessions/s1/v1/models") is None
    assert dialect_for_path("/health") is None


def test_each_dialect_route_and_its_v1_alias_serve_the_session(gateway: Any) -> None:
    handle = gateway.session()
    root = _root(gateway, handle)
    auth = {"authorization": f"Bearer {handle.api_key}"}
    for path in ("/v1/chat/completions", "/v1/v1/chat/completions"):
        reply = _post(root + path, CHAT_BODY, **auth)
        assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"
    for path in ("/v1/messages", "/v1/v1/messages"):
        reply = _post(root + path, MESSAGES_BODY, **auth)
        assert reply.status_code == 200 and reply.json()["type"] == "message"
    assert gateway.run(gateway.actor.get_state(handle.session_id))["num_requests"] == 4


def test_x_api_key_authenticates_every_session_route(gateway: Any) -> None:
    handle = gateway.session()
    root = _root(gateway, handle)
    key = {"x-api-key": handle.api_key, "anthropic-version": "2023-06-01"}
    assert _post(root + "/v1/messages", MESSAGES_BODY, **key).status_code == 200
    assert _post(root + "/v1/chat/completions", CHAT_BODY, **key).status_code == 200
    assert httpx.get(root + "/v1/models", headers=key, timeout=30).status_code == 200
    wrong = _post(root + "/v1/messages", MESSAGES_BODY, **{"x-api-key": "sk-wrong"})
    assert wrong.status_code == 401
    assert (
        wrong.json()["type"] == "error" and wrong.json()["error"]["type"] == "authentication_error"
    )
    assert _post(root + "/complete", {}, **key).status_code == 200


def test_errors_take_the_shape_of_the_dialect_whose_route_was_hit(gateway: Any) -> None:
    handle = gateway.session()
    root, key = _root(gateway, handle), {"x-api-key": handle.api_key}
    bad = _post(root + "/v1/messages", {"model": "m", "messages": "nope", "max_tokens": 8}, **key)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["request_id"] == bad.headers["x-request-id"]
    unknown = _post(f"{gateway.url}/sessions/nope/v1/messages", MESSAGES_BODY, **key)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    method = httpx.get(root + "/v1/messages", headers=key, timeout=30)
    assert method.status_code == 405 and method.json()["type"] == "error"
    chat = _post(root + "/v1/chat/completions", {"model": "m", "messages": "nope"}, **key)
    assert chat.status_code == 400 and set(chat.json()["error"]) >= {
        "message", "type", "param", "code",
    }
    elsewhere = httpx.get(root + "/v1/nothing", headers=key, timeout=30)
    assert elsewhere.status_code == 404 and "param" in elsewhere.json()["error"]
    assert gateway.finalize(handle.session_id)["trajectories"] == []


def test_a_gateway_bug_on_a_dialect_route_is_a_500_in_that_dialect_shape(tokenizer: Any) -> None:
    class BrokenParser:
        tool_call_start = "<tool_call>"

        async def extract_tool_calls(self, ids: Any, tools: Any) -> Any:
            raise ZeroDivisionError("secret internal state at 0xdeadbeef")

    gw = LiveGateway(tokenizer)
    gw.actor.service.parser = BrokenParser()  # type: ignore[assignment]
    try:
        handle = gw.session()
        reply = _post(
            _root(gw, handle) + "/v1/messages", MESSAGES_BODY, **{"x-api-key": handle.api_key}
        )
        assert reply.status_code == 500 and "deadbeef" not in reply.text
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "api_error"
        assert reply.headers["x-request-id"] in reply.json()["error"]["message"]
    finally:
        gw.close()


def test_dialect_state_is_per_session_and_per_dialect(gateway: Any) -> None:
    service: GatewayService = gateway.actor.service
    one, two = gateway.session(), gateway.session()
    service.dialect_state(one.session_id, "responses")["resp_1"] = {"id": "resp_1"}
    assert service.dialect_state(one.session_id, "responses") == {"resp_1": {"id": "resp_1"}}
    assert service.dialect_state(two.session_id, "responses") == {}
    assert service.dialect_state(one.session_id, "messages") == {}
    with pytest.raises(GatewayHTTPError) as e:
        service.dialect_state("nope", "responses")
    assert e.value.status == 404


def test_count_tokens_equals_the_served_prompt_and_records_nothing(gateway: Any) -> None:
    service: GatewayService = gateway.actor.service
    handle = gateway.session()
    messages = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    request = TurnRequest(model="m", messages=messages, tools=[CALC_TOOL], sampling={})
    before = gateway.run(gateway.actor.get_state(handle.session_id))["stats"]
    counted = service.count_tokens(handle.session_id, request)
    assert gateway.run(gateway.actor.get_state(handle.session_id))["stats"] == before
    result = gateway.run(service.serve(handle.session_id, request))
    assert isinstance(result, TurnResult) and result.prompt_tokens == counted
    follow = [
        *messages, result.message,
        {"role": "tool", "tool_call_id": result.message["tool_calls"][0]["id"], "content": "5"},
    ]
    request = TurnRequest(model="m", messages=follow, tools=[CALC_TOOL], sampling={})
    # the continuation: only its suffix encoded
    counted = service.count_tokens(handle.session_id, request)
    assert gateway.run(service.serve(handle.session_id, request)).prompt_tokens == counted
    with pytest.raises(GatewayHTTPError) as e:
        service.count_tokens(
            handle.session_id, TurnRequest(model="m", messages=[], tools=None, sampling={})
        )
    assert e.value.status == 400


def test_messages_count_tokens_route(gateway: Any) -> None:
    handle = gateway.session()
    root, key = _root(gateway, handle), {"x-api-key": handle.api_key}
    body = {"model": "m", "messages": [{"role": "user", "content": "Say a word."}]}
    counted = _post(root + "/v1/messages/count_tokens", body, **key)
    assert counted.status_code == 200
    served = _post(root + "/v1/messages", MESSAGES_BODY, **key).json()
    assert counted.json() == {"input_tokens": served["usage"]["input_tokens"]}
    assert _post(root + "/v1/v1/messages/count_tokens", body, **key).json() == counted.json()


class _StopRouter:
    """Ends every generation on the stop string ``" END"`` (as vLLM reports it), streaming token
    by token."""

    def __init__(self, tokenizer: Any) -> None:
        self.ids = list(tokenizer.encode("Hello there", add_special_tokens=False))

    async def generate(self, request_id: str, **kwargs: Any) -> TokenOutput:
        return TokenOutput(
            token_ids=self.ids, log_probs=[-0.5] * len(self.ids), stop_sequence=" END"
        )

    async def generate_stream(self, request_id: str, **kwargs: Any) -> AsyncIterator[TokenDelta]:
        for token in self.ids:
            yield TokenDelta(token_ids=[token], log_probs=[-0.5])
        yield TokenDelta(token_ids=[], log_probs=[], finished=True, stop_reason=StopReason.STOP,
                         stop_sequence=" END")

    async def abort(self, request_id: str, sticky_key: str | None = None) -> None:
        return None


def test_serve_reports_the_stop_sequence_and_streams_the_same_turn(tokenizer: Any) -> None:
    service = GatewayService(tokenizer, _StopRouter(tokenizer), None, max_length=512)
    handle = service.create_session()
    messages = [{"role": "user", "content": "Greet."}]

    async def run() -> tuple[TurnResult, list[Any]]:
        plain = await service.serve(
            handle.session_id, TurnRequest("m", messages, None, {"stop": [" END"]})
        )
        stream = await service.serve(
            handle.session_id, TurnRequest("m", messages, None, {}, stream=True)
        )
        assert not isinstance(stream, TurnResult)
        return plain, [event async for event in stream]

    plain, events = asyncio.run(run())
    assert isinstance(plain, TurnResult)
    assert plain.stop_sequence == " END" and plain.finish_reason == "stop"
    assert plain.message["content"] == "Hello there"
    *deltas, last = events
    assert isinstance(last, TurnResult) and all(isinstance(d, TextDelta) for d in deltas)
    assert "".join(d.text for d in deltas) == last.message["content"] == plain.message["content"]
    assert last.stop_sequence == " END" and last.completion_tokens == plain.completion_tokens


def _echo_dialect() -> Dialect:
    """A tiny in-test wire format: ``{"say": text}`` in, ``{"said": content}`` out."""

    def parse(body: Any, state: dict[str, Any]) -> TurnRequest:
        if not isinstance(body, dict) or not isinstance(body.get("say"), str):
            raise GatewayHTTPError(400, "say must be a string")
        state["requests"] = state.get("requests", 0) + 1
        return TurnRequest("m", [{"role": "user", "content": body["say"]}], None, {})

    def render(result: TurnResult, request: TurnRequest, state: dict[str, Any]) -> dict[str, Any]:
        return {"said": result.message["content"]}

    async def render_stream(
        events: Any, request: TurnRequest, state: dict[str, Any]
    ) -> AsyncIterator[str]:
        async for _ in events:
            yield ""

    return Dialect(
        name="echo", path="/echo", parse=parse, render=render, render_stream=render_stream,
        error_body=lambda e: {"oops": e.message},
    )


def test_handle_passes_the_dialect_its_session_state(gateway: Any) -> None:
    service: GatewayService = gateway.actor.service
    handle, dialect = gateway.session(), _echo_dialect()
    reply = gateway.run(service.handle(handle.session_id, dialect, {"say": "Say a word."}))
    assert reply == {"said": "Luminous."}
    assert service.dialect_state(handle.session_id, "echo") == {"requests": 1}
    with pytest.raises(GatewayHTTPError):
        gateway.run(service.handle(handle.session_id, dialect, {"say": 3}))


def test_three_dialects_in_one_session_give_separate_exact_trajectories(
    gateway: Any, tokenizer: Any
) -> None:
    """A chat sub-agent beside a Messages main agent and a Responses call: each conversation is its
    own exact trajectory."""
    handle = gateway.session()
    chat_messages = run_calculator_agent(client_for(handle), "What is 6*7?")
    root, key = _root(gateway, handle), {"x-api-key": handle.api_key}
    conversation: list[dict[str, Any]] = [{"role": "user", "content": "Say a word."}]
    reply = _post(root + "/v1/messages", {**MESSAGES_BODY, "messages": conversation}, **key).json()
    text = "".join(block["text"] for block in reply["content"] if block["type"] == "text")
    conversation += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Another word."},
    ]
    second = _post(root + "/v1/messages", {**MESSAGES_BODY, "messages": conversation}, **key).json()
    text2 = "".join(block["text"] for block in second["content"] if block["type"] == "text")
    auth = {"authorization": f"Bearer {handle.api_key}"}
    responses = _post(
        root + "/v1/responses", {"model": "m", "input": "One more word."}, **auth
    ).json()
    said = [
        part["text"]
        for item in responses["output"]
        if item["type"] == "message"
        for part in item["content"]
    ]
    trajectories = gateway.finalize(handle.session_id)["trajectories"]
    assert len(trajectories) == 3
    by_turns = {len(t.messages): t for t in trajectories}
    sep = tokenizer.encode("\n", add_special_tokens=False)
    chat_traj = by_turns[len(chat_messages)]
    assert list(chat_traj.prompt_ids) + list(chat_traj.response_ids) + sep == full_render_ids(
        tokenizer, chat_messages, [CALC_TOOL])
    anthropic_conv = [*conversation, {"role": "assistant", "content": text2}]
    msg_traj = by_turns[len(anthropic_conv)]
    assert list(msg_traj.prompt_ids) + list(msg_traj.response_ids) + sep == full_render_ids(
        tokenizer, anthropic_conv, None)
    sampled = [
        t for t, m in zip(msg_traj.response_ids, msg_traj.response_mask, strict=True) if m == 1
    ]
    assert tokenizer.decode(sampled, skip_special_tokens=True) == text + text2  # both sampled turns
    resp_conv = [
        {"role": "user", "content": "One more word."},
        {"role": "assistant", "content": "".join(said)},
    ]
    resp_traj = by_turns[len(resp_conv)]
    assert list(resp_traj.prompt_ids) + list(resp_traj.response_ids) + sep == full_render_ids(
        tokenizer, resp_conv, None)


def test_a_closed_dialect_stream_aborts_the_engine(gateway: Any) -> None:
    """Closing the rendered stream early (a client that went away) closes the turn's events, so the
    reservation is released and the engine request aborted; nothing is recorded."""
    service: GatewayService = gateway.actor.service
    handle = gateway.session()

    async def run() -> None:
        lines = await service.handle(
            handle.session_id, DIALECTS["chat"], {**CHAT_BODY, "stream": True}
        )
        assert not isinstance(lines, dict)
        first = await lines.__anext__()
        assert (
            json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
        )
        await lines.__anext__()  # the engine call has started
        await lines.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)

    gateway.run(run())
    state = gateway.run(gateway.actor.get_state(handle.session_id))
    assert state["in_flight"] == 0 and state["stats"]["num_pending"] == 0
    assert gateway.finalize(handle.session_id)["trajectories"] == []


def test_accepts_keyword_reads_the_runner_signature() -> None:
    async def named(*, base_url: str, anthropic_base_url: str) -> None: ...
    async def open_ended(*, base_url: str, **fields: Any) -> None: ...
    async def closed(*, base_url: str, api_key: str) -> None: ...

    assert accepts_keyword(named, "anthropic_base_url") and accepts_keyword(
        open_ended, "anthropic_base_url"
    )
    assert not accepts_keyword(closed, "anthropic_base_url")


def _run_agent(tokenizer: Any, entry: dict[str, Any], question: str) -> DataProto:
    """One sample of an ``openai_agent`` entry through a worker and a gateway (fake engine)."""
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 400, 200
    OmegaConf.resolve(cfg)
    r = cfg.actor_rollout_ref.rollout
    r.multi_turn.format = "hermes"
    registry = resolve_registry()
    registry["anthropic_agent"] = ResolvedAgentLoop(
        "anthropic_agent", registry["openai_agent"].cls, entry
    )
    nt = {
        "raw_prompt": np.empty(1, dtype=object),
        "agent_name": np.array(["anthropic_agent"], dtype=object),
        "uid": np.array(["u0"], dtype=object), "index": np.arange(1),
    }
    nt["raw_prompt"][0] = [{"role": "user", "content": question}]
    model = OmegaConf.create({"path": "tiny"})

    async def go() -> DataProto:
        server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id)
        gw = GatewayActor.from_slices(r, model, [server], tokenizer=tokenizer)
        await gw.start()
        try:
            worker = AgentLoopWorker.from_slices(
                r, model, [server], registry=registry, tokenizer=tokenizer, gateways=[gw]
            )
            return await worker.generate_sequences(
                DataProto(batch=None, non_tensor_batch=nt, meta_info={})
            )
        finally:
            await gw.shutdown()

    return asyncio.run(go())


def test_a_command_agent_finds_its_session_through_the_anthropic_variables(
    tokenizer: Any, tmp_path: Any
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os\nimport anthropic\n"
        "msgs = json.loads(os.environ['AGENTLOOP_RAW_PROMPT'])\n"
        "reply = anthropic.Anthropic(max_retries=0).messages.create(model='m', "
        "max_tokens=32, messages=msgs)\n"
        "assert reply.content[0].text == 'Luminous.', reply\n"
    )
    out = _run_agent(tokenizer, {"command": [sys.executable, str(script)]}, "say a word")
    assert out.non_tensor_batch["status"].tolist() == ["stop"]
    assert int(out.batch["response_mask"].sum()) > 0


def test_an_in_process_runner_that_asks_for_it_gets_anthropic_base_url(tokenizer: Any) -> None:
    seen: list[str] = []

    async def runner(*, base_url: str, api_key: str, raw_prompt: list, anthropic_base_url: str,
                     **fields: Any) -> None:
        seen.append(anthropic_base_url)
        client = anthropic.AsyncAnthropic(
            base_url=anthropic_base_url, api_key=api_key, max_retries=0
        )
        await client.messages.create(model="m", max_tokens=32, messages=raw_prompt)

    out = _run_agent(tokenizer, {"runner": runner}, "say a word")
    assert out.non_tensor_batch["status"].tolist() == ["stop"]
    assert seen and seen[0].endswith("/sessions/" + out.non_tensor_batch["gateway_session_id"][0])
