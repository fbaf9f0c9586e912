"""Calculator agent example: make problems, roll them out with `tool_agent`, report tool use and
reward.

    .venv/bin/python examples/calculator_agent/run.py [--num-problems 64]

Writes outputs/calculator_agent/{problems.jsonl, rollout.dataproto, trajectories.jsonl,
summary.json} and prints the tool-call rate (trajectories with at least one tool turn) and the mean
reward (final answer correct).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path


def make_problems(n: int, seed: int = 0) -> list[dict]:
    """Arithmetic word problems (the tiny model's task family) in verl's dataset format, routed
    to `tool_agent`."""
    from agentloop.testing.tiny_model import word_problem_rows

    return word_problem_rows(n, agent_name="tool_agent", data_source="calculator_agent", seed=seed)


def score(trajectories: Path, problems: list[dict]) -> dict:
    """Tool-call rate and mean reward (1.0 when 'The answer is N.' matches the ground truth)."""
    truth = {p["extra_info"]["index"]: p["reward_model"]["ground_truth"] for p in problems}
    rows = [json.loads(line) for line in trajectories.read_text().splitlines()]
    used_tool = [("<tool_response>" in r["response"]) for r in rows]
    rewards = []
    for r in rows:
        found = re.findall(r"The answer is (-?\d+)", r["response"])
        rewards.append(float(bool(found) and found[-1] == truth[r["index"]]))
    return {"trajectories": len(rows), "tool_call_rate": sum(used_tool) / len(rows),
            "mean_reward": sum(rewards) / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-problems", type=int, default=64)
    args = parser.parse_args()
    out = Path("outputs/calculator_agent")
    out.mkdir(parents=True, exist_ok=True)
    problems = make_problems(args.num_problems)
    (out / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    model = subprocess.run([sys.executable, "scripts/make_tiny_model.py", "--quiet"], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    subprocess.run(
        [
            str(Path(sys.executable).parent / "agentloop"), "rollout", "--config",
            "examples/calculator_agent/config.yaml", f"actor_rollout_ref.model.path={model}",
        ],
        check=True,
    )
    print(json.dumps(score(out / "trajectories.jsonl", problems)))


if __name__ == "__main__":
    main()
