"""Placing server actors on the Ray cluster.

Standalone placement (the default, no trainer worker group): one placement group with one bundle per
server (``tensor_model_parallel_size`` GPUs + 1 CPU on GPU clusters;
``rollout.server.num_cpus_per_server`` CPUs on CPU-only machines); server ``i`` is pinned to bundle
``i``.  On CPU each engine gets its own slice of cores (``VLLM_CPU_OMP_THREADS_BIND``) so several
engines on one machine do not pile onto one core.

Colocated placement (a trainer worker group is given) lives in :mod:`agentloop.cluster.colocated`;
both create their actors through :func:`launch_servers`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentloop.config import AgentLoopConfig, ServerSections
from agentloop.errors import ConfigError, ServerError

# re-exported from its former home
from agentloop.utils.process import restore_normal_priority  # noqa: F401
from agentloop.utils.registry import Registry

logger = logging.getLogger(__name__)


@dataclass
class ServerGroup:
    """The server actors of one manager, with the placement group that owns their resources."""

    handles: list[Any]
    placement_group: PlacementGroup | None
    """The group reserved for these servers (standalone), removed on :func:`stop_servers`; None when
    the resources belong to someone else (colocated: the trainer's bundles; shared servers)."""
    device: str
    info: list[dict[str, Any]]
    """Per server: the engine's start-up facts plus where it was placed."""
    placement: str = "standalone"
    """``standalone`` (own placement group), ``colocated`` (on the trainer's workers) or ``shared``
    (servers started elsewhere, neither started nor stopped by the manager)."""
    slots: list[ServerSlot] = field(default_factory=list)
    """Where each server was placed: a dead server is restarted in its slot (empty: cannot be
    restarted)."""
    config: AgentLoopConfig | None = None
    """The config the servers were started with (what a restart uses)."""

    @property
    def restartable(self) -> bool:
        """Whether a dead server can be started again in its slot (the manager started these
        servers)."""
        return bool(self.slots) and self.config is not None

    def relaunch(self, index: int) -> Any:
        """Create (not start) a new server actor in server ``index``'s slot; call ``start`` on it
        next."""
        if self.config is None or index >= len(self.slots):
            raise ServerError(
                f"server {index} was not started by this manager "
                f"({self.placement} placement) and "
                "cannot be restarted by it"
            )
        return create_server_actor(self.config, self.slots[index], index)


def detect_device(setting: str) -> str:
    """``auto`` → ``cuda`` when the Ray cluster has GPUs, else ``cpu``."""
    if setting in ("cuda", "cpu"):
        return setting
    if setting != "auto":
        raise ConfigError(
            f"actor_rollout_ref.rollout.server.device must be auto|cuda|cpu, got {setting!r}"
        )
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def count_servers(cfg: AgentLoopConfig, device: str, trainer_gpus: int | None = None) -> int:
    """Configured ``server.num_servers``, else all GPUs / TP on GPU clusters, else 1."""
    configured = cfg.server.num_servers
    if configured:
        return int(configured)
    if device == "cpu":
        return 1
    tp = cfg.engine.tensor_model_parallel_size
    gpus = trainer_gpus or int(ray.cluster_resources().get("GPU", 0))
    if gpus < tp:
        raise ConfigError(f"tensor_model_parallel_size={tp} but the cluster has only {gpus} GPUs")
    return gpus // tp


def cpu_bind_env(index: int, num_servers: int) -> dict[str, str]:
    """Thread binding for the ``index``-th of ``num_servers`` vLLM CPU engines sharing this
    machine's cores."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {"VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}
    cores = os.cpu_count() or 1
    if num_servers > cores:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    # Leave one core for Ray, the agent-loop workers and the engines' own Python threads when
    # possible.
    per = max(1, (cores - 1) // num_servers)
    first = index * per
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"{first}-{first + per - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


SERVER_CLASSES = Registry(
    "server class",
    decorator="SERVER_CLASSES.register",
    where="actor_rollout_ref.rollout.name",
    check=lambda obj: isinstance(obj, type),
    expected="a server class",
    how="Register one with SERVER_CLASSES.register(name) on a class taking VLLMServer's "
    "constructor.",
)
"""Server actor classes by ``rollout.name`` that stand in for the built-in backends (``vllm``,
``sglang``) in every placement (standalone, colocated, restarts): the injection point for tests (a
ScriptedServer with VLLMServer's constructor) and backends of your own.  Empty by default;
``del SERVER_CLASSES[name]`` restores the built-in."""


def _server_class(name: str) -> type:
    """The server actor class for ``rollout.name``: a :data:`SERVER_CLASSES` entry, else the
    built-in backend.

    Raises:
        ConfigError: an unknown name, or ``sglang`` without SGLang installed.
    """
    if name in SERVER_CLASSES:
        return SERVER_CLASSES[name]
    if name == "vllm":
        from agentloop.servers.vllm import VLLMServer  # optional dependency: vLLM is an extra

        return VLLMServer
    if name == "sglang":
        # optional dependency: SGLang is an extra
        from agentloop.servers.sglang import SGLangServer, load_sglang

        load_sglang()  # not installed: one ConfigError naming the extra, before any actor starts
        return SGLangServer
    raise ConfigError(f"rollout.name={name!r}: use 'vllm' or 'sglang'")


@dataclass(frozen=True)
class ServerSlot:
    """Where one server actor runs and what it reserves there (one slot per server, in server
    order)."""

    scheduling_strategy: Any
    """A Ray scheduling strategy: the server's placement-group bundle, or affinity to a node."""
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the server process, on top of the engine defaults (KV-cache size, log
    level)."""
    facts: dict[str, Any] = field(default_factory=dict)
    """Placement facts added to the server's start-up info (node, bundle, trainer ranks)."""


def create_server_actor(cfg: AgentLoopConfig, slot: ServerSlot, index: int) -> Any:
    """Create server ``index``'s actor in ``slot`` (its ``start`` is not called here)."""
    cls: Any = ray.remote(_server_class(cfg.engine.name))
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), **slot.env,
    }
    return cls.options(
        num_cpus=slot.num_cpus, num_gpus=slot.num_gpus,
        scheduling_strategy=slot.scheduling_strategy, runtime_env={"env_vars": env},
        max_concurrency=100000,
    ).remote(ServerSections.of(cfg), index)


