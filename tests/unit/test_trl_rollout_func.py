"""agentloop.integrations.trl on the scripted engine: TRL's rollout_func contract (shapes, masks,
log-probs aligned with completion_ids, extra fields), failed samples, text and conversational
prompts, the multi-trajectory rule, the weight-sync callback and TRL's own use of the fields."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")

from agentloop import MultiTrajectoryAgentLoopOutput  # noqa: E402
from agentloop.config import default_config  # noqa: E402
from agentloop.integrations.trl import (  # noqa: E402
    PEFT_REFUSED,
    AgentLoopRollout,
    agentloop_reward,
)
from agentloop.integrations.trl_fields import build_batch, final_rows  # noqa: E402
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, resolve_registry  # noqa: E402
from agentloop.rollout.worker import AgentLoopWorker  # noqa: E402
from agentloop.testing import ScriptedServer  # noqa: E402
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer  # noqa: E402
from agentloop.types import AgentLoopOutput, RolloutStatus  # noqa: E402

SAMPLED, TOOL = [70, 71], [80, 81, 82]
"""Each turn samples SAMPLED (+ IM_END); a tool turn adds TOOL (not sampled)."""


class ToolTurnsLoop(AgentLoopBase):
    """``extra_info``: ``turns`` sampled turns with a tool result between them, ``reward``,
    ``status``, ``k`` trajectories (the last one is the whole episode)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        info = kwargs.get("extra_info") or {}
        prompt = self.tokenizer.apply_chat_template(kwargs["raw_prompt"],
                                                    add_generation_prompt=True)
        outputs = []
        for j in range(int(info.get("k", 1))):
            ids, mask, logprobs = [], [], []
            for turn in range(int(info.get("turns", 2))):
                if turn:
                    ids += TOOL
                    mask += [0] * len(TOOL)
                    logprobs += [0.0] * len(TOOL)
                o = await self.server_manager.generate(
                    request_id=f"{kwargs['uid']}-{j}-{turn}", prompt_ids=prompt + ids,
                    sampling_params=sampling_params)
                ids += o.token_ids
                mask += [1] * len(o.token_ids)
                logprobs += list(o.log_probs or [])
            outputs.append(AgentLoopOutput(
                prompt_ids=prompt + [90 + j], response_ids=ids, response_mask=mask,
                response_logprobs=logprobs, num_turns=2 * int(info.get("turns", 2)),
                reward_score=float(info.get("reward", 1.0)) + j,
                status=RolloutStatus(info.get("status", "stop")),
                extra_fields={"tool_calls": int(info.get("turns", 2)) - 1}))
        if len(outputs) == 1:
            return outputs[0]
        return MultiTrajectoryAgentLoopOutput(trajectories=outputs)


class ScriptedManager:
    """The manager surface the integration uses, on an in-process worker and a scripted server."""

    def __init__(self) -> None:
        cfg = default_config()
        cfg.data.max_prompt_length = 64
        cfg.data.max_response_length = 32
        cfg.actor_rollout_ref.rollout.calculate_log_probs = True
        OmegaConf.resolve(cfg)
        reg = resolve_registry()
        reg["tool_turns"] = ResolvedAgentLoop(name="tool_turns", cls=ToolTurnsLoop)
        self.server = ScriptedServer(lambda ids, params, rid: [*SAMPLED, IM_END],
                                     eos_token_id=IM_END)
        self.worker = AgentLoopWorker.from_slices(
            cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [self.server],
            registry=reg, tokenizer=FakeTokenizer(), trainer_config=cfg,
        )
        self.tokenizer = self.worker.tokenizer
        self.batches: list[Any] = []
        self.updates: list[tuple[dict[str, torch.Tensor], int | None]] = []

    def generate_sequences(self, batch: Any) -> Any:
        self.batches.append(batch)
        return asyncio.run(self.worker.generate_sequences(batch))

    def update_weights(self, weights: Any, *, global_steps: int | None = None) -> int:
        self.updates.append((dict(weights), global_steps))
        return global_steps or len(self.updates)


def trainer(num_generations: int = 2, process_index: int = 0) -> Any:
    """The attributes of GRPOTrainer the rollout reads."""
    return SimpleNamespace(num_generations=num_generations, num_generations_eval=1,
                           model=SimpleNamespace(training=True), train_dataset=None,
                           eval_dataset=None,
                           accelerator=SimpleNamespace(process_index=process_index))


def rows(infos: list[dict[str, Any]], text: bool = False) -> list[dict[str, Any]]:
    """Dataset rows, one per info, each repeated twice (TRL's num_generations copies)."""
    out = []
    for i, info in enumerate(infos):
        prompt: Any = f"question {i}" if text else [{"role": "user", "content": f"question {i}"}]
        out.append({"prompt": prompt, "agent_name": "tool_turns", "extra_info": info})
    return out


def run(infos: list[dict[str, Any]], text: bool = False, **kwargs: Any
        ) -> tuple[dict[str, Any], ScriptedManager, AgentLoopRollout]:
    manager = ScriptedManager()
    data = rows(infos, text)
    rollout = AgentLoopRollout(manager, dataset=data, **kwargs)
    prompts = [r["prompt"] for r in data for _ in range(2)]
    return rollout(prompts, trainer()), manager, rollout


