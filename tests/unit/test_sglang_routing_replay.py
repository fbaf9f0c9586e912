"""Routing replay (R3) on the SGLang backend, against a fake ``sglang.Engine`` that speaks SGLang
0.5's routed-experts API: ``enable_return_routed_experts`` in the server arguments,
``return_routed_experts`` / ``routed_experts_start_len`` per request, and the rows back in
``meta_info["routed_experts"]`` as base64 of int32 ids (positions ``start .. seqlen - 1``)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.routed_experts import PROMPT_START_KEY
from agentloop.servers.sglang import SGLangEngineAPI, SGLangServer, server_args
from agentloop.testing.scripted import fake_routed_experts
from tests.unit.test_sglang_server import IO, FakeEngine, PassThrough, rollout, run

SHAPE = (3, 2)  # layers, top_k


class RoutingEngine(FakeEngine):
    """FakeEngine that also returns routed experts the way SGLang does when asked."""

    async def async_generate(self, **kw: Any) -> Any:
        want = kw.pop("return_routed_experts", False)
        start = kw.pop("routed_experts_start_len", 0)
        self.routing_asks = getattr(self, "routing_asks", []) + [(want, start)]
        result = await super().async_generate(**kw)
        if not want:
            return result
        prompt = list(kw["input_ids"])
        if kw.get("stream"):
            return self._tagged(result, prompt, start)
        return self._tag(result, prompt, prompt + result["output_ids"], start)

    @staticmethod
    def _tag(chunk: dict[str, Any], prompt: list[int], ids: list[int], start: int) -> Any:
        # SGLang: rows for positions start .. seqlen - 1 (the last sampled token never ran)
        rows = fake_routed_experts(ids[:-1], start, SHAPE).astype(np.int32)
        chunk["meta_info"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
        return chunk

    async def _tagged(self, chunks: Any, prompt: list[int], start: int) -> Any:
        ids = list(prompt)
        async for chunk in chunks:
            if self.server_args.incremental_streaming_output:
                ids = ids + list(chunk["output_ids"])
            else:  # cumulative chunks
                ids = prompt + list(chunk["output_ids"])
            if chunk["meta_info"].get("finish_reason"):
                chunk = self._tag(chunk, prompt, ids, start)
            yield chunk


def moe_model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": SHAPE[0], "num_experts": 8, "num_experts_per_tok": SHAPE[1]}
    ))
    return str(tmp_path)


async def started(engine: FakeEngine, model: str, replay: bool = True) -> SGLangServer:
    cfg = rollout(enable_rollout_routing_replay=replay, name="sglang")
    server = SGLangServer.from_slices(cfg, OmegaConf.create({"path": model}))
    await server.start(SGLangEngineAPI(engine, IO, PassThrough))
    return server


def test_server_args_ask_sglang_to_capture_routed_experts(tmp_path: Path) -> None:
    server = SGLangServer.from_slices(
        rollout(enable_rollout_routing_replay=True, name="sglang"),
        OmegaConf.create({"path": moe_model(tmp_path)}),
    )
    args = server_args(server.engine_cfg, server.server_cfg, server.model_cfg)
    assert args["enable_return_routed_experts"] is True
    assert server.routed_shape == SHAPE
    off = SGLangServer.from_slices(rollout(), OmegaConf.create({"path": "/m"}))
    assert "enable_return_routed_experts" not in server_args(
        off.engine_cfg, off.server_cfg, off.model_cfg
    )


def test_generate_returns_the_engine_rows_from_the_known_prefix_on(tmp_path: Path) -> None:
    async def go() -> None:
        engine = RoutingEngine(reply_len=4)
        server = await started(engine, moe_model(tmp_path))
        out = await server.generate([5, 6, 7], {"max_tokens": 8}, "r1")
        ids = [5, 6, 7, *out.token_ids]
        assert out.routed_experts_start == 0
        np.testing.assert_array_equal(out.routed_experts, fake_routed_experts(ids[:-1], 0, SHAPE))
        # a later turn: routing known up to position 5, asked from there on
        later = await server.generate(ids + [40], {"max_tokens": 8, PROMPT_START_KEY: 5}, "r2")
        assert engine.routing_asks == [(True, 0), (True, 5)]
        assert later.routed_experts_start == 5
        whole = ids + [40, *later.token_ids]
        np.testing.assert_array_equal(
            later.routed_experts, fake_routed_experts(whole[:-1], 5, SHAPE)
        )
        # the routing key never reaches SGLang's sampling params
        assert PROMPT_START_KEY not in engine.requests[-1]["sampling_params"]

    run(go())


@pytest.mark.parametrize("incremental", [False, True])
def test_a_stream_carries_the_routing_on_its_last_chunk(tmp_path: Path, incremental: bool) -> None:
    async def go() -> None:
        engine = RoutingEngine(reply_len=3, incremental=incremental)
        server = await started(engine, moe_model(tmp_path))
        chunks = [d async for d in server.generate_stream([9, 10], {"max_tokens": 8}, "s")]
        ids = [9, 10, *[t for c in chunks for t in c.token_ids]]
        assert all(c.routed_experts is None for c in chunks[:-1])
        np.testing.assert_array_equal(
            chunks[-1].routed_experts, fake_routed_experts(ids[:-1], 0, SHAPE)
        )

    run(go())


def test_routing_replay_off_asks_nothing() -> None:
    async def go() -> None:
        engine = RoutingEngine(reply_len=2)
        server = await started(engine, "/m", replay=False)
        out = await server.generate([1, 2], {"max_tokens": 4}, "x")
        assert out.routed_experts is None and engine.routing_asks == [(False, 0)]

    run(go())
