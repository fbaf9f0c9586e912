"""AgentLoopManager: the driver-side entry point a trainer calls every step.

Builds, on the current Ray cluster: the server actors (standalone placement), one GlobalBalancer
actor shared by every worker, and ``rollout.agent.num_workers`` AgentLoopWorker actors spread
round-robin over alive nodes. ``generate_sequences(batch)`` chunks it over the workers, joins the
chunks as they come back (:mod:`agentloop.batch.assembly`) and adds timing metrics.

Usage from a trainer::

    manager = AgentLoopManager(config)            # trainer-shaped or rollout-only config
    for batch in dataloader:
        out = manager.generate_sequences(batch)  # DataProto, verl's layout
        ...
        manager.update_weights(policy.state_dict())
    manager.shutdown()
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import ray
from omegaconf import DictConfig

from agentloop.batch.assembly import RowAssembler
from agentloop.batch.metrics import after_last_sample, performance_metrics
from agentloop.batch.protocol import DataProto
from agentloop.cluster.placement import ServerGroup, sleep_support, stop_servers
from agentloop.cluster.supervisor import ServerSupervisor
from agentloop.compat.manager_args import check_verl_arguments
from agentloop.config import AgentLoopConfig, GatewaySections, resolve_config
from agentloop.config.routing_replay import check_routing_replay
from agentloop.envs.resolve import ENV_AGENT, batch_rows, check_env_config, check_env_samples
from agentloop.envs.textarena import SELFPLAY_LOOP, check_selfplay_samples
from agentloop.loops.base import resolve_registry
from agentloop.rollout.dispatcher import Dispatcher, Group, split_groups
from agentloop.rollout.fault_metrics import FaultMetrics
from agentloop.rollout.gateway_pool import GatewayPool
from agentloop.rollout.server_sleep import ServerSleep
from agentloop.rollout.startup import (
    alive_nodes,
    open_servers,
    shared_balancer,
    spawn_worker,
    sticky_share,
)
from agentloop.rollout.weights import WeightSync
from agentloop.rollout.worker import check_batch, error_batch
from agentloop.routing import AsyncLLMServerManager
from agentloop.tokenization.loader import load_tokenizer
from agentloop.tools.registry import check_tool_config
from agentloop.types import RolloutStatus

logger = logging.getLogger(__name__)


class AgentLoopManager:
    """Owns the rollout servers and agent-loop workers.

    Args (verl's, 0.6–0.9):
        config: trainer-shaped config (``actor_rollout_ref...``) or the rollout subtree.
        worker_group: the trainer's workers: one server per rollout replica is placed beside them
            (colocated). None: standalone servers. An :class:`AsyncLLMServerManager` here is taken
            as ``llm_client``.
        rollout_resource_pool: with a worker group, verl's resource pool its workers run in; else
            unused.
        rm_resource_pool: verl's reward-model pool; accepted, unused (warned).
        llm_client: an AsyncLLMServerManager over servers started elsewhere, shared as they are
            (verl 0.9).
        teacher_client, reward_loop_worker_handles: not supported.
        model_path: required with a rollout-only config; overrides the model path otherwise.
        servers: servers this manager owns as if it had started them (restarts, :meth:`shutdown`):
            the injection point for tests and placements of your own.

    Raises:
        ConfigError: a bad config, or ``teacher_client`` / ``reward_loop_worker_handles`` given.

    Parts: ``workers`` (:class:`~agentloop.rollout.dispatcher.Dispatcher`), ``supervisor``
    (:class:`~agentloop.cluster.supervisor.ServerSupervisor`), ``weights``
    (:class:`~agentloop.rollout.weights.WeightSync`), ``server_sleep``
    (:class:`~agentloop.rollout.server_sleep.ServerSleep`), ``gateway_pool``
    (:class:`~agentloop.rollout.gateway_pool.GatewayPool`), ``faults``
    (:class:`~agentloop.rollout.fault_metrics.FaultMetrics`); actors started by
    :mod:`agentloop.rollout.startup`. Spec: docs/concepts.md#placement,
    docs/porting-from-verl.md (Placement), docs/architecture.md#extension-points.
    """

    def __init__(
        self, config: DictConfig | dict[str, Any], worker_group: Any = None,
        rollout_resource_pool: Any = None, rm_resource_pool: Any = None, *, llm_client: Any = None,
        teacher_client: Any = None, reward_loop_worker_handles: Any = None,
        model_path: str | None = None, servers: ServerGroup | None = None,
    ) -> None:
        # fails before Ray
        self.config: AgentLoopConfig = resolve_config(config, model_path=model_path)
        self.rollout = self.config.rollout
        # verl 0.9: AgentLoopManager(config, llm_client)
        if isinstance(worker_group, AsyncLLMServerManager):
            llm_client, worker_group = worker_group, None
        check_verl_arguments(worker_group, rollout_resource_pool, rm_resource_pool, teacher_client,
                             reward_loop_worker_handles, llm_client)
        self.registry = resolve_registry(self.config.agent.agent_loop_config_path)
        check_env_config(self.config.env)  # env.default / env.config_path, before servers start
        check_tool_config(self.config.multi_turn.tool_config_path)  # MCP servers, likewise
        self.routed_shape = check_routing_replay(self.config.engine, self.config.model_config)
        for name, entry in self.registry.items():  # a loop entry's own check (verifiers' venv)
            check_entry = getattr(entry.cls, "check_entry", None)
            if check_entry is not None:
                check_entry(entry.kwargs, name)
        if not ray.is_initialized():
            ray.init()
        self._owns_servers = llm_client is None
        self.servers: ServerGroup = open_servers(
            self.config, worker_group, rollout_resource_pool, llm_client, servers
        )
        self.server_handles = self.servers.handles
        self.server_sleep = ServerSleep(
            self.servers, sleep_support(self.server_handles), self._each_server
        )
        agent, server = self.config.agent, self.config.server
        self.balancer = shared_balancer(len(self.server_handles), server.max_cache_size,
                                        server.balancer, server.routing)
        self.local_routing = self.balancer is None and len(self.server_handles) > 1
        self.supervisor = ServerSupervisor(
            self.servers, self.balancer, self._swap_server, restart=server.restart_dead,
            tell_down=self._tell_down if self.balancer is None else None,
        )
        self.weights = WeightSync(
            self.supervisor, backend=self.config.engine.name, mode=server.weight_update,
            timeout_s=server.weight_update_timeout or None, wake_up=self.wake_up,
        )
        self.workers = Dispatcher(
            spawn=self._spawn_worker, num_workers=agent.num_workers, error_rows=self._error_rows,
            balancer=self.balancer, max_sample_retries=agent.max_sample_retries,
            batch_timeout=agent.batch_timeout or None,
            tick=self._watch if server.stall_timeout else None, hang_s=agent.stall_timeout or None,
            weight_version=lambda: self.weights.version, result_channel=agent.result_channel,
        )
        # started on the first batch that has a gateway agent (openai_agent)
        self.gateway_pool = GatewayPool(self.server_handles, self.balancer, self.workers)
        self.faults = FaultMetrics(self.workers, self.supervisor, self.gateway_pool)
        self._nodes = alive_nodes()
        try:
            self._wait_for_workers()
        except BaseException:
            self.shutdown()
            raise
        if self.config.engine.free_cache_engine:
            self.sleep()

    @property
    def weight_version(self) -> int:
        """The version of the weights the servers serve: what :meth:`update_weights` returned
        last (0 before)."""
        return self.weights.version

    @property
    def agent_loop_workers(self) -> list[Any]:
        """The serving AgentLoopWorker actors (a replacement joins once it has started)."""
        return self.workers.handles

    def _spawn_worker(self, index: int, worker_id: str) -> Any:
        """The dispatcher's :data:`~agentloop.rollout.worker_slots.Spawn`: worker ``index``."""
        return spawn_worker(
            self.config, self.server_handles, self.balancer, self.registry, index=index,
            worker_id=worker_id, known_nodes=self._nodes,
            sticky_capacity=self._sticky_capacity if self.local_routing else 0,
            down_servers=tuple(sorted(self.supervisor.down)) if self.balancer is None else (),
        )

    def _tell_down(self, index: int) -> None:
        """No balancer actor: a server taken out of routing is pushed to every worker's router."""
        self.workers.tell("mark_server_down", index)

    def _error_rows(self, chunk: DataProto, status: RolloutStatus, message: str) -> DataProto:
        pad = self.tokenizer.pad_token_id
        return error_batch(
            chunk, status, message, engine=self.config.engine,
            calculate_log_probs=self.config.sampling.calculate_log_probs,
            pad_token_id=int(pad if pad is not None else self.tokenizer.eos_token_id),
            default_agent=self.config.agent.default_agent_loop,
            routed_experts_shape=self.routed_shape,
        )

    def _watch(self) -> None:
        """Every few seconds of a batch: a server or gateway whose actor stopped answering is killed
        (and restarted, or replaced before the next batch)."""
        hang_s = float(self.config.server.stall_timeout or 0)
        if self._owns_servers:
            self.supervisor.watch(hang_s)
        self.gateway_pool.watch(hang_s)

    def _swap_server(self, index: int, handle: Any) -> None:
        """A restarted server replaces server ``index`` for every worker (and later workers)."""
        self.server_handles[index] = handle
        self.workers.broadcast("replace_server", index, handle)
        self.gateway_pool.swap_server(index, handle)

    def _wait_for_workers(self) -> None:
        """Worker set-up (imports, tokenizer, tools) must neither land in the first batch's timing
        (it was ~7 s of the demo's first batch) nor fail only when the first batch is sent."""
        infos = self.workers.start()
        self.init_errors = {k: v for info in infos for k, v in info.get("init_errors", {}).items()}
        for name, error in sorted(self.init_errors.items()):
            logger.warning(
                "agent loop %r failed to initialise (%s); samples that use it will come back with "
                "status 'error', other agent loops are not affected", name, error,
            )

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The HF tokenizer of the served model (``model.tokenizer_path`` or ``model.path``, with
        ``custom_chat_template``), as the workers load it; loaded once in the driver, on first use.
        """
        return load_tokenizer(self.config.model)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Roll out ``prompts`` (a row per sample, ``raw_prompt`` required); padded trajectories.

        ``meta_info["global_steps"]`` (verl's trainer sets it; traces and trajectory info carry it)
        defaults to the version of the weights being served (what :meth:`update_weights` returned
        last; 0 before it). Built on the same worker stream as :meth:`generate_sequences_stream`
        (row ranges instead of groups, put back in the batch's order: each copied into the batch as
        it comes), so both share one fault path (docs/faults.md).
        """
        t0 = time.perf_counter()
        prompts = self.prepare(prompts)
        probes: list[Any] = []  # health probes sent as the last rows arrive: overlap the transfer
        rows = RowAssembler(len(prompts))
        parts = self.workers.run(prompts, on_last=(
            (lambda: probes.append(self.supervisor.probe())) if self._owns_servers else None),
            on_part=lambda first, f: rows.add(first, len(f.group.rows), f.rows))
        failovers = sum(p.stats.server_failovers for p in parts)
        metrics = [m for p in parts for m in p.stats.metrics]  # a list in row order, not folded
        output = rows.join([p.rows for p in parts])
        if probes:
            self.supervisor.check(probes[-1])
        if self.config.engine.free_cache_engine:
            self.sleep()
        output.meta_info["metrics"] = metrics
        timing = performance_metrics(output, time.perf_counter() - t0)
        timing.update(self.faults.take(failovers))
        timing.update(after_last_sample([p.stats.done_at for p in parts]))
        output.meta_info = {**output.meta_info, "timing": timing}
        return output

    def generate_sequences_stream(
        self, prompts: DataProto, group_by: str | None = "uid"
    ) -> Iterator[DataProto]:
        """Roll out ``prompts`` and yield padded mini-batches, one per complete group, in completion
        order.

        A group is every row sharing ``non_tensor_batch[group_by]`` (GRPO's ``uid``: all ``n``
        trajectories of a prompt); ``group_by=None`` or a batch without that column makes each row
        its own group.  A group is yielded once all its samples are done (each exactly once,
        whatever fails: see docs/faults.md), so a trainer can start computing advantages while the
        slowest samples still run.  Each mini-batch has verl's padded layout (same widths as
        :meth:`generate_sequences`), ``meta_info["metrics"]`` for its rows and
        ``meta_info["timing"]`` (``agent_loop/wall`` = seconds since the stream started). Closing
        the iterator early (``break``, ``.close()``) cancels the samples still running and aborts
        their engine requests.  Sync iterator; use it from a thread in async code.
        """
        t0 = time.perf_counter()
        prompts = self.prepare(prompts)
        groups = [Group(rows, key=i) for i, rows in enumerate(split_groups(prompts, group_by))]
        try:
            for part in self.workers.stream(groups, global_steps=prompts.meta_info["global_steps"]):
                rows = part.rows
                rows.meta_info["metrics"] = part.stats.metrics
                timing = performance_metrics(rows, time.perf_counter() - t0)
                timing.update(self.faults.take(part.stats.server_failovers))
                rows.meta_info = {**rows.meta_info, "timing": timing}
                yield rows
        finally:
            if self._owns_servers:
                self.supervisor.check()
            if self.config.engine.free_cache_engine:
                self.sleep()

    def prepare(self, prompts: DataProto) -> DataProto:
        """Check a batch and get ready for it: the one batch check
        (:func:`~agentloop.rollout.samples.check_batch`), gateways started or replaced, servers
        woken, restarted servers put back, the sticky cache grown.  Returns the batch with
        ``meta_info["global_steps"]`` (default: :attr:`weight_version`; a copy, the caller's is left
        as it is).

        Raises:
            DatasetError, UnknownAgentError: the batch check failed (before anything ran).
        """
        if "global_steps" not in prompts.meta_info:  # a copy: the caller's batch is left as it is
            prompts = DataProto(
                batch=prompts.batch, non_tensor_batch=prompts.non_tensor_batch,
                meta_info={**prompts.meta_info, "global_steps": self.weight_version},
            )
        names = check_batch(prompts, self.registry, self.config.agent.default_agent_loop)
        if {ENV_AGENT, SELFPLAY_LOOP} & set(names.tolist()):  # every environment rows name resolves
            rows = batch_rows(prompts.non_tensor_batch, self.config.agent.default_agent_loop)
            check_env_samples(rows, self.config.env)
            check_selfplay_samples(rows, self.config.env)
        if not self.gateways and any(
            self.registry[str(n)].cls.requires_gateway for n in set(names.tolist())
        ):
            self.start_gateways()
        elif self.gateways:
            self.gateway_pool.replace_dead(GatewaySections.of(self.config))
        if self.config.engine.free_cache_engine:
            self.wake_up()
        self.supervisor.poll(self.weight_version)
        self.grow_sticky_cache(2 * len(prompts))
        return prompts

    def grow_sticky_cache(self, entries: int) -> None:
        """Make the shared balancer keep at least ``entries`` request-id -> server bindings (one
        actor call, only when that grows it): ``rollout.server.max_cache_size`` is a floor, so a
        batch larger than it does not evict the bindings of samples still running (their next turn
        would lose its prefix cache).  With worker-local routing (``server.balancer: local``) each
        worker's router keeps its share instead (:func:`~agentloop.rollout.startup.sticky_share`).
        """
        if self.local_routing:
            share = sticky_share(entries, len(self.workers.handles))
            if share > self._sticky_capacity:
                self.workers.broadcast("ensure_cache_capacity", share)
                self._sticky_capacity = share
        elif self.balancer is not None and entries > self._sticky_capacity:
            self._sticky_capacity = int(
                ray.get(self.balancer.ensure_cache_capacity.remote(int(entries)))
            )

    _sticky_capacity: int = 0

    def recover(self, timeout: float = 0.0) -> dict[str, int]:
        """Put back restarted servers and replacement workers that finished starting, waiting up to
        ``timeout`` seconds for them (batches do this themselves, without waiting); returns the
        pool's state: ``servers_down``, ``servers_restarting``, ``servers_awaiting_weights``
        (restarted after a weight update: they rejoin after the next :meth:`update_weights`),
        ``workers``, ``workers_starting``. Restarts begin when a batch finds a server dead (after
        each batch) or a worker dies."""
        self.supervisor.poll(self.weight_version, wait_s=timeout)
        self.workers.poll_replacements(timeout)
        return self.faults.pool_state()

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> AgentLoopManager:
        """verl 0.9's constructor entry point
        (``AgentLoopManager.create(config, llm_client, ...)``): builds the manager and waits for its
        workers, as the constructor does.  Synchronous here (verl's is awaitable)."""
        return cls(*args, **kwargs)

    def clear_kv_cache(self) -> None:
        """Drop every server's prefix (KV) cache, e.g. after a weight update made it stale."""
        self._each_server("clear_kv_cache")

    def _each_server(
        self, method: str, only: list[bool] | None = None, **kwargs: Any
    ) -> dict[int, Any]:
        """``method`` on every serving server; a dead or silent one is restarted, not raised
        (supervisor.each)."""
        return self.weights.each(method, only, **kwargs)

    def engine_busy_seconds(self) -> list[float]:
        """Per server: seconds it had at least one request in its engine since it started (a
        restarted server starts again from 0; a server that cannot answer counts nan).  Two samples'
        difference over the wall time between is the engine-busy fraction
        (:class:`~agentloop.rollout.rollouter.Rollouter` metrics, bench_async)."""
        refs = [s.busy_seconds.remote() for s in self.server_handles]
        out = []
        for ref in refs:
            try:
                out.append(float(ray.get(ref, timeout=30)))
            # a dead or foreign server: unknown, not a failure of the caller
            except Exception:  # noqa: BLE001
                out.append(float("nan"))
        return out

    def start_profile(self, **kwargs: Any) -> None:
        """Start the engines' profilers (vLLM's torch profiler needs ``VLLM_TORCH_PROFILER_DIR``; a
        logged no-op where the engine has none)."""
        self._each_server("start_profile", **kwargs)

    def stop_profile(self) -> None:
        """Stop the engines' profilers and write their traces."""
        self._each_server("stop_profile")

    @property
    def gateways(self) -> list[Any]:
        """The OpenAI gateway actors (empty until the first batch with a gateway agent)."""
        return self.gateway_pool.handles

    def start_gateways(self) -> list[Any]:
        """Start the OpenAI gateway actors (``rollout.gateway``) and hand them to the workers.

        Called automatically before the first batch with a gateway agent; returns the actor handles.
        """
        return self.gateway_pool.start(GatewaySections.of(self.config))

    def pause(self) -> int:
        """Abort every in-flight engine request and hold new ones until :meth:`resume` (e.g. around
        :meth:`update_weights` while a rollout runs in another thread or the
        :class:`~agentloop.rollout.rollouter.Rollouter`).
        With ``async_training.partial_rollout: true`` the routers re-issue each cut request after
        the resume with its tokens so far, so agent loops see one uninterrupted generation
        (docs/concepts.md, "Pause, resume and partial rollouts"); otherwise cut requests end
        ``aborted``.  Returns how many requests were cut."""
        return self.weights.pause()

    def resume(self) -> None:
        """Let the servers run the held and re-issued requests again (after :meth:`pause`)."""
        self.weights.resume()

    def update_weights(
        self, weights: Any, *, global_steps: int | None = None, bucket_mb: float = 512
    ) -> int:
        """Load new policy weights into every server; returns the new weight version.

        Args:
            weights: a state dict or an iterable of ``(name, tensor)`` pairs with HF names (full,
                unsharded tensors, any device), read once and lazily, sent in buckets shared by all
                servers, never as one object (:mod:`agentloop.servers.weight_sync`).
            global_steps: the new version (default: the previous + 1; servers start at 0), which
                later generations report (``extra_fields["global_steps"]``, trajectories'
                ``min_global_steps`` / ``max_global_steps``).
            bucket_mb: the bucket size in MiB.

        Sleeping servers are woken first (and left awake); new requests wait until the update is
        done.  What happens to the requests in flight is ``rollout.server.weight_update``: ``abort``
        (default), ``drain`` or ``keep`` (docs/async.md).  A server that dies, or does not answer a
        step within ``rollout.server.weight_update_timeout`` seconds, is restarted and the update
        goes on with the others (docs/faults.md).

        Raises:
            ServerError: see :meth:`agentloop.rollout.weights.WeightSync.update`.
        """
        return self.weights.update(weights, global_steps=global_steps, bucket_mb=bucket_mb)

    def set_weight_update(self, mode: str) -> None:
        """Switch ``rollout.server.weight_update`` (``abort`` | ``drain`` | ``keep``) for later
        updates, on the manager and every server (refused by a server while requests run on it or an
        update is open).

        Raises:
            ValueError: an unknown mode, or ``keep`` on a backend other than vLLM.
        """
        self.weights.set_mode(mode)
        self.rollout.server.weight_update = mode  # servers restarted later start with it
        # sections rebuilt from the slice
        before, self.config = self.config, dataclasses.replace(self.config)
        if self.servers.config is before:  # servers restarted later are built from the new sections
            self.servers.config = self.config

    def _update_weights_whole(
        self, named_tensors: dict[str, Any], *, global_steps: int | None = None,
        transport: str = "file",
    ) -> int:
        """The pre-streaming path (scripts/bench_weight_sync.py):
        :meth:`WeightSync.update_whole`."""
        return self.weights.update_whole(
            named_tensors, global_steps=global_steps, transport=transport
        )

    @property
    def can_sleep(self) -> bool:
        """Whether every server releases accelerator memory on :meth:`sleep`
        (:attr:`ServerSleep.can_sleep <agentloop.rollout.server_sleep.ServerSleep.can_sleep>`)."""
        return self.server_sleep.can_sleep

    @property
    def sleeping(self) -> bool:
        """Whether the servers are asleep: True from :meth:`sleep` until :meth:`wake_up`.  Always
        False where no server can sleep (nothing was released, so there is nothing to wake)."""
        return self.server_sleep.sleeping

    def wake_up(self) -> None:
        """Wake the servers :meth:`sleep` put to sleep, re-acquiring their memory (no-op when
        none sleeps)."""
        self.server_sleep.wake_up()

    def sleep(self) -> None:
        """Put every server that can sleep to sleep, freeing its accelerator memory.  Servers that
        cannot (``can_sleep`` False) are left running; that is logged once per manager."""
        self.server_sleep.sleep()

    def shutdown(self) -> None:
        """Stop workers, balancer and engines, and release their resources."""
        if hasattr(self, "workers"):
            self.workers.shutdown()
        if hasattr(self, "supervisor"):
            for restart in self.supervisor.restarting.values():
                ray.kill(restart.handle)
        if hasattr(self, "gateway_pool"):
            self.gateway_pool.shutdown()
        if self.balancer is not None:
            ray.kill(self.balancer)
        if self._owns_servers:
            stop_servers(self.servers)
