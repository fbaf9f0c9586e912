"""verl's ``AgentLoopManager`` constructor arguments that agentloop does not use: warned about, or
refused where they would change the result (the manager's one call into the verl-compatibility
seam)."""

from __future__ import annotations

import logging
from typing import Any

from agentloop.errors import ConfigError

logger = logging.getLogger("agentloop.rollout.manager")


def check_verl_arguments(
    worker_group: Any, rollout_pool: Any, rm_pool: Any, teacher: Any, reward_workers: Any,
    llm_client: Any = None,
) -> None:
    """verl's constructor arguments agentloop does not use: warn, or refuse what would change the
    result.

    ``worker_group`` is used (colocated placement) unless an ``llm_client`` brings its own servers;
    ``rollout_resource_pool`` only together with it (the workers' bundles)."""
    if teacher is not None or reward_workers is not None:
        raise ConfigError(
            "AgentLoopManager: teacher_client (online distillation) and "
            "reward_loop_worker_handles "
            "(verl's reward loop) are not supported; score trajectories with "
            "custom_reward_function.{path,name} (run by the workers) or "
            "reward_score in the agent loop "
            "— see docs/concepts.md (Rewards)"
        )
    if llm_client is not None and (worker_group is not None or rollout_pool is not None):
        logger.warning(
            "AgentLoopManager: worker_group / rollout_resource_pool given "
            "together with an llm_client; "
            "the client's servers are used as they are, so nothing is placed on "
            "the trainer's workers"
        )
    elif rollout_pool is not None and worker_group is None:
        logger.warning(
            "AgentLoopManager: rollout_resource_pool given without a "
            "worker_group; servers are placed "
            "standalone (pass the trainer's worker_group to colocate them with "
            "its workers)"
        )
    if rm_pool is not None:
        logger.warning(
            "AgentLoopManager: rm_resource_pool given but agentloop starts no "
            "reward-model servers; "
            "it is unused (rewards come from the agent loop's reward_score)"
        )