def launch_servers(
    cfg: AgentLoopConfig, slots: list[ServerSlot]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Create one server actor per slot (server ``i`` in ``slots[i]``), start them all and return
    the handles and their start-up info.  On failure every actor created here is killed and
    :class:`ServerError` raised."""
    handles = [create_server_actor(cfg, slot, i) for i, slot in enumerate(slots)]
    try:
        info = ray.get([h.start.remote() for h in handles])
    except Exception as e:
        for h in handles:
            ray.kill(h)
        raise ServerError(f"rollout servers failed to start: {e}") from e
    return handles, [
        {**(facts or {}), **slot.facts} for facts, slot in zip(info, slots, strict=True)
    ]


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""``rollout.server.placement_strategy``: how standalone servers' bundles spread over the nodes
(Ray's names)."""


def start_standalone_servers(cfg: AgentLoopConfig, trainer_gpus: int | None = None) -> ServerGroup:
    """Create and start the server actors; raises :class:`ServerError` naming what failed."""
    device = detect_device(cfg.server.device)
    n = count_servers(cfg, device, trainer_gpus)
    tp = cfg.engine.tensor_model_parallel_size
    cpus = cfg.server.num_cpus_per_server
    bundle = {"GPU": float(tp), "CPU": 1.0} if device == "cuda" else {"CPU": cpus}
    strategy = cfg.server.placement_strategy.upper()
    if strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(
            f"actor_rollout_ref.rollout.server.placement_strategy={strategy!r}: "
            f"use one of "
            f"{', '.join(PLACEMENT_STRATEGIES)} (Ray placement-group "
            f"strategies; SPREAD puts the "
            "servers on as many nodes as it can)"
        )
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=120)
    except Exception as e:
        ray.util.remove_placement_group(pg)
        raise ServerError(
            f"could not reserve {n} x {bundle} for the rollout servers ({strategy}; cluster has "
            f"{ray.cluster_resources()}); lower "
            f"actor_rollout_ref.rollout.server.num_servers / num_cpus_per_server"
            + (" or use placement_strategy SPREAD / PACK" if strategy.startswith("STRICT") else "")
        ) from e
    slots = [
        ServerSlot(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i
            ),
            num_cpus=0 if device == "cuda" else cpus,
            num_gpus=tp if device == "cuda" else 0,
            env=cpu_bind_env(i, n) if device == "cpu" else {},
            facts={"placement": "standalone", "bundle_index": i},
        )
        for i in range(n)
    ]
    try:
        handles, info = launch_servers(cfg, slots)
    except ServerError:
        ray.util.remove_placement_group(pg)
        raise
    return ServerGroup(
        handles=handles, placement_group=pg, device=device, info=info, slots=slots, config=cfg
    )


def stop_servers(group: ServerGroup) -> None:
    """Shut the engines down and release their resources."""
    with contextlib.suppress(Exception):  # best effort; the actors are killed next
        ray.get([h.shutdown.remote() for h in group.handles], timeout=60)
    for h in group.handles:
        ray.kill(h)
    if group.placement_group is not None:
        ray.util.remove_placement_group(group.placement_group)


def _supports_sleep(server: Any) -> bool:
    return bool(server.supports_sleep)


def sleep_support(handles: list[Any]) -> list[bool]:
    """Each server actor's declared ``supports_sleep`` (read after ``start()``: vLLM decides it
    there)."""
    return [bool(x) for x in ray.get([h.__ray_call__.remote(_supports_sleep) for h in handles])]