def test_fields_shapes_masks_and_logprobs_follow_completion_ids() -> None:
    fields, manager, _ = run([{"turns": 2, "reward": 1.0}, {"turns": 1, "reward": 0.0}])
    assert len(fields["prompt_ids"]) == len(fields["completion_ids"]) == 4
    turn = [*SAMPLED, IM_END]
    assert fields["completion_ids"][0] == turn + TOOL + turn
    assert fields["env_mask"][0] == [1] * 3 + [0] * 3 + [1] * 3
    assert fields["completion_ids"][2] == turn and fields["env_mask"][2] == [1, 1, 1]
    for ids, mask, logprobs in zip(fields["completion_ids"], fields["env_mask"],
                                   fields["logprobs"], strict=True):
        assert len(ids) == len(mask) == len(logprobs)
        assert all(lp < 0 for lp, m in zip(logprobs, mask, strict=True) if m)  # sampled: engine's
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    # the prompt the loop rendered, without padding
    prompt = FakeTokenizer().apply_chat_template([{"role": "user", "content": "question 0"}],
                                                 add_generation_prompt=True)
    assert fields["prompt_ids"][0] == prompt + [90]
    assert fields["reward"] == [1.0, 1.0, 0.0, 0.0]
    assert fields["status"] == ["stop"] * 4 and fields["failed"] == [False] * 4
    assert fields["num_turns"] == [4, 4, 2, 2]
    assert fields["trajectory_index"] == [0] * 4 and fields["num_trajectories"] == [1] * 4
    assert fields["agentloop_info"][0]["tool_calls"] == 1
    # GRPO groups: TRL's adjacent copies share a uid, the dataset columns reached the loop
    uids = manager.batches[0].non_tensor_batch["uid"].tolist()
    assert uids[0] == uids[1] != uids[2] == uids[3]
    assert fields["uid"] == uids
    assert agentloop_reward(completions=[None] * 4, **fields) == fields["reward"]


def test_text_and_conversational_prompts_give_the_same_rollout() -> None:
    chat, _, _ = run([{"turns": 1}], text=False)
    text, manager, _ = run([{"turns": 1}], text=True)
    assert manager.batches[0].non_tensor_batch["raw_prompt"][0] == [
        {"role": "user", "content": "question 0"}]
    assert text["prompt_ids"] == chat["prompt_ids"]
    assert text["completion_ids"] == chat["completion_ids"]


def test_failed_samples_are_unscorable_with_no_loss_tokens(caplog: Any) -> None:
    fields, _, rollout = run([{"status": "error"}, {"reward": 1.0}])
    assert fields["failed"] == [True, True, False, False]
    assert fields["reward"] == [None, None, 1.0, 1.0]
    assert fields["env_mask"][0] == [0] * len(fields["completion_ids"][0])
    assert rollout.failed == {"error": 2} and rollout.samples == 4
    assert "2 of 4 samples failed" in caplog.text
    logged: list[tuple[str, float]] = []
    rewards = agentloop_reward([None] * 4, log_metric=lambda k, v: logged.append((k, v)), **fields)
    assert rewards == [None, None, 1.0, 1.0] and logged == [("agentloop/failed", 0.5)]


def test_a_failed_reward_can_be_a_number() -> None:
    fields, _, _ = run([{"status": "timeout"}, {"reward": 1.0}], failed_reward=0.0)
    assert fields["reward"] == [0.0, 0.0, 1.0, 1.0] and fields["status"][0] == "timeout"


def test_an_exception_in_the_loop_is_a_failed_sample_with_one_masked_token() -> None:
    fields, _, rollout = run([{"turns": "not a number"}, {"turns": 1}])
    assert fields["status"][:2] == ["error", "error"] and fields["failed"][:2] == [True, True]
    assert len(fields["completion_ids"][0]) == 1 and fields["env_mask"][0] == [0]
    assert fields["logprobs"][0] == [0.0]
    assert rollout.failed["error"] == 2


def test_multi_trajectory_samples_give_their_last_trajectory() -> None:
    fields, manager, _ = run([{"k": 3, "reward": 0.0}, {"k": 1, "reward": 0.5}])
    assert len(fields["completion_ids"]) == 4
    assert fields["trajectory_index"] == [2, 2, 0, 0]
    assert fields["num_trajectories"] == [3, 3, 1, 1]
    assert [p[-1] for p in fields["prompt_ids"]] == [92, 92, 90, 90]  # trajectory j's marker
    assert fields["reward"] == [2.0, 2.0, 0.5, 0.5]  # the last trajectory's reward (0 + j)


def test_final_rows_refuses_a_rollout_of_the_wrong_size() -> None:
    batch = build_batch(["a", "b"], group_size=1, first_index=0, tag="t")
    with pytest.raises(ValueError, match="1 TRL prompts"):
        final_rows(batch, 1)


