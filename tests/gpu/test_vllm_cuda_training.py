"""What a trainer relies on, on a CUDA vLLM engine: multi-turn tool rollouts with the right loss
mask, and a streamed weight update that really changes what the engine samples from.

Skipped unless CUDA and the CUDA build of vLLM are present.  The same checks run on vLLM CPU with
``AGENTLOOP_TEST_DEVICE=cpu`` (how this module was checked on a machine without a GPU); on CUDA the
engine runs in bfloat16, so log-probs are compared with a bound relative to the weight change, not
to 1e-5. Not yet run on a GPU: written after the H100 session's device time was spent (2026-11-26);
on vLLM CPU the engine is 6.9e-6 nats from the new weights' recompute and 20 nats from the old
weights'.

Run on a GPU machine: ``bash scripts/gpu_check.sh`` (or ``python -m pytest tests/gpu -q``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
DEVICE = os.environ.get("AGENTLOOP_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
    ),
]
PROMPT_LEN, RESPONSE_LEN = 256, 96
TOOLS = "examples/calculator_agent/tools.yaml"


@pytest.fixture(scope="module")
def manager():
    pytest.importorskip("vllm")
    import ray
    from omegaconf import OmegaConf

    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=4 if DEVICE == "cpu" else None, include_dashboard=False, logging_level="ERROR"
    )
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "data.max_prompt_length": PROMPT_LEN, "data.max_response_length": RESPONSE_LEN,
        "actor_rollout_ref.rollout.dtype": "bfloat16" if DEVICE == "cuda" else "float32",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.3 if DEVICE == "cuda" else 0.5,
        "actor_rollout_ref.rollout.max_num_seqs": 32,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": DEVICE,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": TOOLS,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    try:
        yield m
    finally:
        m.shutdown()
        ray.shutdown()


def word_problem_batch(n: int):
    from agentloop.batch.data import rows_to_batch
    from agentloop.testing.tiny_model import word_problem_rows

    batch = rows_to_batch(
        word_problem_rows(n, agent_name="tool_agent", data_source="calculator", seed=3)
    )
    batch.meta_info["validate"] = True  # greedy
    return batch


def test_tool_agent_masks_tool_turns(manager):
    """The trained tiny model calls the calculator; tool responses are in the sequence with mask 0,
    sampled tokens with mask 1 and finite log-probs, and mask-0 positions carry log-prob 0."""
    from agentloop.tokenization.loader import load_tokenizer

    out = manager.generate_sequences(word_problem_batch(8))
    calls = np.array(out.non_tensor_batch["num_tool_calls"].tolist())
    assert (calls >= 1).mean() >= 0.75, calls
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    tok = load_tokenizer(manager.config.model)
    b = out.batch
    for i in np.nonzero(calls)[0]:
        resp, mask = b["responses"][i], b["response_mask"][i].bool()
        real = b["attention_mask"][i, PROMPT_LEN:].bool()
        assert "<tool_response>" in tok.decode(resp[real & ~mask].tolist())
        assert "<tool_call>" in tok.decode(resp[mask].tolist())
        assert "<tool_response>" not in tok.decode(resp[mask].tolist())
        lp = b["rollout_log_probs"][i]
        assert torch.isfinite(lp[mask]).all() and (lp[mask] <= 0).all() and (lp[~mask] == 0).all()


def test_streamed_weight_update_changes_logprobs_as_predicted(manager):
    """After a bucketed update (buckets small enough that fused layers straddle them) the engine's
    log-probs follow an HF fp32 recompute of the new weights, far closer than the old weights'
    recompute, and every row carries the new version."""
    from transformers import AutoModelForCausalLM

    from agentloop.batch.data import rows_to_batch
    from agentloop.testing.hf_check import max_logprob_gap, perturbed_weights
    from agentloop.testing.tiny_model import ensure_tiny_model

    old = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32)
    original, new, new_model = perturbed_weights(old)
    rows = [
        {"prompt": [{"role": "user", "content": f"Say something about item {i}."}]}
        for i in range(4)
    ]
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = True  # greedy
    try:
        assert manager.update_weights(iter(new.items()), global_steps=7, bucket_mb=0.02) == 7
        out = manager.generate_sequences(batch)
        to_new, to_old = max_logprob_gap(new_model, out), max_logprob_gap(old, out)
        # bfloat16 engine vs fp32 reference (old weights: ~20 nats)
        bound = 0.5 if DEVICE == "cuda" else 1e-4
        assert to_new <= bound and to_new < 0.1 * to_old, (to_new, to_old)
        nt = out.non_tensor_batch
        assert nt["min_global_steps"].tolist() == nt["max_global_steps"].tolist() == [7] * len(out)
    finally:
        assert manager.update_weights(original) == 8
