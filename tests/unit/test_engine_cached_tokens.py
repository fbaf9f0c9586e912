"""The engines' own prefix-cache hits in every output (``extra_fields["num_cached_tokens"]``):
vLLM's ``RequestOutput.num_cached_tokens`` and SGLang's ``meta_info["cached_tokens"]``, absent when
the engine does not say; and scripts/bench_longtail.py's hit-rate arithmetic over output rows."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.report.timing import collect_generate_calls, record_generate
from agentloop.servers.sglang_io import to_token_output as sglang_output
from agentloop.servers.vllm import VLLMServer
from agentloop.servers.vllm_io import CACHED_TOKENS_KEY, to_token_output, with_cached_tokens
from agentloop.types import StopReason, TokenOutput

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def request_output(ids: list[int], finished: bool = True, **over: Any) -> Any:
    """A vLLM ``RequestOutput`` as the server reads it (``num_cached_tokens`` only if given)."""
    completion = SimpleNamespace(
        token_ids=list(ids), logprobs=None, finish_reason="length" if finished else None
    )
    return SimpleNamespace(outputs=[completion], finished=finished, num_preemptions=0, **over)


def test_vllm_output_carries_the_cached_prompt_tokens():
    extra = {"server_index": 1, "global_steps": 3}
    out = to_token_output(request_output([5, 6], num_cached_tokens=128), False, extra)
    assert out.extra_fields == {**extra, CACHED_TOKENS_KEY: 128}
    assert extra == {"server_index": 1, "global_steps": 3}  # the caller's dict is not changed


@pytest.mark.parametrize("over", [{}, {"num_cached_tokens": None}])
def test_no_cached_count_from_vllm_leaves_the_key_out(over: dict[str, Any]):
    out = to_token_output(request_output([5], **over), False, {"server_index": 0})
    assert out.extra_fields == {"server_index": 0}
    assert with_cached_tokens({"a": 1}, SimpleNamespace(num_cached_tokens=0)) == {
        "a": 1, CACHED_TOKENS_KEY: 0,
    }


class CachingEngine:
    """The ``AsyncLLM.generate`` of a vLLM engine that found ``cached`` prompt tokens in its prefix
    cache: one token per output, DELTA or FINAL_ONLY."""

    def __init__(self, cached: int) -> None:
        self.cached = cached
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(), is_multimodal_model=False)
        self.errored = False

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> Any:
        ids = [prompt["prompt_token_ids"][-1] + k + 1 for k in range(params.max_tokens)]
        if params.output_kind.name == "DELTA":
            for k, t in enumerate(ids):
                done = k == len(ids) - 1
                yield request_output([t], done, num_cached_tokens=self.cached)
        else:
            yield request_output(ids, True, num_cached_tokens=self.cached)


def vllm_server(cached: int) -> VLLMServer:
    rollout = OmegaConf.create({"prompt_length": 16, "response_length": 8})
    s = VLLMServer.from_slices(rollout, OmegaConf.create({"path": "unused"}))
    s.engine = CachingEngine(cached)
    return s


def test_vllm_server_generate_and_stream_report_the_cached_tokens():
    async def main() -> None:
        s = vllm_server(cached=32)
        out = await s.generate([1, 2, 3], {"max_tokens": 4}, "r1")
        assert out.token_ids == [4, 5, 6, 7] and out.extra_fields[CACHED_TOKENS_KEY] == 32
        chunks = [d async for d in s.generate_stream([1, 2, 3], {"max_tokens": 3}, "r2")]
        assert [d.finished for d in chunks] == [False, False, True]
        assert all(CACHED_TOKENS_KEY not in d.extra_fields for d in chunks[:-1])
        assert chunks[-1].extra_fields[CACHED_TOKENS_KEY] == 32

    asyncio.run(main())


def test_sglang_output_carries_meta_info_cached_tokens():
    result = {"output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "length"},
                                                  "cached_tokens": 64}}
    assert sglang_output(result, False, {"server_index": 2}).extra_fields == {
        "server_index": 2, CACHED_TOKENS_KEY: 64,
    }
    del result["meta_info"]["cached_tokens"]
    assert sglang_output(result, False, {"server_index": 2}).extra_fields == {"server_index": 2}


def test_report_timing_keeps_each_calls_cached_tokens_where_the_engine_said():
    def output(**extra: Any) -> TokenOutput:
        return TokenOutput(token_ids=[1, 2], stop_reason=StopReason.LENGTH, extra_fields=extra)

    with collect_generate_calls() as calls:
        record_generate(1, 0.0, 300, output(num_cached_tokens=256, server_index=1))
        record_generate(0, 0.0, 20, output(server_index=0))
    assert calls[0]["cached_tokens"] == 256 and calls[0]["prompt_tokens"] == 300
    assert "cached_tokens" not in calls[1]


def bench_longtail() -> ModuleType:
    """scripts/bench_longtail.py as a module (it imports scripts/bench_async.py by path)."""
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_longtail", SCRIPTS / "bench_longtail.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(cached: list[Any], sent: list[int]) -> Any:
    """An output part with the TailLoop's two columns."""
    return SimpleNamespace(
        non_tensor_batch={
            "cached_tokens": np.array(cached, dtype=object),
            "prompt_tokens_sent": np.array(sent, dtype=object),
        }
    )


def test_bench_hit_rate_sums_tokens_over_every_row_and_pass():
    bench = bench_longtail()
    assert bench.cache_tally([rows([0, 128], [150, 300]), rows([256], [550])]) == (384, 1000)
    assert bench.hit_rate([(384, 1000), (116, 0)]) == "50.0% (500/1000)"
    assert bench.cache_tally([rows([0, None], [150, 300])]) is None
    no_count = SimpleNamespace(non_tensor_batch={"prompt_tokens_sent": [1]})
    assert bench.cache_tally([no_count]) is None
    assert bench.hit_rate([(1, 2), None]) == "n/a" and bench.hit_rate([]) == "n/a"
    assert bench.system_ids(3) == [100, 107, 114] and len(set(bench.system_ids(256))) == 256


class Rows:
    """A batch of ``n`` rows with empty ``extra_info``."""

    def __init__(self, n: int) -> None:
        self.non_tensor_batch = {"extra_info": [{} for _ in range(n)]}

    def __len__(self) -> int:
        return len(self.non_tensor_batch["extra_info"])


def test_bench_prefixes_are_shared_by_all_and_by_a_groups_samples_only():
    bench = bench_longtail()
    batches = [Rows(4), Rows(4)]
    bench.add_prefixes(batches, 2, 3, 5)
    ids = [info["system_ids"] for b in batches for info in b.non_tensor_batch["extra_info"]]
    assert all(len(x) == 8 and x[:3] == bench.system_ids(3) for x in ids)
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[4] == ids[5] and ids[6] == ids[7]
    assert len({tuple(x) for x in ids}) == 4  # four groups, four prompts
