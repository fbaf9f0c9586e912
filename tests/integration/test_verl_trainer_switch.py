"""verl 0.9.1's own trainer code path with agentloop's manager (``agentloop.compat.verl_main``).

verl is installed (``pip install --no-deps``, with the three pure-Python packages its trainer
imports that agentloop does not need) into a scratch directory, never into the environment; without
the package index the verl tests skip. On CPU verl's trainer stops at its worker groups (they need
GPUs), so the vLLM test takes verl's steps around that seam itself, with verl's code: its hydra
config, its RLHFDataset / collate_fn / DataProto, ``RayPPOTrainer._get_gen_batch``, its router and
``LLMServerClient`` (over one agentloop vLLM CPU server, standing in for verl's replicas), its
``load_class_from_fqn`` on the switch key, ``create(...)`` with the trainer's arguments and its
``RewardLoopManager``'s workers. One engine for the module, under a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from agentloop.compat.verl_main import switch_overrides
from agentloop.compat.verl_trainer import (
    MANAGER_FQN,
    MANAGER_KEY,
    VerlTrainerManager,
    _token_output,
)
from agentloop.types import StopReason

VERL_PACKAGES = ["verl==0.9.1", "codetiming", "torchdata", "peft"]
"""verl 0.9.1 and what its trainer modules import that agentloop's environment lacks."""

BATCH, N, PROMPT_LEN, RESPONSE_LEN = 4, 2, 64, 24
VERL_OUTPUT_KEYS = {"prompts", "responses", "response_mask", "input_ids", "attention_mask",
                    "position_ids", "rm_scores"}
"""What verl's trainer reads from ``generate_sequences`` (verl 0.9.1 ray_trainer.fit)."""


# --- the switch itself: no verl needed ---------------------------------------------------------

def test_switch_adds_manager_class_and_legacy_trainer():
    out = switch_overrides(["data.train_batch_size=4"])
    assert out == [
        "data.train_batch_size=4", f"+{MANAGER_KEY}={MANAGER_FQN}", "trainer.use_v1=false",
    ]
    given = [f"++{MANAGER_KEY}={MANAGER_FQN}", "trainer.use_v1=False"]
    assert switch_overrides(given) == given


@pytest.mark.parametrize("bad", [f"{MANAGER_KEY}=my.Manager", "trainer.use_v1=true"])
def test_switch_refuses_conflicting_overrides(bad):
    with pytest.raises(SystemExit, match="agentloop.compat.verl_main"):
        switch_overrides([bad])


def test_verl_token_output_is_normalised():
    verl_like = type("T", (), {"token_ids": [5, 6, 7], "log_probs": [-0.1, -0.2, -0.3],
                                "stop_reason": "completed", "num_preempted": None,
                                "extra_fields": {"global_steps": 3}})()
    out = _token_output(verl_like, max_tokens=3)
    assert out.stop_reason == StopReason.LENGTH and out.num_preempted == 0
    assert out.token_ids == [5, 6, 7] and out.extra_fields == {"global_steps": 3}
    assert _token_output(verl_like, max_tokens=8).stop_reason == StopReason.STOP


# --- verl's wheel in a scratch directory -------------------------------------------------------

@pytest.fixture(scope="module")
def verl_dir(tmp_path_factory) -> Path:
    """verl 0.9.1 installed --no-deps into a scratch directory, on sys.path and PYTHONPATH (so Ray
    workers import it too); skips when the package index cannot be reached."""
    target = tmp_path_factory.mktemp("verl091")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-deps", "--target", str(target), *VERL_PACKAGES]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot install verl 0.9.1 into a scratch directory (offline?): {e}")
    sys.path.insert(0, str(target))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), old) if p)
    yield target
    sys.path.remove(str(target))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> str:
    """A GSM8K-shaped verl RL parquet (verl's examples/data_preprocess/gsm8k.py columns)."""
    rows = [{
        "data_source": "openai/gsm8k", "ability": "math", "agent_name": "single_turn_agent",
        "prompt": [{"role": "user", "content": f"What is {i} + {2 * i}? Answer after ####."}],
        "reward_model": {"style": "rule", "ground_truth": str(3 * i)},
        "extra_info": {"index": i, "split": "train"},
    } for i in range(8)]
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.fixture(scope="module")
def verl_config(verl_dir, model_path, train_file):
    """verl's ppo_trainer.yaml composed by hydra with a GRPO quickstart's overrides plus the
    switch's."""
    from hydra import compose, initialize_config_dir

    user = [
        "algorithm.adv_estimator=grpo", f"data.train_files={train_file}",
        f"data.val_files={train_file}", f"data.train_batch_size={BATCH}",
        f"data.max_prompt_length={PROMPT_LEN}", f"data.max_response_length={RESPONSE_LEN}",
        f"actor_rollout_ref.model.path={model_path}", "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.load_format=auto",  # the stand-in server loads model.path
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "reward.num_workers=1", "trainer.device=cpu",
    ]
    config_dir = verl_dir / "verl" / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=switch_overrides(user))


