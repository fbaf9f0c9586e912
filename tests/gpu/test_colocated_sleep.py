"""Colocated placement on a GPU: the vLLM server shares the trainer worker's GPU (its bundle, its
``CUDA_VISIBLE_DEVICES``) and really releases memory while asleep.  Skipped unless CUDA and the CUDA
build of vLLM are present.

Passed on an H100 (vLLM 0.25.1 CUDA, torch 2.11, 2026-11-26; docs/benchmarks.md, "On a GPU").
Run on a GPU machine: ``make install EXTRA=gpu && .venv/bin/python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_colocated_server_shares_the_trainer_gpu_and_frees_it_when_asleep():
    pytest.importorskip("vllm")
    import ray
    from omegaconf import OmegaConf
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from agentloop.batch.data import rows_to_batch
    from agentloop.cluster.colocated import TrainerWorkers
    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    ray.init(include_dashboard=False)
    try:
        pg = placement_group([{"GPU": 1, "CPU": 1}])
        ray.get(pg.ready(), timeout=120)

        @ray.remote(num_gpus=1, num_cpus=1)
        class TrainerWorker:
            """Holds the bundle's whole GPU, as a trainer rank does."""

            def gpu_ids(self) -> list[str]:
                return [str(g) for g in ray.get_gpu_ids()]

            def used_gib(self) -> float:
                import torch

                # device-wide: counts the engine's memory too
                free, total = torch.cuda.mem_get_info()
                return (total - free) / 2**30

            def total_gib(self) -> float:
                import torch

                return torch.cuda.mem_get_info()[1] / 2**30

        trainer = TrainerWorker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)
        ).remote()
        cfg = default_config()
        for k, v in {
            "actor_rollout_ref.model.path": str(ensure_tiny_model()), "data.max_prompt_length": 128,
            "data.max_response_length": 32, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.3,
            "actor_rollout_ref.rollout.free_cache_engine": True,
            "actor_rollout_ref.rollout.agent.num_workers": 1,
            "actor_rollout_ref.rollout.server.device": "cuda",
        }.items():
            OmegaConf.update(cfg, k, v)
        manager = AgentLoopManager(cfg, TrainerWorkers([trainer], pg, [0]))
        try:
            assert manager.servers.placement == "colocated" and len(manager.server_handles) == 1
            # free_cache_engine: asleep right after start
            assert manager.can_sleep and manager.sleeping
            server = manager.server_handles[0]
            assert ray.get(
                server.__ray_call__.remote(lambda s: os.environ["CUDA_VISIBLE_DEVICES"])
            ) == ",".join(ray.get(trainer.gpu_ids.remote()))
            assert (
                ray.get(
                    server.__ray_call__.remote(
                        lambda s: ray.get_runtime_context().get_placement_group_id()
                    )
                )
                == pg.id.hex()
            )
            total = ray.get(trainer.total_gib.remote())
            asleep = ray.get(trainer.used_gib.remote())
            manager.wake_up()
            assert not manager.sleeping
            awake = ray.get(trainer.used_gib.remote())
            # KV cache (0.3 of the GPU) came back
            assert awake - asleep > 0.1 * total, (asleep, awake, total)
            manager.sleep()
            assert manager.sleeping and ray.get(trainer.used_gib.remote()) < awake - 0.1 * total

            rows = [{"prompt": [{"role": "user", "content": f"item {i}"}]} for i in range(8)]
            out = manager.generate_sequences(rows_to_batch(rows))  # wakes, rolls out, sleeps again
            assert len(out) == 8 and (out.batch["response_mask"].sum(-1) > 0).all()
            assert manager.sleeping
        finally:
            manager.shutdown()
        assert ray.get(trainer.gpu_ids.remote())  # the trainer and its bundle outlive the manager
    finally:
        ray.shutdown()
