"""Reasoning through the gateway: <think> split into reasoning_content, streamed == non-streamed,
echoed reasoning matching its sampled turn, templates that drop past reasoning closing the branch as
a snapshot, and the trajectories token-exact (docs/gateway.md#reasoning)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from agentloop.errors import ConfigError
from agentloop.gateway.decode import StreamDecoder, decode_turn
from agentloop.gateway.store import SessionStore, Trajectory, canonical_message
from agentloop.gateway.turn import ReasoningDelta, TextDelta
from agentloop.parsers import get_reasoning_parser, get_tool_parser
from agentloop.parsers.reasoning import ReasoningParser, ReasoningSplit
from agentloop.testing.reasoning import REASONING_PARSER, ensure_tiny_reasoning_model
from agentloop.tokenization.incremental import assistant_text
from agentloop.types import StopReason
from tests.unit.gateway_helpers import LiveGateway, client_for

CALC = {
    "type": "function",
    "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer  # heavy: only for this module's tests

    return AutoTokenizer.from_pretrained(str(ensure_tiny_reasoning_model()))


def ids_of(tok: Any, text: str, end: bool = True) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False)) + ([tok.eos_token_id] if end else [])


def decode(
    tok: Any, text: str, parser: str = REASONING_PARSER, tools: bool = True,
    stop: StopReason = StopReason.STOP,
) -> Any:
    hermes = get_tool_parser("hermes", tok)
    return asyncio.run(
        decode_turn(
            hermes, tok, ids_of(tok, text), stop, [CALC] if tools else None, tools,
            reasoning=get_reasoning_parser(parser, tok),
        )
    )


# ---- parsers -------------------------------------------------------------------------------------
def test_reasoning_parsers_split_complete_and_partial_text() -> None:
    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    assert r1.split("why\n</think>\n\nHi") == ReasoningSplit("why\n", "\n\nHi")
    assert r1.split("<think>why</think>Hi") == ReasoningSplit("why", "Hi")
    assert r1.split("still thinking") == ReasoningSplit("still thinking", "")
    assert r1.split("still </thi", partial=True) == ReasoningSplit("still ", None)
    assert qwen3.split("<think>\nwhy\n</think>\n\nHi") == ReasoningSplit("\nwhy\n", "\n\nHi")
    assert qwen3.split("Hi </think>") == ReasoningSplit(None, "Hi </think>")
    assert qwen3.split("<thi", partial=True) == ReasoningSplit(None, None)
    assert qwen3.split("Hi", partial=True) == ReasoningSplit(None, "Hi")
    assert get_reasoning_parser(None) is None


def test_unknown_reasoning_parser_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="deepseek_r1"):
        get_reasoning_parser("deepseek-r2")


def test_a_registered_reasoning_parser_is_found_by_name() -> None:
    @ReasoningParser.register("test_angle_think")
    class Angle(ReasoningParser):
        start, end, opened_by_prompt = "<<", ">>", False

    assert get_reasoning_parser("test_angle_think").split("<<a>>b") == ReasoningSplit("a", "b")


# ---- non-streaming decode ------------------------------------------------------------------------
def test_decode_splits_reasoning_from_answer_and_tool_calls(tok: Any) -> None:
    out = decode(tok, "I will use the tool.\n</think>\n\n" + CALL)
    assert out.message["reasoning_content"] == "I will use the tool."
    assert out.message["content"] is None and out.finish_reason == "tool_calls"
    assert json.loads(out.message["tool_calls"][0]["function"]["arguments"]) == {
        "expression": "6 * 7"
    }
    out = decode(tok, "Easy.\n</think>\n\nThe answer is 42.")
    assert out.message == {
        "role": "assistant", "content": "The answer is 42.", "reasoning_content": "Easy.",
    }
    assert out.finish_reason == "stop"


def test_a_tool_call_inside_the_reasoning_is_not_a_call(tok: Any) -> None:
    out = decode(tok, "maybe " + CALL + " no.\n</think>\n\n42.")
    assert "tool_calls" not in out.message and out.message["content"] == "42."
    assert out.message["reasoning_content"] == "maybe " + CALL + " no."


def test_decode_without_the_end_marker(tok: Any) -> None:
    out = decode(tok, "thinking and thinking", stop=StopReason.LENGTH)
    assert out.message == {
        "role": "assistant", "content": "", "reasoning_content": "thinking and thinking",
    }
    assert out.finish_reason == "length"
    plain = decode(tok, "The answer is 42.", parser="qwen3")  # the model did not open <think>
    assert plain.message == {"role": "assistant", "content": "The answer is 42."}


def test_empty_reasoning_is_left_out_and_a_bad_call_keeps_only_the_answer_text(tok: Any) -> None:
    assert "reasoning_content" not in decode(tok, "\n</think>\n\nHi.").message
    bad = decode(tok, "hmm\n</think>\n\n<tool_call>\n{oops\n</tool_call>")
    assert (
        bad.message["content"] == "<tool_call>\n{oops\n</tool_call>" and bad.num_parse_errors == 1
    )
    assert bad.message["reasoning_content"] == "hmm"


def test_decode_without_a_reasoning_parser_is_unchanged(tok: Any) -> None:
    hermes = get_tool_parser("hermes", tok)
    out = asyncio.run(
        decode_turn(hermes, tok, ids_of(tok, "a\n</think>\n\nb"), StopReason.STOP, None, True)
    )
    assert out.message == {"role": "assistant", "content": "a\n</think>\n\nb"}


# ---- streaming -----------------------------------------------------------------------------------
STREAMED = [
    "I will use the tool.\n</think>\n\n" + CALL, "Easy.  \n\n</think>\n\n  The answer is 42.  ",
    "thinking, still thinking </thi", "\n</think>\n\nHi.",
    "maybe " + CALL + " no.\n</think>\n\nSo: 42. " + CALL, "<think>\nwhy\n</think>\n\nHi.",
]


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_streamed_reasoning_and_content_equal_the_non_streamed_fields(
    tok: Any, text: str, parser: str
) -> None:
    reasoning = get_reasoning_parser(parser, tok)
    decoder = StreamDecoder(tok, "<tool_call>", reasoning=reasoning)
    events: list[Any] = []
    for token in ids_of(tok, text):
        events += decoder.push_deltas([token])
    final = decode(tok, text, parser=parser)
    message = dict(final.message)
    events += decoder.settle(message)
    assert message == final.message  # what the client saw is what is stored
    kinds = [type(e) for e in events]
    assert ReasoningDelta not in kinds[kinds.index(TextDelta) :] if TextDelta in kinds else True
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == final.message.get(
        "reasoning_content", ""
    )
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == (
        final.message["content"] or ""
    )
    assert all(e.text for e in events)


def test_reasoning_streams_before_the_end_marker(tok: Any) -> None:
    decoder = StreamDecoder(
        tok, "<tool_call>", reasoning=get_reasoning_parser(REASONING_PARSER, tok)
    )
    first = decoder.push_deltas(ids_of(tok, "Let me think about it", end=False))
    assert first and all(isinstance(e, ReasoningDelta) for e in first)
    assert "".join(e.text for e in first) == "Let me think about it"
    assert (
        decoder.push_deltas(ids_of(tok, " </", end=False)) == []
    )  # could begin </think>: held back


def test_hold_all_parsers_still_stream_reasoning(tok: Any) -> None:
    decoder = StreamDecoder(
        tok, None, hold_all=True, reasoning=get_reasoning_parser(REASONING_PARSER, tok)
    )
    events = decoder.push_deltas(ids_of(tok, "why\n</think>\n\nHi", end=False))
    assert events == [ReasoningDelta("why")]


# ---- the store -----------------------------------------------------------------------------------
USER = {"role": "user", "content": "What is 6 * 7?"}
CALLED = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "I will use the tool.",
    "tool_calls": [
        {
            "id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
ANSWER = {
    "role": "assistant", "content": "The answer is 42.", "reasoning_content": "It returned 42.",
}
AGAIN = {"role": "user", "content": "And 7 * 8?"}


def sample(
    store: SessionStore, messages: list[dict[str, Any]], reply: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Reserve, "sample" the template's text for ``reply`` and the end-of-turn token, commit it."""
    res = store.prepare(messages, tools)
    text, _ = assistant_text(store.tokenizer, reply, tools, (store.tokenizer.eos_token,), {})
    ids = ids_of(store.tokenizer, text)
    store.commit(
        res, ids, [-0.5] * len(ids), reply, "tool_calls" if reply.get("tool_calls") else "stop"
    )
    return ids