def test_verl_config_selects_agentloops_manager(verl_config):
    from verl.utils.import_utils import load_class_from_fqn

    fqn = verl_config.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
    assert load_class_from_fqn(fqn, "AgentLoopManager") is VerlTrainerManager
    assert verl_config.trainer.use_v1 is False


# --- one generate_sequences through verl's code path on vLLM CPU --------------------------------

def _verl_gen_batch(config: Any, model_path: str) -> tuple[Any, Any]:
    """verl's first training batch and the gen batch its trainer hands the manager."""
    from transformers import AutoTokenizer
    from verl import DataProto as VerlDataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None)
    batch = VerlDataProto.from_single_dict(collate_fn([dataset[i] for i in range(BATCH)]))
    batch.meta_info["temperature"] = config.actor_rollout_ref.rollout.temperature
    uids = [str(uuid.uuid4()) for _ in range(BATCH)]
    batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # verl's own method; uses no state
    gen_batch.meta_info["global_steps"] = 1
    return batch, gen_batch.repeat(repeat_times=N, interleave=True)


@pytest.fixture(scope="module")
def verl_llm_client(verl_config):
    """verl's router and LLMServerClient over one agentloop vLLM CPU server (on a GPU, verl's
    LLMServerManager builds the same client over its own replicas)."""
    import ray
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from agentloop.cluster.placement import start_standalone_servers, stop_servers
    from agentloop.compat.verl_trainer import _without_manager_key
    from agentloop.config import resolve_config

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    servers = start_standalone_servers(resolve_config(_without_manager_key(verl_config)))
    router = get_router_handle(servers={"agentloop-0": servers.handles[0]})
    yield LLMServerClient(config=verl_config, load_balancer_handle=router)
    stop_servers(servers)
    ray.shutdown()


@pytest.mark.integration
def test_verl_trainer_path_generates_verl_batch(verl_config, verl_llm_client, model_path):
    from verl import DataProto as VerlDataProto
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.import_utils import load_class_from_fqn

    cfg = verl_config
    cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class,
                              "AgentLoopManager")
    reward_loop = RewardLoopManager(config=cfg, rm_resource_pool=None)
    manager = cls.create(  # the call verl 0.9.1's RayPPOTrainer.init_workers makes
        config=cfg, llm_client=verl_llm_client, teacher_client=None,
        reward_loop_worker_handles=reward_loop.reward_loop_workers,
    )
    try:
        batch, gen_batch = _verl_gen_batch(cfg, model_path)
        out = manager.generate_sequences(gen_batch)
    finally:
        manager.shutdown()
    assert type(out) is VerlDataProto and len(out) == BATCH * N
    assert set(out.batch.keys()) >= VERL_OUTPUT_KEYS
    assert out.batch["responses"].shape == (BATCH * N, RESPONSE_LEN)
    assert torch.isfinite(out.batch["rollout_log_probs"]).all()
    assert "timing" in out.meta_info and "__num_turns__" in out.non_tensor_batch
    assert set(out.non_tensor_batch["status"]) <= {"stop", "length"}
    # what verl's fit loop does next
    merged = batch.repeat(repeat_times=N, interleave=True).union(out)
    reward, _ = extract_reward(merged)
    assert reward.shape == (BATCH * N, RESPONSE_LEN)
    assert torch.equal((reward != 0).sum(-1) <= 1, torch.ones(BATCH * N, dtype=torch.bool))
