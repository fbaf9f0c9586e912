"""Images in gateway requests (issue 30 item 6): data-URL parts through the tiny Qwen2-VL processor.

A chat request's image reaches the engine with the processor's exact ids, the next turn that sends
the same image again continues the trie node (nothing re-encoded), the trajectory carries the
images, and hostile image parts get a 400 naming the part with nothing recorded.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from gateway_helpers import FakePolicy, LiveGateway, client_for
from omegaconf import OmegaConf
from PIL import Image

from agentloop.batch.multimodal import image_inputs
from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.gateway.actor import GatewayActor
from agentloop.gateway.framework import register_agent_runner
from agentloop.gateway.images import ImageEncoder, ImagePartError, data_url
from agentloop.gateway.protocol import GatewayHTTPError, parse_chat_request
from agentloop.gateway.store import SessionStore
from agentloop.loops.base import resolve_registry
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_vl_model import (
    build_vl_tokenizer,
    load_vl_processor,
    write_processor_files,
)


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Any:
    """The tiny Qwen2-VL processor (tokenizer, template and image processor; no weights needed)."""
    path = tmp_path_factory.mktemp("tiny-vl-processor")
    write_processor_files(build_vl_tokenizer(), path)
    return load_vl_processor(path)


def png(
    colour: str | int, size: tuple[int, int] = (56, 56), fmt: str = "PNG", mode: str = "RGB"
) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format=fmt)
    return buf.getvalue()


def image_part(raw: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": data_url(media_type, base64.b64encode(raw).decode())},
    }


def ask(raw: bytes, text: str = "What colour is it?") -> dict[str, Any]:
    return {"role": "user", "content": [image_part(raw), {"type": "text", "text": text}]}


def say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def rendered(processor: Any, messages: list[dict[str, Any]], images: list[bytes]) -> list[int]:
    """What the processor makes of the whole conversation (the ids the engine must see)."""
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    pil = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in images]
    return processor(text=[text], images=pil or None, return_tensors="pt")["input_ids"][0].tolist()


def sampled(processor: Any, text: str) -> list[int]:
    tok = processor.tokenizer
    return list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]


def vl_store(processor: Any, **kwargs: Any) -> SessionStore:
    return SessionStore(
        processor.tokenizer, max_length=4096, images=ImageEncoder(processor, **kwargs)
    )


# ---- the store: exact ids, reuse, trajectories
# ----------------------------------------------------------
def test_an_image_request_has_the_processors_ids_and_sends_the_image(processor):
    store = vl_store(processor)
    red = png("red")
    messages = [{"role": "system", "content": "Be brief."}, ask(red)]
    res = store.prepare(messages)
    assert res.prompt_ids == rendered(processor, messages, [red])
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert res.prompt_ids.count(pad) == 4  # a 56x56 image: a 2x2 grid of merged patches
    assert res.images == [red]


def test_the_same_image_sent_again_continues_the_node_and_a_new_one_is_expanded(processor):
    store = vl_store(processor)
    red, blue = png("red"), png("blue", (112, 56))
    first = [ask(red)]
    res = store.prepare(first)
    store.commit(res, sampled(processor, "Red."), None, say("Red."), "stop")
    encoded = store.stats()["num_encoded_tokens"]
    second = [*first, say("Red."), ask(blue, "And this one?")]
    res2 = store.prepare(second)
    assert res2.prompt_ids[:len(res.prompt_ids)] == res.prompt_ids  # the first node, not re-encoded
    assert res2.num_encoded_tokens == len(res2.prompt_ids) - len(res.prompt_ids) - len(
        sampled(processor, "Red.")
    )
    assert store.stats()["num_encoded_tokens"] == encoded + res2.num_encoded_tokens
    assert res2.prompt_ids == rendered(processor, second, [red, blue])
    assert res2.images == [red, blue]
    store.commit(res2, sampled(processor, "Blue."), None, say("Blue."), "stop")
    [traj] = store.trajectories()
    assert traj.multi_modal_data == {"image": [red, blue]}
    assert traj.prompt_ids + traj.response_ids == res2.prompt_ids + sampled(processor, "Blue.")


def test_a_text_only_conversation_has_no_images(processor):
    store = vl_store(processor)
    res = store.prepare([{"role": "user", "content": "Hi"}])
    store.commit(res, sampled(processor, "Hello."), None, say("Hello."), "stop")
    assert res.images == [] and store.trajectories()[0].multi_modal_data is None


# ---- hostile input
# ---------------------------------------------------------------------------------------
def _refused(store: SessionStore, messages: list[dict[str, Any]]) -> ImagePartError:
    with pytest.raises(ImagePartError) as info:
        store.prepare(messages)
    assert store.stats()["num_nodes"] == 0 or store.stats()["num_pending"] == 0
    return info.value


def _with_url(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize(("url", "says"), [
    ("https://example.com/cat.png", "does not fetch image URLs"),
    ("file:///etc/passwd", "does not fetch image URLs"),
    ("data:image/png;base64,not base64!", "not valid base64"),
    ("data:image/png,iVBORw0KGgo=", "must be base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "media type must be image/*"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "not an image"),
    ("data:image/png;base64," + base64.b64encode(png("red")[:60]).decode(), "could not be decoded"),
    ("cat.png", "not a data URL"),
])
def test_bad_images_are_refused_naming_the_part_and_nothing_is_recorded(processor, url, says):
    store = vl_store(processor)
    error = _refused(store, _with_url(url))
    assert error.param == "messages.0.content.1" and says in str(error)
    assert str(error).startswith("messages[0].content[1]: ")
    assert store.stats()["num_nodes"] == 0


def test_an_image_over_the_limit_is_refused(processor):
    store = vl_store(processor, max_image_bytes=1000)
    big = png("red", (400, 400), "BMP")
    error = _refused(store, [ask(big)])
    assert error.param == "messages.0.content.0" and "rollout.gateway.max_image_bytes" in str(error)
    assert store.stats()["num_nodes"] == 0


def test_a_huge_image_is_refused_before_its_pixels_are_read(processor):
    store = vl_store(processor)
    raw = png(1, (9000, 9000), mode="1")  # 10 kB of PNG, 81 megapixels decoded
    error = _refused(store, [ask(raw)])
    assert "pixels, over the limit" in str(error)


def test_a_text_only_model_refuses_images(processor):
    store = SessionStore(
        processor.tokenizer, max_length=4096, images=ImageEncoder(None, model_name="tiny")
    )
    error = _refused(store, [{"role": "user", "content": "hi"}, say("Hello."), ask(png("red"))])
    assert (
        error.param == "messages.2.content.0"
        and "the served model 'tiny' takes no images" in str(error)
    )
    # no encoder given: a text-only store
    default = SessionStore(processor.tokenizer, max_length=4096)
    assert "takes no images" in str(_refused(default, [ask(png("red"))]))


def test_the_placeholder_token_in_text_is_refused(processor):
    store = vl_store(processor)
    error = _refused(store, [{"role": "user", "content": "look: <|image_pad|>"}])
    assert "placeholder" in str(error) and error.param == "messages"


def test_a_later_bad_image_names_its_own_message_and_keeps_the_branch(processor):
    store = vl_store(processor)
    first = [ask(png("red"))]
    res = store.prepare(first)
    store.commit(res, sampled(processor, "Red."), None, say("Red."), "stop")
    before = store.stats()
    error = _refused(store, [*first, say("Red."), *_with_url("data:image/png;base64,AAAA")])
    assert error.param == "messages.2.content.1"
    assert store.stats() == before


# ---- the chat dialect's parse
# ----------------------------------------------------------------------------
def test_chat_parse_keeps_image_parts_in_order_and_text_only_content_as_a_string():
    raw = png("red")
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what"},
                    {
                        "type": "image_url",
                        "image_url": {"url": image_part(raw)["image_url"]["url"], "detail": "high"},
                    },
                ],
            },
        ]
    }
    request = parse_chat_request(body)
    assert request.messages[0]["content"] == "ab"
    assert request.messages[1]["content"] == [{"type": "text", "text": "what"}, image_part(raw)]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        (
            {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
            "does not fetch image URLs",
        ),
        ({"type": "image_url", "image_url": {}}, "must be {'type': 'image_url'"),
        ({"type": "image_url", "image_url": {"url": "data:audio/wav;base64,AAAA"}}, "image/*"),
        (
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            "content parts must be",
        ),
    ],
)
def test_chat_parse_refuses_bad_image_parts_naming_the_part(part, says):
    body = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [
        {"type": "text", "text": "look"}, part]}]}
    with pytest.raises(GatewayHTTPError) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and says in info.value.message
    assert info.value.param in ("messages.1.content.1", "messages.1.content")


# ---- over HTTP: the openai SDK, the Messages and Responses dialects, a text-only model
# --------------------
@pytest.fixture(scope="module")
def live(processor):
    gateway = LiveGateway(processor.tokenizer, processor=processor)
    yield gateway
    gateway.close()


def _url(raw: bytes) -> str:
    return image_part(raw)["image_url"]["url"]


def test_an_sdk_image_conversation_is_exact_on_the_engine_and_in_the_trajectory(live, processor):
    handle = live.session()
    client = client_for(handle)
    red, blue = png("red"), png("blue", (112, 56))
    messages: list[dict[str, Any]] = [ask(red)]
    calls = len(live.server.calls)
    reply = client.chat.completions.create(model="m", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), ask(blue, "And this one?")]
    client.chat.completions.create(model="m", messages=messages)
    first, second = live.server.calls[calls:]
    assert first["prompt_ids"] == rendered(processor, messages[:1], [red]) and first[
        "image_data"
    ] == [red]
    assert second["prompt_ids"] == rendered(processor, messages, [red, blue])
    assert second["image_data"] == [red, blue]
    result = live.finalize(handle.session_id)
    [traj] = result["trajectories"]
    assert traj.multi_modal_data == {"image": [red, blue]}
    assert result["stats"]["num_context_nodes"] == 2  # the second request continued the first node


def _post(live: LiveGateway, handle: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{handle.base_url}{route}", json=body, headers={"x-api-key": handle.api_key}, timeout=30
    )


def test_messages_and_responses_images_reach_the_engine_like_chat(live, processor):
    red = png("red")
    b64 = base64.b64encode(red).decode()
    chat = rendered(processor, [ask(red)], [red])
    bodies = {
        "/messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": "What colour is it?"}]}]},
        "/responses": {"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": _url(red)},
            {"type": "input_text", "text": "What colour is it?"}]}]},
    }
    for route, body in bodies.items():
        handle = live.session()
        answer = _post(live, handle, route, body)
        assert answer.status_code == 200, answer.text
        call = live.server.calls[-1]
        assert call["prompt_ids"] == chat and call["image_data"] == [red], route
        assert live.finalize(handle.session_id)["trajectories"][0].multi_modal_data == {
            "image": [red]
        }


def test_a_bad_image_is_a_400_naming_the_part_with_nothing_recorded(live):
    handle = live.session()
    client = client_for(handle)
    calls = len(live.server.calls)
    bad = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(b"junk").decode()
                    },
                },
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=bad)
    error = info.value.body
    assert error["param"] == "messages.0.content.1" and "not an image" in error["message"]
    remote = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}],
        }
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=remote)
    assert info.value.body["param"] == "messages.0.content.0"
    answer = _post(
        live,
        handle,
        "/messages",
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ],
        },
    )
    assert answer.status_code == 400 and answer.json()["type"] == "error", answer.text
    assert len(live.server.calls) == calls
    result = live.finalize(handle.session_id)
    assert result["trajectories"] == [] and result["stats"]["num_nodes"] == 0


def test_a_text_only_model_answers_400_saying_it_takes_no_images(processor):
    gateway = LiveGateway(processor.tokenizer)  # no processor: a text-only model
    try:
        handle = gateway.session()
        with pytest.raises(openai.BadRequestError) as info:
            client_for(handle).chat.completions.create(model="m", messages=[ask(png("red"))])
        assert info.value.body["param"] == "messages.0.content.0"
        assert "takes no images" in info.value.body["message"]
        assert gateway.server.calls == []
    finally:
        gateway.close()


# ---- rows: what the trainer gets
# ---------------------------------------------------------------------------
RED, BLUE = png("red"), png("blue", (112, 56))


async def sdk_two_images(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> float:
    """An agent that shows the model a red square, then (continuing) a blue rectangle."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = [ask(RED)]
    reply = await client.chat.completions.create(model="m", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), ask(BLUE, "And this one?")]
    await client.chat.completions.create(model="m", messages=messages)
    return 1.0