def render_ids(
    tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
    prompt: bool = False,
) -> list[int]:
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=prompt
    )
    return list(tok.encode(text, add_special_tokens=False))


def whole(traj: Trajectory) -> list[int]:
    return traj.prompt_ids + traj.response_ids


def test_canonical_form_includes_reasoning() -> None:
    assert canonical_message(ANSWER) != canonical_message({**ANSWER, "reasoning_content": "other"})
    assert canonical_message(ANSWER) == canonical_message(
        {**ANSWER, "reasoning_content": " It returned 42.\n"}
    )
    assert canonical_message({**ANSWER, "reasoning_content": None}) == canonical_message(
        {"role": "assistant", "content": "The answer is 42."}
    )


def test_echoed_reasoning_extends_the_branch_token_exact(tok: Any) -> None:
    store = SessionStore(tok, max_length=4096)
    first = sample(store, [USER], CALLED, [CALC])
    sample(store, [USER, CALLED, RESULT], ANSWER, [CALC])
    assert store.stats()["num_fallbacks"] == 0 and store.stats()["num_trajectories"] == 1
    (traj,) = store.trajectories()
    assert traj.response_ids[: len(first)] == first  # the sampled ids, as sampled
    conversation = [USER, CALLED, RESULT, ANSWER]
    assert whole(traj) + ids_of(tok, "\n", end=False) == render_ids(tok, conversation, [CALC])
    assert traj.messages == conversation


