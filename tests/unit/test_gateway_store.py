"""SessionStore: canonical messages, branch matching, suffix-only encoding, token-exact
trajectories."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from agentloop.gateway import store as store_module
from agentloop.gateway.store import (
    Reservation,
    SessionStore,
    StoreError,
    Trajectory,
    canonical_message,
    canonical_tools,
)
from agentloop.testing import FakeTokenizer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.tokenization import (
    TemplateMismatchError,
    check_incremental,
    encode_new_turns,
    turn_separator,
)
from agentloop.tokenization.incremental import assistant_text

SYS = {"role": "system", "content": "You are helpful. Reply in 1 short sentence."}
USR = {"role": "user", "content": "Pick any random English word and reply with just that word."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator", "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(
    expression: str, call_id: str = "call_0", content: str = "", as_string: bool = False
) -> dict[str, Any]:
    args: Any = {"expression": expression}
    fn = {
        "name": "calculator",
        "arguments": json.dumps(args, separators=(",", ":")) if as_string else args,
    }
    calls = [{"id": call_id, "type": "function", "function": fn}]
    return {"role": "assistant", "content": content, "tool_calls": calls}


def tool(content: str, call_id: str = "call_0") -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_call_id": call_id}


def sampled_ids(
    tok: Any, message: dict[str, Any], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """What the policy samples for ``message``: the template's text for it, then the end-of-turn
    token."""
    text, _ = assistant_text(tok, message, tools, (tok.eos_token,), {})
    return list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]


def full_ids(
    tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    return list(
        tok.encode(
            tok.apply_chat_template(messages, tools=tools, tokenize=False), add_special_tokens=False
        )
    )


def turn(
    store: SessionStore, messages: list[dict[str, Any]], reply: dict[str, Any],
    tools: list[dict[str, Any]] | None = None, *, logprob: float | None = -0.5, cut: bool = False,
    stored: dict[str, Any] | None = None,
) -> Reservation:
    """One request: reserve, "generate" ``reply`` (without its end token when ``cut``), commit
    ``stored``."""
    res = store.prepare(messages, tools)
    ids = sampled_ids(store.tokenizer, reply, tools)
    ids = ids[:-1] if cut else ids
    lps = None if logprob is None else [logprob] * len(ids)
    if cut:
        finish = "length"
    elif reply.get("tool_calls"):
        finish = "tool_calls"
    else:
        finish = "stop"
    store.commit(res, ids, lps, stored or reply, finish)
    return res


def sampled_runs(traj: Trajectory) -> list[list[int]]:
    """Maximal runs of response ids under mask 1."""
    runs: list[list[int]] = []
    for k, (t, m) in enumerate(zip(traj.response_ids, traj.response_mask, strict=True)):
        if m and (k == 0 or not traj.response_mask[k - 1]):
            runs.append([])
        if m:
            runs[-1].append(t)
    return runs


@pytest.fixture
def tok() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


# ---- canonical form
# --------------------------------------------------------------------------------
def test_canonical_message_ignores_ids_and_compares_json_arguments() -> None:
    a = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": '{"a": 1, "b": [1, 2]}'},
            }
        ],
    }
    b = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "other", "type": "function",
                "function": {"name": "f", "arguments": {"b": [1, 2], "a": 1}},
            }
        ],
    }
    assert canonical_message(a) == canonical_message(b)
    assert hash(canonical_message(a)) == hash(canonical_message(b))
    c = json.loads(json.dumps(b))
    c["tool_calls"][0]["function"]["arguments"] = '{"a":2,"b":[1,2]}'
    assert canonical_message(c) != canonical_message(a)
    c["tool_calls"][0]["function"]["name"] = "g"
    assert canonical_message(c) != canonical_message(a)
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": " {oops "}}]}
    bad2: dict[str, Any] = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
    }
    assert canonical_message(bad) == canonical_message(bad2)
    bad2["tool_calls"][0]["function"]["arguments"] = "{oops!"
    assert canonical_message(bad) != canonical_message(bad2)
    empty = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}
    assert canonical_message(empty) == canonical_message({"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]})


def test_canonical_message_content_name_and_tool_call_id() -> None:
    assert canonical_message(tool("5", "call_1")) == canonical_message(tool("5", "call_2"))
    assert canonical_message(tool("5")) != canonical_message(tool("6"))
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
    }
    assert canonical_message(parts) == canonical_message(user("hello"))
    assert canonical_message({"role": "user", "content": None}) == canonical_message(user(""))
    assert canonical_message({"role": "user", "content": []}) == canonical_message(user(""))
    image = {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "image_url", "image_url": {"url": "data:a"}}]}
    other = {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "image_url", "image_url": {"url": "data:b"}}]}
    assert canonical_message(image) != canonical_message(user("hello"))
    assert canonical_message(image) != canonical_message(other)
    assert canonical_message(image) == canonical_message(json.loads(json.dumps(image)))
    assert canonical_message({**user("hi"), "name": "bob"}) != canonical_message(user("hi"))
    assert canonical_message(user("hi")) != canonical_message(say("hi"))
    assert canonical_tools(TOOLS) == canonical_tools(json.loads(json.dumps(TOOLS, sort_keys=True)))
    assert canonical_tools(None) == canonical_tools([]) != canonical_tools(TOOLS)


# ---- trajectories
# ----------------------------------------------------------------------------------
def test_linear_tool_conversation_is_one_exact_trajectory(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    full = [
        SYS, user("What is 2 + 3, then 4 * 5?"), call("2 + 3", content="Let me compute."),
        tool("5"), say("5. Now the product."), user("go on"), call("4 * 5", "call_9"),
        tool("20", "call_9"), say("It is 20."),
    ]
    replies = [k for k, m in enumerate(full) if m["role"] == "assistant"]
    for n, k in enumerate(replies):
        # the client echoes earlier replies with new call ids and reformatted arguments: still the
        # same branch
        echoed = [
            call(
                m["tool_calls"][0]["function"]["arguments"]["expression"], f"id{n}", m["content"],
                True,
            )
            if m.get("tool_calls")
            else m
            for m in full[:k]
        ]
        turn(store, echoed, full[k], logprob=-0.1 * (n + 1))
    [traj] = store.trajectories()
    ids = traj.prompt_ids + traj.response_ids
    assert ids == check_incremental(tok, full)
    assert ids + tok.encode(turn_separator(tok)) == full_ids(tok, full)
    assert traj.prompt_ids == tok.apply_chat_template(full[:2], add_generation_prompt=True)
    assert sampled_runs(traj) == [sampled_ids(tok, full[k]) for k in replies]
    assert traj.response_logprobs is not None
    expected_lps = {-0.1 * (n + 1) for n in range(len(replies))}
    assert {
        lp for lp, m in zip(traj.response_logprobs, traj.response_mask, strict=True) if m
    } == expected_lps
    assert all(
        lp == 0.0 for lp, m in zip(traj.response_logprobs, traj.response_mask, strict=True) if not m
    )
    assert [canonical_message(m) for m in traj.messages] == [canonical_message(m) for m in full]
    assert traj.num_turns == len(full) and traj.finish_reason == "stop"
    stats = store.stats()
    assert (
        stats["num_sampled_nodes"] == 4
        and stats["num_context_nodes"] == 4
        and stats["num_trajectories"] == 1
    )
    assert stats["num_encoded_tokens"] == len(traj.response_mask) - sum(traj.response_mask) + len(
        traj.prompt_ids
    )


def test_hermes_tool_conversation_with_the_tiny_tokenizer(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    store = SessionStore(tok, max_length=4096)
    two_calls = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "a", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}},
            },
            {
                "id": "b", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "4 * 5"}},
            },
        ],
    }
    full = [
        {"role": "system", "content": "Use the calculator."}, user("What is 2 + 3 and 4 * 5?"),
        two_calls, tool("5", "a"), tool("20", "b"), say("They are 5 and 20."), user("And 7 - 1?"),
        call("7 - 1"), tool("6"), say("It is 6."),
    ]
    for k in (2, 5, 7, 9):
        stored = full[k]
        # what the gateway returns: arguments as a JSON string, fresh ids
        if full[k].get("tool_calls"):
            stored = {
                **full[k],
                "tool_calls": [
                    {
                        "id": f"call_{k}_{j}",
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": json.dumps(c["function"]["arguments"]),
                        },
                    }
                    for j, c in enumerate(full[k]["tool_calls"])
                ],
            }
        res = turn(store, full[:k], full[k], TOOLS, stored=stored)
        if k > 2:
            # only the new turns were encoded
            assert res.num_encoded_tokens == len(res.node.ids) < 40
    [traj] = store.trajectories()
    ids = traj.prompt_ids + traj.response_ids
    assert ids == check_incremental(tok, full, TOOLS)
    assert ids + tok.encode("\n", add_special_tokens=False) == full_ids(tok, full, TOOLS)
    assert sampled_runs(traj) == [sampled_ids(tok, full[k], TOOLS) for k in (2, 5, 7, 9)]
    assert traj.num_turns == len(full)


def test_best_of_n_then_continue_the_winner(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    first = turn(store, [SYS, USR], say("Luminous."))
    second = turn(store, [SYS, USR], say("Serendipity."))
    third = turn(store, [SYS, USR], say("Ephemeral."))
    assert (
        first.num_encoded_tokens > 0 and second.num_encoded_tokens == third.num_encoded_tokens == 0
    )
    assert first.node is second.node is third.node
    cont = [SYS, USR, say("Serendipity."), user("Now pick another.")]
    res = turn(store, cont, say("Whimsical."))
    assert res.num_encoded_tokens == len(
        encode_new_turns(tok, [user("Now pick another.")], system=SYS)
    )
    trajs = store.trajectories()
    assert [t.messages[2]["content"] for t in trajs] == ["Luminous.", "Ephemeral.", "Serendipity."]
    assert all(t.prompt_ids == first.prompt_ids for t in trajs)
    winner = trajs[2]
    assert winner.num_turns == 5 and winner.messages[-1]["content"] == "Whimsical."
    assert winner.prompt_ids + winner.response_ids == check_incremental(
        tok, [*cont, say("Whimsical.")]
    )
    assert sampled_runs(winner) == [
        sampled_ids(tok, say("Serendipity.")),
        sampled_ids(tok, say("Whimsical.")),
    ]
    assert [t.num_turns for t in trajs[:2]] == [3, 3]
    assert store.stats()["num_trajectories"] == 3 and store.stats()["num_sampled_nodes"] == 4
    assert store.trajectories(longest_only=True) == [winner]


def test_continuation_encodes_only_the_new_suffix(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    msgs = [SYS, user("Hi there, tell me a long story about a cat.")]
    first = turn(store, msgs, say("Once upon a time."))
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert first.num_encoded_tokens == len(first.prompt_ids) == len(rendered)
    follow = [*msgs, say("Once upon a time."), user("more")]
    res = store.prepare(follow)
    suffix = encode_new_turns(tok, [user("more")], system=SYS)
    assert res.num_encoded_tokens == len(suffix) == len(res.node.ids)
    assert res.prompt_ids == first.prompt_ids + sampled_ids(tok, say("Once upon a time.")) + suffix
    # the same request again (a retry, or a second sample): nothing encoded
    again = store.prepare(follow)
    assert (
        again.node is res.node
        and again.num_encoded_tokens == 0
        and again.prompt_ids == res.prompt_ids
    )
    assert res.node.pending == 2
    assert store.stats()["num_encoded_tokens"] == len(first.prompt_ids) + len(suffix)


def test_independent_sub_conversations_do_not_interleave(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    a, b = [SYS, user("Agent A task")], [SYS, user("Agent B task")]
    turn(store, a, say("A one"))
    turn(store, b, say("B one"))
    turn(store, [*a, say("A one"), user("A again")], say("A two"))
    turn(store, [*b, say("B one"), user("B again")], say("B two"))
    trajs = store.trajectories()
    assert len(trajs) == 2
    for name, traj in zip("AB", trajs, strict=True):
        other = "B" if name == "A" else "A"
        text = tok.decode(traj.prompt_ids + traj.response_ids)
        assert f"{name} two" in text and f"{other} " not in text
        assert all(f"{other} " not in m["content"] for m in traj.messages)
        assert traj.prompt_ids + traj.response_ids == check_incremental(tok, traj.messages)


def test_concurrent_reservations_give_sibling_samples(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    msgs = [SYS, USR]

    async def request(reply: str, delay: float) -> None:
        res = store.prepare(msgs)
        await asyncio.sleep(delay)  # the engine call: other requests of the session run meanwhile
        ids = sampled_ids(tok, say(reply))
        store.commit(res, ids, [-1.0] * len(ids), say(reply), "stop")

    async def main() -> None:
        await asyncio.gather(request("slow", 0.02), request("fast", 0.0))

    asyncio.run(main())
    trajs = store.trajectories()
    # creation order of the samples
    assert [t.messages[-1]["content"] for t in trajs] == ["fast", "slow"]
    assert trajs[0].prompt_ids == trajs[1].prompt_ids
    stats = store.stats()
    assert (
        stats["num_context_nodes"] == 1
        and stats["num_sampled_nodes"] == 2
        and stats["num_pending"] == 0
    )


def test_release_after_failure_removes_the_dangling_context(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    turn(store, [SYS, USR], say("Luminous."))
    before = store.stats()
    res = store.prepare([SYS, USR, say("Luminous."), user("again")])
    assert store.stats()["num_context_nodes"] == before["num_context_nodes"] + 1
    store.release(res)
    store.release(res)  # twice: nothing more happens
    after = store.stats()
    assert after["num_context_nodes"] == before["num_context_nodes"] and after["num_pending"] == 0
    assert len(store.trajectories()) == 1
    with pytest.raises(StoreError, match="already committed or released"):
        store.commit(res, [5], None, say("x"), "stop")
    # a context with a sample survives a failed second request
    retry = store.prepare([SYS, USR])
    store.release(retry)
    assert store.stats()["num_context_nodes"] == before["num_context_nodes"]
    # a new context another request still waits on is kept until that one is done
    one, two = store.prepare([user("other")]), store.prepare([user("other")])
    store.release(one)
    assert store.stats()["num_context_nodes"] == before["num_context_nodes"] + 1
    store.commit(two, sampled_ids(tok, say("ok")), None, say("ok"), "stop")
    assert len(store.trajectories()) == 2


def test_misaligned_logprobs_are_refused_and_release(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    res = store.prepare([USR])
    with pytest.raises(StoreError, match="logprobs"):
        store.commit(res, [5, 6, IM_END], [-1.0], say("x"), "stop")
    assert store.stats()["num_nodes"] == 0 and res.done


def test_edited_assistant_becomes_context_of_a_new_branch(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    q = [SYS, user("Capital of France?")]
    turn(store, q, say("Paris."))
    turn(store, [*q, say("Paris."), user("And of Italy?")], say("Rome."))
    # the client rewrote the second answer: the first sample is kept, the edit is context (mask 0)
    edited = [*q, say("Paris."), user("And of Italy?"), say("Rome, of course."), user("Spain?")]
    res = turn(store, edited, say("Madrid."))
    assert res.node.messages == edited[3:] and res.num_encoded_tokens == len(res.node.ids)
    trajs = store.trajectories()
    assert [t.messages[-1]["content"] for t in trajs] == ["Rome.", "Madrid."]
    branch = trajs[1]
    assert branch.prompt_ids + branch.response_ids == check_incremental(
        tok, [*edited, say("Madrid.")]
    )
    assert sampled_runs(branch) == [
        sampled_ids(tok, say("Paris.")),
        sampled_ids(tok, say("Madrid.")),
    ]
    # an edited first answer: nothing matches, the whole conversation is a new prompt
    res = turn(store, [*q, say("Lyon."), user("Sure?")], say("No."))
    assert res.node.parent is None
    assert store.trajectories()[-1].response_mask == [1] * len(sampled_ids(tok, say("No.")))


def test_consecutive_assistant_messages_after_a_sample(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    turn(store, [USR], say("One."))
    msgs = [USR, say("One."), say("An extra note from the client."), user("ok")]
    turn(store, msgs, say("Two."))
    traj = store.trajectories()[-1]
    assert traj.prompt_ids + traj.response_ids + tok.encode("\n") == full_ids(
        tok, [*msgs, say("Two.")]
    )


def test_length_cut_sample_gets_an_end_token_before_the_continuation(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    turn(store, [SYS, USR], say("Sesquipedalian"), cut=True)
    res = turn(store, [SYS, USR, say("Sesquipedalian"), user("Shorter please.")], say("Cat."))
    assert res.node.ids[0] == IM_END
    [traj] = store.trajectories()
    cut_len = len(sampled_ids(tok, say("Sesquipedalian"))) - 1
    assert traj.response_ids[cut_len] == IM_END and traj.response_mask[cut_len] == 0
    assert traj.response_mask[:cut_len] == [1] * cut_len
    assert traj.prompt_ids + traj.response_ids == check_incremental(
        tok, [SYS, USR, say("Sesquipedalian"), user("Shorter please."), say("Cat.")])
    assert traj.response_logprobs is not None and traj.response_logprobs[cut_len] == 0.0


def test_missing_logprobs_on_one_turn_make_the_trajectory_logprobs_none(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    turn(store, [USR], say("A."), logprob=None)
    turn(store, [USR, say("A."), user("more")], say("B."))
    turn(store, [USR], say("C."))
    without, with_lps = store.trajectories()
    assert without.response_logprobs is None
    assert with_lps.response_logprobs == [-0.5] * len(with_lps.response_ids)


def test_remaining_budget(tok: FakeTokenizer) -> None:
    prompt = tok.apply_chat_template([USR], add_generation_prompt=True)
    store = SessionStore(tok, max_length=len(prompt) + 5)
    res = turn(store, [USR], say("A rather long answer."))
    assert res.remaining == 5
    nxt = store.prepare([USR, say("A rather long answer."), user("more")])
    assert nxt.remaining == len(prompt) + 5 - len(nxt.prompt_ids) < 0


def test_tools_are_part_of_the_root_key(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=10_000)
    plain, with_tools = store.prepare([USR]), store.prepare([USR], TOOLS)
    assert plain.node is not with_tools.node
    assert (
        store.prepare([USR], json.loads(json.dumps(TOOLS, sort_keys=True))).node is with_tools.node
    )


def test_requests_the_store_refuses(tok: FakeTokenizer) -> None:
    store = SessionStore(tok, max_length=100)
    with pytest.raises(StoreError, match="last message is an assistant"):
        store.prepare([USR, say("partial")])
    with pytest.raises(StoreError, match="empty"):
        store.prepare([])
    assert issubclass(StoreError, ValueError)


def test_template_mismatch_falls_back_to_a_full_render(
    tok: FakeTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SessionStore(tok, max_length=10_000)
    turn(store, [USR], say("A."))

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise TemplateMismatchError("not prefix-stable")

    monkeypatch.setattr(store_module, "encode_new_turns", broken)
    msgs = [USR, say("A."), user("more")]
    res = store.prepare(msgs)
    assert res.node.parent is None and res.prompt_ids == tok.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    assert store.stats()["num_fallbacks"] == 1
