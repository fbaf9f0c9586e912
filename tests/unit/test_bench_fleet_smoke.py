"""scripts/bench_fleet.py at tiny sizes, so the fleet rehearsal does not rot.

Runs the script in its own process (it builds its own one-node ``Cluster``) with both routings and
checks what it wrote: every trajectory rolled out, one generate call per turn, the per-role
numbers present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fleet_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_fleet.py"), "--servers", "16",
         "--routing", "shared,local", "--trajectories", "40", "--turns", "3", "--workers", "1",
         "--nodes", "1", "--hosts", "1", "--cpus-per-node", "2", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["routing"] for r in rows] == ["shared", "local"]
    for row in rows:
        assert row["servers"] == 16 and row["trajectories"] == 40
        assert row["ok"] == 40 and row["calls"] == 120
        assert row["calls_per_s"] > 0 and row["workers_rss_mb"] > 0
    assert rows[0]["balancer_rss_mb"] > 0 and rows[1]["balancer_rss_mb"] == 0
    assert "calls/s" in proc.stdout and "ceilings from servers=16 (shared)" in proc.stdout


def test_fleet_server_plays_a_tool_calling_model_statelessly() -> None:
    from agentloop.testing.fleet import FleetServer

    server = FleetServer(call_ids=[40, 41, 42, 2], answer_ids=[50, 2])
    assert server.reply_ids([1, 40, 3], None) == [40, 41, 42, 2]  # a lone marker is not the call
    assert server.reply_ids([1, 40, 41, 42, 2, 9, 9], None) == [50, 2]  # the call is in context
    assert server.reply_ids([1], 2) == [40, 41]  # capped by max_tokens
    assert FleetServer(tokens=3, token_id=7).reply_ids([1], None) == [7, 7, 7]
