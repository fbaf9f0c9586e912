"""The same rollout path on a CUDA vLLM engine. Skipped unless CUDA and the CUDA build of vLLM are
present.

Passed on an H100 (vLLM 0.25.1 CUDA, torch 2.11, 2026-11-26; docs/benchmarks.md, "On a GPU").

Run on a GPU machine: ``make install EXTRA=gpu && .venv/bin/python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_rollout_on_cuda(tmp_path):
    pytest.importorskip("vllm")
    import ray
    from omegaconf import OmegaConf

    from agentloop.batch.data import rows_to_batch
    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    ray.init(include_dashboard=False)
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()), "data.max_prompt_length": 128,
        "data.max_response_length": 32, "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.3,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.device": "cuda",
        "actor_rollout_ref.rollout.server.num_servers": 1,
    }.items():
        OmegaConf.update(cfg, k, v)
    manager = AgentLoopManager(cfg)
    try:
        rows = [{"prompt": [{"role": "user", "content": f"item {i}"}]} for i in range(16)]
        out = manager.generate_sequences(rows_to_batch(rows))
        assert len(out) == 16
        assert torch.isfinite(out.batch["rollout_log_probs"]).all()
        assert (out.batch["response_mask"].sum(-1) > 0).all()
    finally:
        manager.shutdown()
        ray.shutdown()
