"""The OpenAI Responses API dialect's event stream and real clients (agentloop/gateway/dialects/
responses_stream.py): every event checked with the openai SDK's stream-event union, the stream ends
with the non-streamed body; the openai SDK (``responses.create``, ``stream=True``,
``responses.stream``) and openai-agents over an in-memory transport; and the route on a live gateway
(real HTTP, fake engine) recording token-exact trajectories.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import CALC_TOOL, LiveGateway, full_render_ids
from openai.types.responses import Response
from responses_helpers import CALC, call, canon, events_of, parse, result, stream

from agentloop.gateway.dialects.responses import DIALECT
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import ReasoningDelta, TextDelta, TurnEvent, TurnRequest, TurnResult


# ---- streaming -----------------------------------------------------------------------------------
def _final(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events[-1]["response"]


@pytest.mark.parametrize("case", ["text", "reasoning_text_calls", "calls_only", "no_deltas",
                                  "length", "reasoning_after_text"])
def test_stream_ends_with_the_non_streamed_body(case):
    req = parse({"input": "2+3?", "tools": [CALC]})
    items: list[Any]
    if case == "text":
        final = result("Hello there")
        items = [TextDelta("Hel"), TextDelta("lo"), TextDelta(" there"), final]
    elif case == "reasoning_text_calls":
        final = result("Let me.", calls=(call("c1"), call("c2")), reasoning="hmm ok")
        items = [ReasoningDelta("hmm"), ReasoningDelta(" ok"), TextDelta("Let"), TextDelta(" me."),
                 final]
    elif case == "calls_only":
        final = result(None, calls=(call("c1"),))
        items = [final]
    elif case == "no_deltas":
        final = result("all at once", reasoning="r")
        items = [final]
    elif case == "length":
        final = result("cut sho", finish="length")
        items = [TextDelta("cut"), final]  # the tail arrives with the result
    else:
        final = result("answer", reasoning="late")
        items = [TextDelta("answer"), ReasoningDelta("late"), final]
    events = stream(req, items)
    _check_consistent(events)
    body = dict(_final(events))
    Response.model_validate(body)
    expected = DIALECT.render(final, req, {})
    if case == "reasoning_after_text":  # streamed in the order it arrived
        assert [o["type"] for o in body["output"]] == ["message", "reasoning"]
        body["output"] = body["output"][::-1]
    assert body == expected


def _check_consistent(events: list[dict[str, Any]]) -> None:
    """Deltas add up to each done text; every added item is done at the index it was added at, with
    the item the final response holds there."""
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    first = events[0]["response"]
    assert first["status"] == "in_progress" and first["output"] == []
    final = events[-1]["response"]["output"]
    texts: dict[tuple[str, str], str] = {}
    added: dict[int, dict[str, Any]] = {}
    for e in events:
        kind = e["type"]
        if kind.endswith(".delta"):
            key = (kind.removesuffix(".delta"), e["item_id"])
            texts[key] = texts.get(key, "") + e["delta"]
        elif kind.endswith("_text.done"):
            assert texts.get((kind.removesuffix(".done"), e["item_id"]), "") == e["text"]
        elif kind == "response.function_call_arguments.done":
            assert texts[("response.function_call_arguments", e["item_id"])] == e["arguments"]
        elif kind == "response.output_item.added":
            assert e["output_index"] not in added
            added[e["output_index"]] = e["item"]
        elif kind == "response.output_item.done":
            assert added[e["output_index"]]["id"] == e["item"]["id"]
            assert final[e["output_index"]] == e["item"]
    assert sorted(added) == list(range(len(final)))


def test_streamed_length_ends_with_response_incomplete():
    req = parse({"input": "x"})
    events = stream(req, [TextDelta("a"), result("a", finish="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_error_mid_stream_is_an_error_event_then_response_failed():
    req = parse({"input": "x"})
    events = stream(req, [TextDelta("a"), GatewayHTTPError(503, "no engine", type_="server_error",
                                                           code="engine_unavailable")])
    error, failed = events[-2], events[-1]
    assert error["type"] == "error" and error["code"] == "engine_unavailable"
    assert error["message"] == "no engine"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "no engine"}
    Response.model_validate(failed["response"])
    assert stream(parse({"input": "x"}), [])[-1]["type"] == "response.failed"


def test_a_streamed_response_is_stored_like_a_non_streamed_one():
    state: dict[str, Any] = {}
    req = parse({"input": "q"}, state)
    stream(req, [TextDelta("A"), result("A")], state)
    msgs = parse({"input": "z", "previous_response_id": req.extra["response_id"]}, state).messages
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"},
                    {"role": "user", "content": "z"}]


# ---- real clients over an in-memory transport ---------------------------------------------------
class Dialogue:
    """The dialect behind an HTTP handler, with a scripted policy: a calculator call for a question,
    the answer after the tool output.  Records every parsed request."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.requests: list[TurnRequest] = []
        self.results: list[TurnResult] = []

    def policy(self, req: TurnRequest) -> TurnResult:
        last = req.messages[-1]
        if last["role"] == "tool":
            return result(f"The answer is {last['content']}.", reasoning="the tool said so")
        n = len(self.results)
        return result(None, calls=(call(f"call_{n}"),), reasoning="I should use the calculator")

    def items(self, req: TurnRequest, res: TurnResult) -> list[TurnEvent]:
        out: list[TurnEvent] = []
        if res.message.get("reasoning_content"):
            out.append(ReasoningDelta(res.message["reasoning_content"]))
        text = res.message.get("content") or ""
        out.extend(TextDelta(text[i:i + 4]) for i in range(0, len(text), 4))
        return [*out, res]

    def respond(self, body: Any) -> tuple[int, bytes, str]:
        try:
            req = DIALECT.parse(body, self.state)
        except GatewayHTTPError as e:
            return e.status, json.dumps(DIALECT.error_body(e)).encode(), "application/json"
        res = self.policy(req)
        self.requests.append(req)
        self.results.append(res)
        if not req.stream:
            body = DIALECT.render(res, req, self.state)
            return 200, json.dumps(body).encode(), "application/json"

        async def collect() -> str:
            gen = DIALECT.render_stream(events_of(self.items(req, res)), req, self.state)
            return "".join([line async for line in gen])

        return 200, asyncio.run(collect()).encode(), "text/event-stream"

    def sync_handler(self, request: httpx.Request) -> httpx.Response:
        status, content, media = self.respond(json.loads(request.content))
        return httpx.Response(status, content=content, headers={"content-type": media})

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://gw/sessions/s/v1", api_key="k", max_retries=0,
                             http_client=httpx.Client(transport=httpx.MockTransport(self.sync_handler)))