def test_reasoning_left_out_where_the_template_keeps_it_is_another_turn(tok: Any) -> None:
    store = SessionStore(tok, max_length=4096)
    sample(store, [USER], CALLED, [CALC])
    dropped = {k: v for k, v in CALLED.items() if k != "reasoning_content"}
    res = store.prepare(
        [USER, dropped, RESULT], [CALC]
    )  # the template would render the reasoning here
    assert res.node.parent is None  # no match: a new tree whose context holds the client's turn
    assert res.prompt_ids == render_ids(tok, [USER, dropped, RESULT], [CALC], prompt=True)


@pytest.mark.parametrize("echo", ["with", "without"])
def test_a_new_user_turn_closes_the_branch_as_a_snapshot(tok: Any, echo: str) -> None:
    """The template drops reasoning before the last user query: not prefix-stable, so a new tree
    starts; a client that dropped the reasoning itself still matches the sampled turn (it is dropped
    anyway)."""
    store = SessionStore(tok, max_length=4096)
    first_ids = sample(store, [USER], ANSWER)
    sent = ANSWER if echo == "with" else {"role": "assistant", "content": ANSWER["content"]}
    second = {"role": "assistant", "content": "56.", "reasoning_content": "7 * 8 = 56."}
    sample(store, [USER, sent, AGAIN], second)
    assert (
        store.stats()["num_fallbacks"] == 1
    )  # matched the sampled turn, then could not continue it
    snapshot, final = store.trajectories()
    assert snapshot.response_ids == first_ids and snapshot.messages == [USER, ANSWER]
    assert whole(snapshot) + ids_of(tok, "\n", end=False) == render_ids(tok, [USER, ANSWER])
    assert final.prompt_ids == render_ids(tok, [USER, sent, AGAIN], prompt=True)
    assert whole(final) + ids_of(tok, "\n", end=False) == render_ids(
        tok, [USER, sent, AGAIN, second]
    )
    assert all(final.response_mask)


# ---- over HTTP (fake engine) ---------------------------------------------------------------------
def think_policy(tok: Any) -> Any:
    """Replies like a thinking model whose prompt opened <think>: reasoning, </think>, answer."""

    def reply(prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        last = tok.decode(prompt_ids).rsplit("<|im_start|>", 2)[-2]
        if m := re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.S):
            text = f"It returned {m.group(1)}.\n</think>\n\nThe answer is {m.group(1)}."
        elif q := re.search(r"What is (.+?)\?", last):
            call = json.dumps({"name": "calculator", "arguments": {"expression": q.group(1)}})
            text = f"I will use the tool.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
        else:
            text = "Nothing to compute.\n</think>\n\nHello."
        return ids_of(tok, text)

    return reply


@pytest.fixture(scope="module")
def gateway(tok: Any) -> Iterator[LiveGateway]:
    live = LiveGateway(tok, policy=think_policy(tok), reasoning_parser=REASONING_PARSER)
    yield live
    live.close()


