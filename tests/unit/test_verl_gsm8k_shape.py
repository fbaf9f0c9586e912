"""A dataset in the shape verl's GSM8K tool-agent preprocessing writes, with verl's GSM8K tool
config as verl ships it (class path ``verl.tools.gsm8k_tool.Gsm8kTool``), rolled out by
``tool_agent`` as in verl.
"""

from __future__ import annotations

import asyncio
import json

import pandas as pd
from omegaconf import OmegaConf
from test_tools_verl_api import GSM8K_YAML

from agentloop.batch.data import load_dataset
from agentloop.config import default_config
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END

TOK = FakeTokenizer()

# verl's gsm8k_tool_config.yaml exactly as verl ships it: the class path names verl's module
VERL_TOOL_CONFIG = GSM8K_YAML.replace(
    "agentloop.tools.gsm8k.Gsm8kTool", "verl.tools.gsm8k_tool.Gsm8kTool"
)


def verl_gsm8k_rows(n: int) -> list[dict]:
    """Rows with the columns and nesting of verl's
    examples/data_preprocess/gsm8k_tool_agent_loop.py."""
    rows = []
    for i in range(n):
        answer = str(10 + i)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "agent_name": "tool_agent",
                "ability": "math",
                "prompt": [
                    {
                        "role": "system",
                        "content": "You are a math expert. Use `calc_gsm8k_reward`.",
                    },
                    {
                        "role": "user",
                        "content": f"What is {i} + 10? Output the final answer after `####`.",
                    },
                ],
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": "train",
                    "index": i,
                    "answer": f"#### {answer}",
                    "question": f"{i} + 10",
                    "need_tools_kwargs": True,
                    "tools_kwargs": {
                        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}
                    },
                    "interaction_kwargs": {"query": f"{i} + 10", "ground_truth": answer},
                },
            }
        )
    return rows


def test_verl_gsm8k_dataset_and_tool_config_run_as_in_verl(tmp_path):
    data = tmp_path / "train.parquet"
    pd.DataFrame(verl_gsm8k_rows(4)).to_parquet(data)
    tools = tmp_path / "gsm8k_tool_config.yaml"
    tools.write_text(VERL_TOOL_CONFIG)
    cfg = default_config()
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    # interaction_config_path unset, as in verl's GSM8K recipe
    rollout.multi_turn.tool_config_path = str(tools)

    def policy(ids, params, rid):
        text = TOK.decode(ids)
        if "<tool_response>" in text or "tool\n" in text:
            return TOK.encode("#### done") + [IM_END]
        question = text.rsplit("What is ", 1)[1].split(" +", 1)[0]
        # odd questions answered wrong
        answer = int(question) + 10 if int(question) % 2 == 0 else -1
        call = {"name": "calc_gsm8k_reward", "arguments": {"answer": str(answer)}}
        return TOK.encode(f"<tool_call>{json.dumps(call)}</tool_call>") + [IM_END]

    worker = AgentLoopWorker.from_slices(
        rollout, cfg.actor_rollout_ref.model, [ScriptedServer(policy, eos_token_id=IM_END)],
        tokenizer=TOK, trainer_config=cfg,
    )
    batch = load_dataset(data)
    assert batch.non_tensor_batch["tools_kwargs"][1] == {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "11"}}
    }
    out = asyncio.run(worker.generate_sequences(batch))
    # interaction_kwargs did not start one
    assert out.non_tensor_batch["status"].tolist() == ["stop"] * 4
    rewards = out.non_tensor_batch["tool_rewards"].tolist()
    # the ground truth of each row reached its tool instance
    assert rewards == [[1.0], [0.0], [1.0], [0.0]]
    assert out.non_tensor_batch["num_tool_errors"].tolist() == [0, 0, 0, 0]
