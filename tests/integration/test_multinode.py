"""Multi-node: a simulated 4-node Ray cluster (``ray.cluster_utils.Cluster``), run in its own
process by ``multinode_cluster.py`` (a Cluster needs its own ``ray.init``, which must not meet the
other modules' sessions).

Servers and agent-loop workers spread one per node, a node removed mid-batch costs no row (its
samples finish on the other nodes; its server is restarted elsewhere and its worker replaced), and
the tiny model runs on vLLM CPU with one engine on each of two nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("multinode_cluster.py")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from agentloop.testing.tiny_model import ensure_tiny_model

    path = tmp_path_factory.mktemp("multinode") / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), str(ensure_tiny_model()), "--vllm"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return dict(json.loads(path.read_text()))


def test_servers_and_workers_spread_one_per_node(report: dict[str, Any]) -> None:
    spread, nodes = report["spread"], set(report["nodes"].values())
    # placement_strategy SPREAD: four servers on four nodes
    assert set(spread["server_nodes"]) == nodes
    # four agent-loop workers, round-robin over the nodes
    assert set(spread["worker_nodes"]) == nodes
    assert spread["statuses"] == ["stop"] * 8 and spread["index"] == list(range(8))
    assert sum(spread["calls"]) == 8 and min(spread["calls"]) >= 1  # every node's server served


def test_a_node_removed_mid_batch_loses_no_sample(report: dict[str, Any]) -> None:
    removed = report["node_removed"]
    assert removed["error"] is None
    assert (
        removed["rows"] == 32
        and removed["statuses"] == ["stop"] * 32
        and removed["index"] == list(range(32))
    )
    assert not removed["errors"]
    faults = removed["faults"]
    # its worker's rows ran elsewhere
    assert faults["worker_restarts"] >= 1 and faults["sample_retries"] >= 1
    # so did its server's calls
    assert faults["server_failovers"] >= 1 and faults["samples_failed_by_faults"] == 0
    assert removed["recover"]["servers_down"] == 0 and removed["recover"]["workers"] == 4
    # restarted on a node that is still there
    assert removed["victim_id"] not in removed["server_nodes_after"]
    assert (
        removed["after"]["statuses"] == ["stop"] * 8
        and removed["after"]["faults"]["servers_restarted"] == 1
    )


def test_the_tiny_model_on_vllm_cpu_across_two_nodes(report: dict[str, Any]) -> None:
    vllm = report["vllm"]
    assert len(set(vllm["server_nodes"])) == 2 and vllm["platforms"] == ["cpu", "cpu"]
    assert vllm["rows"] == 6 and set(vllm["statuses"]) <= {"stop", "length"} and not vllm["errors"]
    assert vllm["response_tokens"] > 0 and vllm["logprobs_finite"]
    assert min(vllm["engine_busy_s"]) > 0  # both engines generated
