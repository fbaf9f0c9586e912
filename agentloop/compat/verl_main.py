"""``python -m agentloop.compat.verl_main <verl's hydra overrides>``: verl 0.9's own PPO trainer
(``verl.trainer.main_ppo``) with agentloop's AgentLoopManager in place of verl's.

It adds two overrides to the command line and calls verl's ``main``; nothing of verl's trainer is
copied:

- ``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=`` :data:`MANAGER_FQN` — the config
  key verl's ``RayPPOTrainer.init_workers`` reads to pick the manager class (so the switch travels
  with the config into verl's TaskRunner actor);
- ``trainer.use_v1=false`` — verl's V1 trainer hands rollouts over through TransferQueue, which
  agentloop does not write; its ``RayPPOTrainer`` (the same algorithms) takes the DataProto.

Requires verl 0.9.x installed next to agentloop.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from agentloop.compat.verl_trainer import MANAGER_FQN, MANAGER_KEY

USE_V1_KEY = "trainer.use_v1"


def _key_of(override: str) -> str:
    """The config key an override sets (``+a.b=1`` / ``++a.b=1`` / ``~a.b`` -> ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def switch_overrides(argv: Sequence[str]) -> list[str]:
    """verl's hydra overrides ``argv`` plus the two that select agentloop's manager.

    Args:
        argv: the user's overrides (verl's ``main_ppo`` command line, without the program).

    Returns:
        ``argv`` followed by the manager-class and ``trainer.use_v1=false`` overrides (each left out
        where ``argv`` already sets it to that value).

    Raises:
        SystemExit: ``argv`` names another manager class, or ``trainer.use_v1=true``.
    """
    out = list(argv)
    given = {_key_of(a): a.split("=", 1)[1] if "=" in a else None for a in out}
    manager = given.get(MANAGER_KEY)
    if manager is not None and manager != MANAGER_FQN:
        raise SystemExit(f"agentloop.compat.verl_main: {MANAGER_KEY}={manager} conflicts with "
                         f"agentloop's manager ({MANAGER_FQN}); drop the override")
    if USE_V1_KEY in given and str(given[USE_V1_KEY]).lower() not in ("false", "0"):
        raise SystemExit(f"agentloop.compat.verl_main: {USE_V1_KEY}=true (verl's TransferQueue "
                         "trainer) is not supported; agentloop runs in verl's RayPPOTrainer "
                         f"({USE_V1_KEY}=false)")
    if manager is None:
        out.append(f"+{MANAGER_KEY}={MANAGER_FQN}")
    if USE_V1_KEY not in given:
        out.append(f"{USE_V1_KEY}=false")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Run verl's ``main_ppo`` with :func:`switch_overrides` applied to ``argv`` (default: this
    process's command line).

    Raises:
        SystemExit: verl is not installed, or the overrides conflict (see
            :func:`switch_overrides`)."""
    args = sys.argv[1:] if argv is None else list(argv)
    overrides = switch_overrides(args)
    try:  # optional dependency: verl is installed by the user, never by agentloop
        from verl.trainer import main_ppo
    except ImportError as e:
        raise SystemExit(f"agentloop.compat.verl_main needs verl 0.9.x installed ({e})") from e
    sys.argv = [sys.argv[0] if sys.argv else "verl_main", *overrides]
    main_ppo.main()


if __name__ == "__main__":
    main()
