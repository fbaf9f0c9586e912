"""The SGLang backend on a real engine. Skipped unless CUDA and SGLang are present.

Run on a GPU machine:
``make install EXTRA=sglang && .venv/bin/python -m pytest tests/gpu/test_sglang_gpu.py -q``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def manager():
    pytest.importorskip("sglang")
    import ray
    from omegaconf import OmegaConf

    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    ray.init(include_dashboard=False)
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "actor_rollout_ref.rollout.name": "sglang", "data.max_prompt_length": 128,
        "data.max_response_length": 32, "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.3,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.device": "cuda",
        "actor_rollout_ref.rollout.server.num_servers": 1,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    try:
        yield m
    finally:
        m.shutdown()
        ray.shutdown()


def test_rollout_on_sglang(manager):
    from agentloop.batch.data import rows_to_batch

    rows = [{"prompt": [{"role": "user", "content": f"item {i}"}]} for i in range(16)]
    out = manager.generate_sequences(rows_to_batch(rows))
    assert len(out) == 16
    assert torch.isfinite(out.batch["rollout_log_probs"][out.batch["response_mask"].bool()]).all()
    assert (out.batch["response_mask"].sum(-1) > 0).all()
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}


def test_weight_update_sleep_and_abort_on_sglang(manager):
    import ray
    from transformers import AutoModelForCausalLM

    from agentloop.batch.data import rows_to_batch
    from agentloop.testing.tiny_model import ensure_tiny_model

    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()))
    manager.update_weights(model.state_dict())
    manager.sleep()
    manager.wake_up()
    server = manager.server_handles[0]
    out = manager.generate_sequences(
        rows_to_batch([{"prompt": [{"role": "user", "content": "again"}]}] * 4)
    )
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    assert ray.get(server.check_health.remote())["global_steps"] >= 1
