"""The gateway over real HTTP on loopback, driven by the real ``openai`` SDK (fake engine, real
tokenizer)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from gateway_helpers import (
    CALC_TOOL,
    WORDS,
    LiveGateway,
    client_for,
    full_render_ids,
    run_calculator_agent,
)

from agentloop.testing import ScriptedServer
from agentloop.types import TokenOutput


@pytest.fixture
def gateway(tokenizer):
    gw = LiveGateway(tokenizer)
    yield gw
    gw.close()


def test_multi_turn_tool_calling_records_a_token_exact_trajectory(gateway, tokenizer):
    handle = gateway.session()
    messages = run_calculator_agent(client_for(handle), "What is 2+3?")
    assert messages[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert messages[-1]["content"] == "The answer is 5."
    result = gateway.finalize(handle.session_id)
    [traj] = result["trajectories"]
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    expected = full_render_ids(tokenizer, messages, [CALC_TOOL])
    sep = tokenizer.encode("\n", add_special_tokens=False)
    assert ids + sep == expected  # the full render adds the separator after the final <|im_end|>
    sampled = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 1]
    assert tokenizer.decode(sampled).count("<|im_end|>") == 2  # both assistant turns, as sampled
    assert "<tool_response>" not in tokenizer.decode(sampled)
    assert traj.response_logprobs is not None and len(traj.response_logprobs) == len(
        traj.response_ids
    )


def test_streaming_gives_the_same_messages_and_trajectory(tokenizer):
    trajectories, conversations = [], []
    for stream in (False, True):
        gw = LiveGateway(tokenizer)
        try:
            handle = gw.session()
            conversations.append(
                run_calculator_agent(client_for(handle), "What is 6*7?", stream=stream)
            )
            trajectories.append(gw.finalize(handle.session_id)["trajectories"])
        finally:
            gw.close()
    plain, streamed = trajectories
    assert len(plain) == len(streamed) == 1
    assert plain[0].prompt_ids == streamed[0].prompt_ids
    assert plain[0].response_ids == streamed[0].response_ids
    assert plain[0].response_mask == streamed[0].response_mask
    def shape(conv: list[dict]) -> list[tuple]:
        return [
            (
                m["role"],
                m.get("content") or None,
                [
                    (c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in m.get("tool_calls", [])
                ],
            )
            for m in conv
        ]

    assert shape(conversations[0]) == shape(conversations[1])


def test_stream_events_have_role_content_finish_usage_and_done(gateway):
    handle = gateway.session()
    body = {"model": "m", "messages": [{"role": "user", "content": "say a word"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{handle.base_url}/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {handle.api_key}"}, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text in WORDS
    finishes = [
        e["choices"][0]["finish_reason"]
        for e in events
        if e["choices"] and e["choices"][0]["finish_reason"]
    ]
    assert finishes == ["stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_best_of_n_then_continue_the_winner_gives_three_trajectories(gateway, tokenizer):
    handle = gateway.session()
    client = client_for(handle)
    base = [
        {"role": "system", "content": "You are helpful. Reply in 1 short sentence."},
        {"role": "user", "content": "Pick any random English word and reply with just that word."},
    ]
    words = [
        client.chat.completions.create(model="m", messages=base).choices[0].message.content
        for _ in range(3)
    ]
    assert words == list(WORDS[:3])
    follow = [
        *base, {"role": "assistant", "content": words[1]},
        {"role": "user", "content": "Now pick another word."},
    ]
    resp = client.chat.completions.create(model="m", messages=follow)
    assert resp.choices[0].message.content == WORDS[3]
    trajs = gateway.finalize(handle.session_id)["trajectories"]
    assert len(trajs) == 3
    texts = [tokenizer.decode(list(t.response_ids)) for t in trajs]
    continued = [t for t, text in zip(trajs, texts, strict=True) if WORDS[3] in text]
    assert len(continued) == 1 and WORDS[1] in tokenizer.decode(list(continued[0].response_ids))
    assert sum(continued[0].response_mask) > sum(trajs[0].response_mask)
    # the continuation prompt was only the new suffix, not a re-encoding of the whole conversation
    assert gateway.policy.prompts[3][: len(gateway.policy.prompts[1])] == gateway.policy.prompts[1]


def test_two_sub_conversations_in_one_session_stay_separate(gateway, tokenizer):
    handle = gateway.session()
    client = client_for(handle)
    a = run_calculator_agent(client, "What is 1+1?")
    b = run_calculator_agent(client, "What is 10*10?")
    trajs = gateway.finalize(handle.session_id)["trajectories"]
    assert len(trajs) == 2
    for traj, conv in zip(trajs, (a, b), strict=True):
        ids = list(traj.prompt_ids) + list(traj.response_ids)
        assert ids + tokenizer.encode("\n", add_special_tokens=False) == full_render_ids(
            tokenizer, conv, [CALC_TOOL]
        )


class BarrierServer(ScriptedServer):
    """Replies only once ``n`` requests are in flight together: serialized requests would time
    out."""

    def __init__(self, policy, n: int, eos: int) -> None:
        super().__init__(policy, eos_token_id=eos)
        self.n, self.arrived = n, 0
        self.event: asyncio.Event | None = None

    async def generate(
        self, prompt_ids, sampling_params, request_id, image_data=None
    ) -> TokenOutput:
        self.event = self.event or asyncio.Event()
        self.arrived += 1
        if self.arrived >= self.n:
            self.event.set()
        await asyncio.wait_for(self.event.wait(), 5)
        return await super().generate(prompt_ids, sampling_params, request_id, image_data)


def test_parallel_requests_in_one_session_run_concurrently(tokenizer):
    from gateway_helpers import FakePolicy

    policy = FakePolicy(tokenizer)
    gw = LiveGateway(tokenizer, BarrierServer(policy, 2, tokenizer.eos_token_id), policy=policy)
    try:
        handle = gw.session()

        async def two() -> list[str]:
            client = openai.AsyncOpenAI(
                base_url=handle.base_url, api_key=handle.api_key, max_retries=0
            )
            msgs = [{"role": "user", "content": "give me a word"}]
            outs = await asyncio.gather(
                *(client.chat.completions.create(model="m", messages=msgs) for _ in range(2))
            )
            return [o.choices[0].message.content for o in outs]

        words = asyncio.run(two())
        assert sorted(words) == sorted(WORDS[:2])
        # siblings, neither overwritten
        assert len(gw.finalize(handle.session_id)["trajectories"]) == 2
    finally:
        gw.close()


def test_budget_spent_answers_length_without_calling_the_engine(tokenizer):
    gw = LiveGateway(tokenizer)
    try:
        handle = gw.session()
        client = client_for(handle)
        long_text = "word " * 900  # over prompt_length + response_length = 768 tokens
        resp = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": long_text}]
        )
        assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content == ""
        assert gw.server.calls == []
        resp = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a word"}], max_tokens=2
        )
        assert resp.choices[0].finish_reason == "length"
        assert gw.server.calls[-1]["sampling_params"]["max_tokens"] == 2
    finally:
        gw.close()


def test_logprobs_are_returned_when_asked_and_never_fabricated(tokenizer):
    def no_logprobs(prompt_ids, params, request_id):
        return TokenOutput(
            token_ids=tokenizer.encode("OK.", add_special_tokens=False) + [tokenizer.eos_token_id],
            log_probs=None,
        )

    gw = LiveGateway(tokenizer, policy=no_logprobs)
    try:
        handle = gw.session()
        resp = client_for(handle).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True
        )
        assert resp.choices[0].logprobs is None
        [traj] = gw.finalize(handle.session_id)["trajectories"]
        assert traj.response_logprobs is None
    finally:
        gw.close()


# ---- error statuses
# -----------------------------------------------------------------------------------------

def _post(
    handle, body=None, *, raw: bytes | None = None, key: str | None = "ok", path="chat/completions"
):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {handle.api_key if key == 'ok' else key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{handle.base_url}/{path}", content=content, headers=headers, timeout=30)


HELLO = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize(
    ("body", "raw", "param"),
    [
        (None, b"{not json", None),
        ({"model": "m", "messages": "hello"}, None, "messages"),
        ({"model": "m", "messages": []}, None, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, None, "messages.0.role"),
        ({**HELLO, "n": 2}, None, "n"),
        ({**HELLO, "response_format": {"type": "grammar"}}, None, "response_format"),
        ({**HELLO, "tool_choice": "any"}, None, "tool_choice"),
        # required needs tools (gateway/constraints.py)
        ({**HELLO, "tool_choice": "required"}, None, "tools"),
        ({**HELLO, "temperature": "hot"}, None, "temperature"),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ],
            },
            None,
            "messages",
        ),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body(gateway, body, raw, param):
    handle = gateway.session()
    r = _post(handle, body, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param
    assert gateway.server.calls == []


def test_auth_unknown_session_conflict_and_size_limit(gateway):
    handle = gateway.session()
    assert _post(handle, HELLO, key=None).status_code == 401
    assert _post(handle, HELLO, key="sk-wrong").status_code == 401
    other = gateway.session()
    assert _post(handle, HELLO, key=other.api_key).status_code == 401  # another session's key
    r = httpx.post(
        handle.base_url.replace(handle.session_id, "nope") + "/chat/completions", json=HELLO,
        headers={"Authorization": f"Bearer {handle.api_key}"},
    )
    assert r.status_code == 404
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 70000}]}
    assert _post(handle, big).status_code == 413
    models = httpx.get(
        f"{handle.base_url}/models", headers={"Authorization": f"Bearer {handle.api_key}"}
    )
    assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"
    done = _post(handle, {"reward_info": {"score": 1.0}}, path="../complete")
    assert done.status_code == 200 and done.json()["state"] == "completed"
    assert _post(handle, HELLO).status_code == 409
    gateway.run(gateway.actor.abort(other.session_id))
    assert _post(other, HELLO).status_code == 409
    assert gateway.finalize(handle.session_id)["reward_info"] == {"score": 1.0}


def test_engine_failure_is_502_and_nothing_is_committed(tokenizer):
    gw = LiveGateway(
        tokenizer,
        ScriptedServer([RuntimeError("GPU fell off")], eos_token_id=tokenizer.eos_token_id),
    )
    try:
        handle = gw.session()
        r = _post(handle, HELLO)
        assert r.status_code == 502 and "GPU fell off" in r.json()["error"]["message"]
        result = gw.finalize(handle.session_id)
        assert result["trajectories"] == []
        # the context reserved for the failed request is gone
        assert result["stats"]["num_nodes"] == 0
    finally:
        gw.close()
