"""OpenAI-SDK agent example: an unmodified OpenAI-client program rolled out through the agentloop
gateway.

    .venv/bin/python examples/openai_sdk_agent/run.py [--num-problems 16]

Each sample runs `agent.py` (plain `openai` SDK code) as a subprocess pointed at its own gateway
session; the gateway records token-exact trajectories.  Writes
outputs/openai_sdk_agent/{problems.jsonl, rollout.dataproto, trajectories.jsonl, summary.json} and
prints the tool-call rate and mean reward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path


def make_problems(n: int, seed: int = 1) -> list[dict]:
    """Word problems (the tiny model's task family) in verl's format, for the `calculator_sdk`
    agent."""
    from agentloop.testing.tiny_model import word_problem_rows

    return word_problem_rows(
        n, agent_name="calculator_sdk", data_source="openai_sdk_agent", seed=seed
    )


def report(out: Path) -> dict:
    """Tool-call rate and mean reward over the recorded trajectories."""
    import numpy as np

    from agentloop.batch.protocol import DataProto

    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    data = DataProto.load_from_disk(str(out / "rollout.dataproto"))
    scores = (
        data.batch["rm_scores"].sum(-1).numpy()
        if "rm_scores" in set(data.batch.keys())
        else np.zeros(len(rows))
    )
    return {
        "trajectories": len(rows),
        "tool_call_rate": sum("<tool_response>" in r["response"] for r in rows) / max(1, len(rows)),
        "mean_reward": float(scores.mean()) if len(scores) else 0.0,
        "status": dict(Counter(data.non_tensor_batch["status"].astype(str).tolist())),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-problems", type=int, default=16)
    args = parser.parse_args()
    out = Path("outputs/openai_sdk_agent")
    out.mkdir(parents=True, exist_ok=True)
    (out / "problems.jsonl").write_text(
        "".join(json.dumps(p) + "\n" for p in make_problems(args.num_problems))
    )
    model = subprocess.run([sys.executable, "scripts/make_tiny_model.py", "--quiet"], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    subprocess.run(
        [
            str(Path(sys.executable).parent / "agentloop"), "rollout", "--config",
            "examples/openai_sdk_agent/config.yaml", f"actor_rollout_ref.model.path={model}",
        ],
        check=True,
    )
    print(json.dumps(report(out)))


if __name__ == "__main__":
    main()