@pytest.fixture
def image_runner():
    from agentloop.loops.base import _agent_loop_registry

    register_agent_runner("sdk_two_images")(sdk_two_images)
    yield "sdk_two_images"
    _agent_loop_registry.pop("sdk_two_images", None)


def test_gateway_rows_carry_multi_modal_inputs_and_mrope_positions(processor, image_runner):
    tok = processor.tokenizer
    cfg = default_config()
    OmegaConf.update(cfg, "data.max_prompt_length", 256)
    OmegaConf.update(cfg, "data.max_response_length", 256)
    OmegaConf.resolve(cfg)
    r, model = cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "tiny"})
    r.calculate_log_probs, r.multi_turn.format = True, "hermes"
    server = ScriptedServer(FakePolicy(tok), eos_token_id=tok.eos_token_id)
    prompts = np.empty(1, dtype=object)
    prompts[0] = [{"role": "user", "content": "look"}]
    rows = DataProto(batch=None, meta_info={}, non_tensor_batch={
        "raw_prompt": prompts, "agent_name": np.array([image_runner], dtype=object),
        "uid": np.array(["u0"], dtype=object), "index": np.arange(1)})

    async def go() -> DataProto:
        gw = GatewayActor.from_slices(r, model, [server], tokenizer=tok, processor=processor)
        await gw.start()
        try:
            worker = AgentLoopWorker.from_slices(
                r, model, [server], registry=resolve_registry(), tokenizer=tok, processor=processor,
                gateways=[gw],
            )
            return await worker.generate_sequences(rows)
        finally:
            await gw.shutdown()

    out = asyncio.run(go())
    assert out.non_tensor_batch["status"].tolist() == ["stop"], out.non_tensor_batch.get("error")
    mm = out.non_tensor_batch["multi_modal_inputs"][0]
    want = image_inputs(
        processor, [Image.open(io.BytesIO(raw)).convert("RGB") for raw in (RED, BLUE)]
    )
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert torch.equal(mm["pixel_values"], want["pixel_values"])
    images = out.non_tensor_batch["multi_modal_data"][0]["image"]
    assert [np.asarray(i)[0, 0].tolist() for i in images] == [[255, 0, 0], [0, 0, 255]]
    ids, mask = out.batch["input_ids"][0], out.batch["attention_mask"][0].bool()
    second = server.calls[-1]
    # the engine's ids, exactly
    assert ids[mask].tolist() == second["prompt_ids"] + sampled(processor, "OK.")
    prompt_len = out.batch["prompts"].shape[1]
    assert ids[:prompt_len][mask[:prompt_len]].tolist() == rendered(processor, [ask(RED)], [RED])
    assert out.batch["position_ids"].shape == (1, 4, ids.shape[0])


def test_a_streamed_image_request_sends_the_image_and_count_tokens_counts_its_pads(live, processor):
    red = png("red")
    handle = live.session()
    chunks = list(
        client_for(handle).chat.completions.create(model="m", messages=[ask(red)], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "OK."
    call = live.server.calls[-1]
    assert call["prompt_ids"] == rendered(processor, [ask(red)], [red]) and call["image_data"] == [
        red
    ]
    counted = _post(
        live,
        handle,
        "/messages/count_tokens",
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64", "media_type": "image/png",
                                "data": base64.b64encode(red).decode(),
                            },
                        },
                        {"type": "text", "text": "What colour is it?"},
                    ],
                }
            ],
        },
    )
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"input_tokens": len(call["prompt_ids"])}