def ask(
    client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool
) -> tuple[dict[str, Any], str]:
    """One chat request: the assistant message as the client would echo it, the finish reason."""
    if not stream:
        resp = client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        return resp.choices[0].message.model_dump(exclude_none=True), resp.choices[
            0
        ].finish_reason or ""
    content, reasoning, calls, finish = "", "", {}, ""
    for chunk in client.chat.completions.create(
        model="m", messages=messages, tools=[CALC], stream=True
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for tc in choice.delta.tool_calls or []:
                calls[tc.index] = {
                    "id": tc.id, "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
            finish = choice.finish_reason or finish
    msg: dict[str, Any] = {
        "role": "assistant", "content": content or None, "reasoning_content": reasoning,
    }
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def agent(client: openai.OpenAI, stream: bool) -> list[dict[str, Any]]:
    """Calculator agent code that echoes every assistant message back as it got it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
    for _ in range(3):
        msg, finish = ask(client, messages, stream)
        messages.append(msg)
        if finish != "tool_calls":
            return messages
        for call in msg["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_round_trip_over_http_is_token_exact(
    gateway: LiveGateway, tok: Any, stream: bool
) -> None:
    handle = gateway.session()
    messages = agent(client_for(handle), stream)
    assert [m.get("reasoning_content") for m in messages[1::2]] == [
        "I will use the tool.",
        "It returned 42.",
    ]
    assert messages[-1]["content"] == "The answer is 42."
    (traj,) = gateway.finalize(handle.session_id)["trajectories"]
    assert whole(traj) + ids_of(tok, "\n", end=False) == render_ids(tok, messages, [CALC])
    assert [m.get("reasoning_content") for m in traj.messages if m["role"] == "assistant"] == [
        "I will use the tool.",
        "It returned 42.",
    ]


def test_streamed_and_plain_replies_are_equal(gateway: LiveGateway) -> None:
    question = [{"role": "user", "content": "Say hello."}]
    plain = ask(client_for(gateway.session()), question, stream=False)
    streamed = ask(client_for(gateway.session()), question, stream=True)
    assert (
        plain
        == streamed
        == (
            {"role": "assistant", "content": "Hello.", "reasoning_content": "Nothing to compute."},
            "stop",
        )
    )


def test_a_second_question_snapshots_over_http(gateway: LiveGateway, tok: Any) -> None:
    handle = gateway.session()
    client = client_for(handle)
    messages = agent(client, stream=False)
    messages.append({"role": "user", "content": "Say hello."})
    reply, _ = ask(client, messages, stream=False)
    first, second = gateway.finalize(handle.session_id)["trajectories"]
    assert len(first.messages) == 4 and len(second.messages) == 6 and second.messages[-1] == reply
    assert second.prompt_ids == render_ids(
        tok, messages, [CALC], prompt=True
    )  # past reasoning dropped


def test_reasoning_content_must_be_a_string_on_an_assistant_message(gateway: LiveGateway) -> None:
    client = client_for(gateway.session())
    bad = [{"role": "user", "content": "hi", "reasoning_content": "no"}]
    with pytest.raises(openai.BadRequestError, match="reasoning_content"):
        client.chat.completions.create(model="m", messages=bad)


# ---- the other dialects --------------------------------------------------------------------------
ANTHROPIC_CALC = {"name": "calculator", "description": CALC["function"]["description"],
                  "input_schema": CALC["function"]["parameters"]}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks_round_trip_through_the_anthropic_sdk(gateway: LiveGateway, tok: Any,
                                                              stream: bool) -> None:
    """Reasoning comes back as a thinking block, the SDK echoes it (``to_param``), and the session
    records one exact trajectory, as for chat."""
    import anthropic

    handle = gateway.session()
    sdk = anthropic.Anthropic(base_url=handle.base_url.removesuffix("/v1"), api_key=handle.api_key,
                              max_retries=0, timeout=30)
    messages: list[Any] = [{"role": "user", "content": "What is 6 * 7?"}]
    kwargs = {"model": "m", "max_tokens": 64, "tools": [ANTHROPIC_CALC]}
    thoughts = []
    for _ in range(2):
        if stream:
            with sdk.messages.stream(messages=messages, **kwargs) as s:
                reply = s.get_final_message()
        else:
            reply = sdk.messages.create(messages=messages, **kwargs)
        thoughts.append([b.thinking for b in reply.content if b.type == "thinking"])
        messages.append(reply.to_param())
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": "42"} for b in uses]})
    assert thoughts == [["I will use the tool."], ["It returned 42."]]
    (traj,) = gateway.finalize(handle.session_id)["trajectories"]
    assert [m.get("reasoning_content") for m in traj.messages if m["role"] == "assistant"] == [
        "I will use the tool.", "It returned 42."]
    assert whole(traj) + ids_of(tok, "\n", end=False) == render_ids(tok, traj.messages, [CALC])


def test_reasoning_items_round_trip_through_the_responses_api(gateway: LiveGateway,
                                                              tok: Any) -> None:
    """A reasoning output item, echoed back with ``store: false`` (stateless), matches its turn."""
    handle = gateway.session()
    client = client_for(handle)
    tool = {"type": "function", **CALC["function"]}
    items: list[Any] = [{"role": "user", "content": "What is 6 * 7?"}]
    first = client.responses.create(model="m", input=items, tools=[tool], store=False)
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    call_id = first.output[1].call_id
    items.append({"type": "function_call_output", "call_id": call_id, "output": "42"})
    second = client.responses.create(model="m", input=items, tools=[tool], store=False)
    assert second.output_text == "The answer is 42."
    (traj,) = gateway.finalize(handle.session_id)["trajectories"]
    assert [m.get("reasoning_content") for m in traj.messages if m["role"] == "assistant"] == [
        "I will use the tool.", "It returned 42."]
    assert whole(traj) + ids_of(tok, "\n", end=False) == render_ids(tok, traj.messages, [CALC])