def _tool_loop(client: openai.OpenAI, create: Callable[..., Any], stateful: bool) -> str:
    items: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
    kwargs: dict[str, Any] = {"model": "m", "instructions": "Use the calculator.", "tools": [CALC]}
    response = create(input=items, store=stateful, **kwargs)
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"expression": "2+3"}
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}
    if stateful:
        response = create(input=[output], previous_response_id=response.id, **kwargs)
    else:
        items += [o.model_dump(exclude_none=True) for o in response.output] + [output]
        response = create(input=items, store=False, **kwargs)
    return response.output_text


@pytest.mark.parametrize("mode", ["create", "create_stream", "stream_helper"])
@pytest.mark.parametrize("stateful", [True, False], ids=["previous_response_id", "store_false"])
def test_openai_sdk_tool_loop(mode, stateful):
    dialogue = Dialogue()
    client = dialogue.client()

    def create(**kwargs: Any) -> Any:
        if mode == "create":
            return client.responses.create(**kwargs)
        if mode == "create_stream":
            done = [e for e in client.responses.create(stream=True, **kwargs)
                    if e.type in ("response.completed", "response.incomplete")]
            assert len(done) == 1
            return done[0].response
        with client.responses.stream(**kwargs) as events:
            for _ in events:
                pass
            return events.get_final_response()

    assert _tool_loop(client, create, stateful) == "The answer is 5."
    first, second = dialogue.requests
    assert all(r.stream == (mode != "create") for r in dialogue.requests)
    # the second request continues the first exactly: what the trie needs to extend the branch
    assert canon(second.messages[:len(first.messages)]) == canon(first.messages)
    assert canon([second.messages[len(first.messages)]]) == canon([dialogue.results[0].message])
    echoed = second.messages[len(first.messages)]
    assert echoed["reasoning_content"] == "I should use the calculator"
    assert second.messages[-1] == {"role": "tool", "content": "5", "tool_call_id": "call_0"}


def test_openai_sdk_sees_400s_in_openai_shape():
    client = Dialogue().client()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", previous_response_id="resp_missing")
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
    assert info.value.param == "tools.0.type"