def test_uids_follow_global_groups_across_processes() -> None:
    batch = build_batch(["a", "a", "a", "b"], group_size=4, first_index=4, tag="t")
    assert batch.non_tensor_batch["uid"].tolist() == ["t-1"] * 4
    split = build_batch(["a", "a", "b", "b"], group_size=4, first_index=2, tag="t")
    assert split.non_tensor_batch["uid"].tolist() == ["t-0", "t-0", "t-1", "t-1"]
    with pytest.raises(ValueError, match="num_generations"):
        build_batch(["a"], group_size=0, first_index=0, tag="t")


def test_no_reward_source_means_no_reward_field() -> None:
    manager = ScriptedManager()
    rollout = AgentLoopRollout(manager, dataset=[])
    fields = rollout([[{"role": "user", "content": "hi"}]] * 2, trainer())  # single_turn
    assert "reward" not in fields and fields["status"] == ["stop", "stop"]
    with pytest.raises(ValueError, match="no 'reward' field"):
        agentloop_reward([None, None], **fields)


def test_the_callback_syncs_every_k_steps_and_at_the_end() -> None:
    manager = ScriptedManager()
    rollout = AgentLoopRollout(manager, sync_every=2)
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        rollout.on_step_end(None, SimpleNamespace(global_step=step), None, model=model)
    assert [v for _, v in manager.updates] == [2]
    rollout.on_train_end(None, SimpleNamespace(global_step=3), None, model=model)
    assert [v for _, v in manager.updates] == [2, 3] and rollout.syncs == 2
    weights = manager.updates[-1][0]
    assert torch.equal(weights["weight"], model.weight)
    rollout.on_train_end(None, SimpleNamespace(global_step=3), None, model=model)
    assert rollout.syncs == 2  # the last step is synced already


def test_peft_models_and_bad_intervals_are_refused() -> None:
    class PeftModelForCausalLM(torch.nn.Linear):
        peft_config: dict[str, Any] = {}

    rollout = AgentLoopRollout(ScriptedManager())
    with pytest.raises(ValueError, match="PEFT") as e:
        rollout.on_train_begin(None, SimpleNamespace(global_step=0), None,
                               model=PeftModelForCausalLM(2, 2))
    assert str(e.value) == PEFT_REFUSED
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="sync_every"):
            AgentLoopRollout(ScriptedManager(), sync_every=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync_ranks must be one of"):
        AgentLoopRollout(ScriptedManager(), sync_ranks="rank0")


def test_sync_ranks_main_syncs_in_a_single_process() -> None:
    """One process is the main one: ``sync_ranks="main"`` syncs as ``all`` does (2 processes:
    tests/integration/test_trl_multiprocess.py)."""
    manager = ScriptedManager()
    rollout = AgentLoopRollout(manager, sync_ranks="main")
    model = torch.nn.Linear(2, 2)
    assert rollout.sync(model, 4) == 4 and rollout.syncs == 1 and rollout.last_synced_step == 4


def test_grpo_trainer_trains_on_the_fields_and_leaves_failed_samples_out(
        tokenizer: Any, tmp_path: Any) -> None:
    """TRL 1.16's own GRPOTrainer on the scripted rollout (single_turn, the calculator reward in
    the workers): one step trains; the failed samples are unscorable (advantage 0, no loss)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from agentloop.testing.tiny_model import ensure_tiny_model

    right = tokenizer.encode("The answer is 5.", add_special_tokens=False)
    wrong = tokenizer.encode("The answer is 6.", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(ids: list[int], params: dict[str, Any], rid: str) -> list[int]:
        if "fail" in tokenizer.decode(ids):
            raise RuntimeError("engine exploded")
        return [*(right if len(calls) % 2 else wrong), end]

    calls: list[int] = []
    manager = ScriptedManager()
    cfg = default_config()
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 16
    cfg.actor_rollout_ref.rollout.calculate_log_probs = True
    cfg.custom_reward_function.path = "agentloop.rewards.calculator"
    cfg.custom_reward_function.name = "compute_score"
    OmegaConf.resolve(cfg)
    server = ScriptedServer(lambda ids, p, rid: calls.append(1) or reply(ids, p, rid),
                            eos_token_id=end)
    manager.worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
        tokenizer=tokenizer, trainer_config=cfg)
    manager.tokenizer = tokenizer
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": q}], "data_source": "calculator",
         "reward_model": {"ground_truth": "5"}} for q in ("two plus three", "fail please")])
    rollout = AgentLoopRollout(manager)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                      num_generations=4, learning_rate=1e-5, beta=0.0, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
                      max_completion_length=16)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32),
        args=args, train_dataset=data, processing_class=tokenizer,
        reward_funcs=[agentloop_reward], rollout_func=rollout, callbacks=[rollout])
    trainer.train()
    assert rollout.samples == 8 and rollout.failed == {"error": 4}
    assert len(manager.updates) == 1 and manager.updates[0][1] == 1  # synced after the step
    log = trainer.state.log_history[0]
    assert log["agentloop/failed"] == 0.5
    assert log["reward"] == 0.5  # the 4 scorable samples (2 right, 2 wrong); failed ones left out
    assert torch.isfinite(torch.tensor(log["loss"]))