def test_openai_agents_runner_with_its_default_responses_model():
    agents = pytest.importorskip("agents")
    dialogue = Dialogue()

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        status, content, media = await asyncio.to_thread(dialogue.respond, body)
        return httpx.Response(status, content=content, headers={"content-type": media})

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression, {"__builtins__": {}}))  # the test's own fixed expressions

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url="http://gw/sessions/s/v1", api_key="k", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        model = agents.OpenAIResponsesModel(model="m", openai_client=client)
        agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculator],
                             model=model)
        return await agents.Runner.run(agent, "What is 2+3?")

    agents.set_tracing_disabled(True)
    out = asyncio.run(run())
    assert out.final_output == "The answer is 5."
    first, second = dialogue.requests
    assert canon(second.messages[:len(first.messages)]) == canon(first.messages)
    assert canon([second.messages[len(first.messages)]]) == canon([dialogue.results[0].message])
    assert second.messages[-1]["role"] == "tool" and second.messages[-1]["content"] == "5"


# ---- the live gateway: real HTTP, fake engine, the tiny model's tokenizer ------------------------
@pytest.fixture
def gateway(tokenizer):
    gw = LiveGateway(tokenizer)
    yield gw
    gw.close()


def _sdk(handle: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0,
                         timeout=30)


def _chat_form(instructions: str, question: str, received: list[Any]) -> list[dict[str, Any]]:
    """The conversation the client saw, as chat messages (function calls as tool_calls)."""
    conv: list[dict[str, Any]] = [{"role": "system", "content": instructions},
                                  {"role": "user", "content": question}]
    for item in received:
        if item["type"] == "function_call":
            conv.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": json.loads(item["arguments"])}}]})
        elif item["type"] == "function_call_output":
            conv.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": item["output"]})
        else:
            conv.append({"role": "assistant", "content": item["content"][0]["text"]})
    return conv


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("stateful", [True, False], ids=["previous_response_id", "store_false"])
def test_live_gateway_tool_loop_records_a_token_exact_trajectory(gateway, tokenizer, stream,
                                                                 stateful):
    handle = gateway.session()
    client = _sdk(handle)

    def create(**kwargs: Any) -> Any:
        if not stream:
            return client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as events:
            return events.get_final_response()

    instructions, question = "You are a calculator.", "What is 6*7?"
    fn = CALC_TOOL["function"]
    kwargs: dict[str, Any] = {"model": "m", "instructions": instructions, "tools": [
        {"type": "function", "name": fn["name"], "description": fn["description"],
         "parameters": fn["parameters"]}]}
    items: list[Any] = [{"role": "user", "content": question}]
    first = create(input=items, store=stateful, **kwargs)
    [fc] = [o for o in first.output if o.type == "function_call"]
    assert fc.name == "calculator" and json.loads(fc.arguments) == {"expression": "6*7"}
    output = {"type": "function_call_output", "call_id": fc.call_id, "output": "42"}
    received = [o.model_dump(exclude_none=True) for o in first.output]
    if stateful:
        second = create(input=[output], previous_response_id=first.id, **kwargs)
    else:
        second = create(input=[*items, *received, output], store=False, **kwargs)
    assert second.output_text == "The answer is 42." and second.status == "completed"
    assert second.usage is not None and second.usage.output_tokens > 0
    received += [output, *(o.model_dump(exclude_none=True) for o in second.output)]
    [traj] = gateway.finalize(handle.session_id)["trajectories"]
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    sep = tokenizer.encode("\n", add_special_tokens=False)
    assert ids + sep == full_render_ids(tokenizer, _chat_form(instructions, question, received),
                                        [CALC_TOOL])
    sampled = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 1]
    assert tokenizer.decode(sampled).count("<|im_end|>") == 2


def test_live_gateway_refusals_are_openai_shaped_4xx_and_record_nothing(gateway):
    handle = gateway.session()
    url = f"{handle.base_url}/responses"
    headers = {"Authorization": f"Bearer {handle.api_key}"}
    for body in ({"input": [{"type": "bogus"}]}, {"input": "x", "tools": [{"type": "web_search"}]},
                 {"input": "x", "previous_response_id": "resp_x"},
                 {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
                 {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
                 {"input": "x", "temperature": "warm"}):
        reply = httpx.post(url, json=body, headers=headers, timeout=30)
        assert reply.status_code == 400, (body, reply.text)
        assert set(reply.json()["error"]) >= {"message", "type", "param", "code"}
    reply = httpx.post(url, json={"input": "x"}, timeout=30)
    assert reply.status_code == 401 and reply.json()["error"]["message"]
    assert gateway.finalize(handle.session_id)["trajectories"] == []
