"""AgentLoopWorker: runs one agent loop per sample of a batch chunk and pads the results.

A plain class (usable in-process with :class:`agentloop.testing.ScriptedServer`); the manager wraps
it in a Ray actor and the dispatcher streams groups of rows to it: ``generate_sequences_stream``
yields each group's rows and a :class:`WorkerStats` as soon as the group is done;
``generate_sequences`` is that stream collected as one group. Each sample runs
``registry[agent_name](...).run(sampling_params, **fields)`` in its own task (under
``agent.sample_timeout``); an exception or timeout becomes an ``error`` / ``timeout`` row, a failing
scorer marks only its row, so the batch always comes back whole. Rows are padded into verl's
DataProto layout (:func:`agentloop.batch.postprocess.postprocess`). :func:`check_batch` raises
``DatasetError`` / ``UnknownAgentError`` before anything runs.  The batch check and per-sample
info: :mod:`agentloop.rollout.samples`; a loop's result as trajectories or failed rows:
:mod:`agentloop.rollout.episodes`; the process's set-up: :mod:`agentloop.rollout.worker_setup`.

Spec: docs/concepts.md#one-samples-life; the output layout: docs/concepts.md#the-output-layout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from agentloop.batch.multimodal import add_multimodal_outputs
from agentloop.batch.postprocess import postprocess
from agentloop.batch.protocol import DataProto
from agentloop.batch.wire_runs import EncodedRows
from agentloop.compat.chat_template import with_list_chat_template
from agentloop.compat.rollout_trace import (
    RolloutTraceConfig,
    rollout_trace_attr,
    select_traced_rows,
)
from agentloop.config import ModelConfig, WorkerSections
from agentloop.config.routing_replay import check_routing_replay
from agentloop.loops.base import (
    DictConfigWrap,
    LoopInstances,
    ResolvedAgentLoop,
    ToolListWrap,
    resolve_registry,
)
from agentloop.report.timing import attach_generate_calls, collect_generate_calls
from agentloop.rewards.episode import EpisodeRewardConfig
from agentloop.rewards.scoring import TrajectoryScorer
from agentloop.rollout.episodes import (
    error_batch,
    failed_output,
    loop_failure,
    task_outputs,
    to_episode,
)
from agentloop.rollout.group_padding import GroupPadder
from agentloop.rollout.result_channel import ResultSender
from agentloop.rollout.samples import agent_names, check_batch, trajectory_info
from agentloop.rollout.worker_setup import hf_model_type, load_rollout_tools, start_tracing
from agentloop.routing import build_router
from agentloop.routing.tail import make_priority
from agentloop.tokenization.loader import load_processor, load_tokenizer
from agentloop.trace import enabled as trace_enabled
from agentloop.trace import flush as trace_flush
from agentloop.trace import set_token_decoder
from agentloop.types import AgentLoopOutput, RolloutStatus
from agentloop.utils.deadline import within
from agentloop.utils.gcheap import freeze_startup_heap
from agentloop.utils.process import restore_normal_priority

if TYPE_CHECKING:
    from agentloop.gateway.actor import GatewayManager

logger = logging.getLogger(__name__)

# moved to agentloop.rollout.samples / episodes / worker_setup; importable from here as before
__all__ = [
    "AgentLoopWorker", "WorkerStats", "agent_names", "check_batch", "error_batch",
    "load_rollout_tools", "trajectory_info",
]


@dataclass
class WorkerStats:
    """What a worker reports with a group's rows, besides the rows."""

    server_failovers: int = 0
    """Requests its router moved to another server (a server died) since the previous group."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Per row, in row order: the loop's timing metrics (verl's ``meta_info["metrics"]``)."""
    done_at: float = 0.0
    """When the group's last sample finished (``time.time()``, its task's end; runs of its rows
    may be padded before that, :mod:`agentloop.rollout.group_padding`); 0.0 for rows no worker
    rolled out."""

    @classmethod
    def take(
        cls, rows: DataProto | EncodedRows, server_failovers: int = 0, done_at: float = 0.0
    ) -> WorkerStats:
        """The stats of freshly padded ``rows``: their per-row metrics move out of ``meta_info`` (a
        list per part, which ``DataProto.concat`` would fold into a dict) into the stats."""
        return cls(server_failovers, rows.meta_info.pop("metrics", None) or [], done_at)


class AgentLoopWorker:
    """Runs agent loops for a chunk of samples.

    Args:
        sections: the typed sections it reads (``WorkerSections.of(cfg)``, built once in the
        driver). trainer_config: the whole trainer-shaped config (``data`` included) that verl loops
        receive as
            ``trainer_config`` / ``self.config`` (verl's contract: the worker only hands it on).
        server_handles: server actor handles (or in-process LLMServer objects).
        balancer: a GlobalBalancer actor handle or a local Balancer; None builds a local one.
        registry: resolved agent loops (the manager passes the driver's, so loops registered in the
            driver's ``__main__`` work too); None resolves it here.
        tokenizer: pass one to skip loading it from the model section.
        gateways: gateway actor handles, for loops that declare ``requires_gateway``.
        processor: a HF processor for multimodal models (default: loaded for multimodal models
        only). worker_id: the owner id of this worker's in-flight slots in the shared balancer (the
        manager
            releases them if this worker dies); default: a fresh id.
        down_servers: servers already out of routing when it starts (worker-local routing: a
            replacement worker joining while a server restarts).

    Raises:
        ConfigError: a bad tool config or reward function (the worker fails to start).
    """

    def __init__(
        self, sections: WorkerSections, trainer_config: DictConfig, server_handles: list[Any],
        balancer: Any = None, registry: dict[str, ResolvedAgentLoop] | None = None,
        tokenizer: Any = None, gateways: list[Any] | None = None, processor: Any = None,
        worker_id: str | None = None, down_servers: tuple[int, ...] = (),
    ) -> None:
        self.trainer_config = trainer_config
        self.agent, self.engine, model = sections.agent, sections.engine, sections.model_config
        # Ray starts actors at nice 15
        self.priority = restore_normal_priority(self.engine.normal_priority)
        # transformers 4's apply_chat_template(tokenize=True) -> ids, which verl 0.6/0.7 loops
        # rely on
        self.tokenizer = with_list_chat_template(
            tokenizer if tokenizer is not None else load_tokenizer(model)
        )
        self.processor = (processor if processor is not None or tokenizer is not None
                          else load_processor(model, self.tokenizer))
        self.server_manager = build_router(
            sections.router, server_handles, balancer, owner=worker_id
        )
        for index in down_servers:
            self.server_manager.mark_down(index)
        self.worker_id = worker_id or ""
        self.results: ResultSender | None = None
        """The connection to the driver's result channel (:meth:`connect_results`), if any."""
        self.sampling = {False: sections.sampling, True: sections.val_sampling}
        """Sampling by ``meta_info["validate"]`` (verl's ``val_kwargs`` when validating)."""
        self.record_timing = bool(self.agent.record_timing)
        self.registry = (
            registry
            if registry is not None
            else resolve_registry(self.agent.agent_loop_config_path)
        )
        # once per worker (verl 0.9); a bad config fails here
        self.tools = load_rollout_tools(sections.multi_turn)
        self.hf_model_type = hf_model_type(model)
        self.routed_experts_shape = check_routing_replay(self.engine, model)  # R3 column's shape
        self.init_errors: dict[str, str] = {}
        for entry in self.registry.values():
            self._init_loop_class(entry)
        self._gateways: GatewayManager | None = None
        if gateways:
            self.attach_gateways(gateways)
        self.sample_timeout = self.agent.sample_timeout or None
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.trace_samples = start_tracing(sections.trace)
        if RolloutTraceConfig.enable_token2text():  # generate spans carry the decoded response
            set_token_decoder(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
        # custom_reward_function (top level, verl's): imported once here, so a bad path fails the
        # worker's start
        episode = EpisodeRewardConfig.checked(
            sections.multi_turn.reward_to, sections.multi_turn.reward_gamma
        )
        self.rewards = TrajectoryScorer(
            sections.reward, self.tokenizer, self.engine.response_length, episode
        )
        self._loop_args = (
            DictConfigWrap(trainer_config), self.server_manager, self.tokenizer, self.processor,
        )
        self._loop_kwargs = {
            "dataset_cls": None, "data_config": DictConfigWrap(trainer_config.get("data") or {}),
            "hf_model_type": self.hf_model_type, "tools": ToolListWrap(self.tools),
        }
        self._loops = LoopInstances(self._loop_args, self._loop_kwargs)
        # last: everything start-up made stays out of full GCs
        self.gc_frozen = freeze_startup_heap(self.engine)

    @classmethod
    def from_slices(cls, rollout: Any, model: Any, server_handles: list[Any], *args: Any,
                    trainer_config: DictConfig | None = None, **kwargs: Any) -> AgentLoopWorker:
        """A worker from the ``rollout`` / ``model`` config slices (tests, in-process use; absent
        keys take the YAML's values).  The model section comes from ``model``, the others from
        ``trainer_config`` when given, else from ``rollout``; verl loops receive ``trainer_config``,
        else one holding just ``rollout`` and ``model``.  ``args`` / ``kwargs``: the constructor's
        arguments after ``server_handles``."""
        root = trainer_config if trainer_config is not None else OmegaConf.create(
            {"actor_rollout_ref": {"rollout": rollout, "model": model}, "data": {}})
        sections = dataclasses.replace(
            WorkerSections.from_root(root),
            model_config=ModelConfig.from_root({"actor_rollout_ref": {"model": model}}),
        )
        return cls(sections, root, server_handles, *args, **kwargs)

    def _init_loop_class(self, entry: ResolvedAgentLoop, **extra: Any) -> None:
        """verl's once-per-class set-up; a failure is kept, named, and fails only that loop's
        samples."""
        kwargs = dict(entry.kwargs, **extra)
        if entry.cls.init_class_takes_tools:
            kwargs["tools"] = ToolListWrap(self.tools)
        try:
            entry.cls.init_class(
                config=self.trainer_config, tokenizer=self.tokenizer, processor=self.processor,
                **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - reported per loop; unrelated loops keep working
            self.init_errors[entry.name] = f"{type(e).__name__}: {e}"
            logger.warning(
                "agent loop %r (%s) failed in init_class: %r; its samples will "
                "fail with this error",
                entry.name,
                entry.cls.__qualname__,
                e,
            )
            return
        entry.cls._class_initialized = True

    def ready(self) -> dict[str, Any]:
        """Returns once the worker is constructed (tokenizer loaded, loop classes initialised)."""
        return {"pid": os.getpid(), "priority": self.priority, "agent_loops": sorted(self.registry),
                "init_errors": dict(self.init_errors), "gc_frozen": self.gc_frozen,
                "gc_threshold": gc.get_threshold()[0]}

    async def ping(self) -> bool:
        """Answered by this worker's event loop: the pool's mid-batch look for a loop something
        blocks."""
        return True

    async def connect_results(self, host: str, port: int, authkey: bytes) -> bool:
        """Connect to the driver's result channel (``agent.result_channel: tcp``); False (rows
        then go through Ray's stream, as with ``ray``) when it cannot be reached."""
        sender = ResultSender(host, port, authkey, self.worker_id)
        try:
            await sender.connect()
        except (OSError, TimeoutError) as e:
            logger.warning("agent-loop worker %s cannot reach the driver's result channel at "
                           "%s:%d (%s); its rows go through Ray", self.worker_id, host, port, e)
            return False
        if self.results is not None:
            self.results.close()
        self.results = sender
        return True

    def attach_gateways(self, gateways: list[Any]) -> None:
        """Give loops that declare ``requires_gateway`` a GatewayManager over these gateway
        actors."""
        # heavy (the gateway's HTTP stack, fastapi): loaded only once a batch uses a gateway agent
        from agentloop.gateway.actor import GatewayManager

        manager = GatewayManager(gateways)
        for entry in self.registry.values():
            if entry.cls.requires_gateway:
                self._init_loop_class(entry, gateway_manager=manager)
        self._gateways = manager

    def gateway_lost(self, index: int, reason: str) -> None:
        """The manager is killing gateway ``index`` (e.g. it hung): the rows of this worker's
        sessions on it say ``reason``."""
        if self._gateways is not None:
            self._gateways.lost(index, reason)

    def replace_server(self, index: int, handle: Any) -> None:
        """Route to ``handle`` as server ``index`` from now on (the manager restarted a dead
        server)."""
        self.server_manager.replace_server(index, handle)

    def mark_server_down(self, index: int) -> None:
        """Stop routing to server ``index`` (the manager found it dead; worker-local routing)."""
        self.server_manager.mark_down(index)

    def ensure_cache_capacity(self, entries: int) -> int:
        """Grow this worker's own sticky cache (worker-local routing) to at least ``entries``
        bindings; returns its capacity (0 with the shared balancer actor)."""
        return self.server_manager.ensure_cache_capacity(entries)

    def set_priority(self, policy: str | None) -> None:
        """Switch this worker's engine priority policy (``rollout.server.priority``; null: send
        none).  A policy needs engines started with it set (vLLM ``scheduling_policy: priority``).
        """
        self.server_manager.priority = make_priority(policy)

    async def generate_sequences(self, batch: DataProto, timeout: float | None = None) -> DataProto:
        """Roll out every sample of ``batch`` in this process; returns the padded DataProto (one row
        per trajectory, ``meta_info["metrics"]`` per row).  The stream below, collected as one
        group.

        ``timeout``: seconds after which samples still running are cancelled (engine requests
        aborted) and come back with status ``timeout``.

        Raises:
            DatasetError, UnknownAgentError: the batch check (:func:`check_batch`) failed; nothing
            ran.
        """
        check_batch(batch, self.registry, self.agent.default_agent_loop)
        parts = [
            (rows, stats)
            async for _, rows, stats in self.generate_sequences_stream(batch, [0], timeout)
        ]
        rows, stats = parts[0]
        assert isinstance(rows, DataProto)  # not encoded: encoded=False
        rows.meta_info["metrics"] = stats.metrics
        return rows

    async def generate_sequences_stream(
        self, batch: DataProto, group_starts: list[int], timeout: float | None = None,
        encoded: bool = False, channel_token: int | None = None,
    ) -> AsyncIterator[tuple[int, DataProto | EncodedRows, WorkerStats]]:
        """Roll out ``batch`` (already checked: the dispatcher's caller checks a batch once) and
        yield ``(group, rows, stats)`` for each group as soon as all of its samples are done (a Ray
        streaming generator in the actor).  Groups are contiguous row ranges starting at
        ``group_starts`` (ascending, first 0); an empty group is yielded at once.  Samples still
        running at ``timeout`` seconds are cancelled (``timeout`` rows); closing the stream cancels
        every sample still running (engine requests aborted). ``stats``: the group's per-row metrics
        and the server failovers since the previous group.  ``encoded`` (the dispatcher's stream
        to the driver): a group may come as :class:`~agentloop.batch.wire_runs.EncodedRows`, its
        runs encoded for the wire while the rest ran, which loads as the DataProto.
        ``channel_token``: each group is sent on the result channel (:meth:`connect_results`) as
        that dispatch's frame instead of yielded; yielded only when it cannot be sent."""
        failovers = self.server_manager.num_failovers
        names, fields, tasks = self._start_samples(batch)
        bounds = [*group_starts, len(batch)]
        # groups whose samples are all done, in that order (counted by the padder's done-callback
        # per sample: no gather, one callback per sample less)
        finished: asyncio.Queue[int] = asyncio.Queue()
        # at the deadline every sample still running is cancelled: each then finishes as a
        # timeout row
        deadline = (
            asyncio.get_running_loop().call_later(timeout, _cancel, tasks) if timeout else None
        )

        def pad(a: int, b: int) -> DataProto:
            results = [task_outputs(task, timeout) for task in tasks[a:b]]
            return self._postprocess(results, {k: v[a:b] for k, v in fields.items()}, names[a:b])

        # runs of finished samples padded while the rest run (not with tracing, which flushes
        # before a group is padded, nor with a processor, which adds columns per group)
        early = not trace_enabled() and self.processor is None
        padder = GroupPadder(
            tasks, bounds, pad, early=early, encode=encoded, on_done=finished.put_nowait
        )
        try:
            for _ in group_starts:
                g = await finished.get()
                # the mlflow backend writes from a thread: done before the group is
                if trace_enabled():
                    await asyncio.to_thread(trace_flush)
                rows, done_at = padder.take(g)
                before, failovers = failovers, self.server_manager.num_failovers
                stats = WorkerStats.take(rows, failovers - before, done_at)
                if channel_token is not None and self.results is not None and (
                    await self.results.send(channel_token, (g, rows, stats))
                ):
                    continue
                yield g, rows, stats
        finally:
            if deadline is not None:
                deadline.cancel()
            _cancel(tasks)

    def _start_samples(
        self, batch: DataProto
    ) -> tuple[np.ndarray, dict[str, np.ndarray], list[asyncio.Task]]:
        """Start one task per sample; returns the agent names, the fields and the tasks."""
        names = agent_names(batch, self.agent.default_agent_loop)
        validate = bool(batch.meta_info.get("validate", False))
        sampling_params = self.sampling[validate].params()
        index = batch.non_tensor_batch.get("index", np.arange(len(batch)))
        infos = trajectory_info(
            np.asarray(index), int(batch.meta_info.get("global_steps", -1)), validate
        )
        fields = {k: v for k, v in batch.non_tensor_batch.items()}
        traced = (
            select_traced_rows(np.asarray(index).tolist(), self.trace_samples)
            if trace_enabled()
            else set()
        )
        tasks = []
        keys = list(fields)
        # each row's values as ``v[i]`` gives them (``list`` of an array walks it the same way),
        # zipped per row: one pass per column instead of an index per cell
        columns = [list(v) for v in fields.values()]
        rows = zip(*columns, strict=True) if keys else ((),) * len(batch)
        for i, (values, name) in enumerate(zip(rows, names.tolist(), strict=True)):
            sample = dict(zip(keys, values, strict=False))  # one value per key
            sample["agent_name"] = name = str(name)
            infos[i]["trace"] = i in traced
            tasks.append(asyncio.create_task(self._sample(name, sampling_params, sample, infos[i])))
        return names, fields, tasks

    async def _sample(
        self, name: str, sampling_params: dict[str, Any], sample: dict[str, Any],
        info: dict[str, Any],
    ) -> list[AgentLoopOutput]:
        """One sample: its loop run as one episode
        (:func:`~agentloop.rollout.episodes.to_episode`; an error row when it failed), then each
        trajectory given its reward (:mod:`agentloop.rewards.scoring`).  With
        ``agent.record_timing`` each engine call's server and times go on the first trajectory
        (``generate_calls``, for ``agentloop report``)."""
        if self.record_timing or self.sample_timeout or name in self.init_errors or trace_enabled():
            return await self._sample_traced(name, sampling_params, sample, info)
        # the hot path in one coroutine: the loop awaited here; a sample with nothing to score
        # is not scored in a coroutine of its own
        entry = self.registry[name]
        try:
            loop = self._loops.new(entry)
            output = await loop.run(dict(sampling_params), trajectory_info=info, **sample)
        except Exception as e:  # noqa: BLE001 - a failed sample is data, not a crash
            output = loop_failure(e, name, info["sample_index"], self.sample_timeout)
        episode = to_episode(output, name)
        unscored = self.rewards.unscored(episode)
        return unscored if unscored is not None else await self.rewards.score(episode, sample)

    async def _sample_traced(
        self, name: str, sampling_params: dict[str, Any], sample: dict[str, Any],
        info: dict[str, Any],
    ) -> list[AgentLoopOutput]:
        """:meth:`_sample` with a timer, a trace, a ``sample_timeout`` or a loop's init error."""
        with collect_generate_calls() if self.record_timing else nullcontext() as calls:
            episode = to_episode(await self._run_loop(name, sampling_params, sample, info), name)
        if calls is not None:
            attach_generate_calls(episode, calls)
        return await self.rewards.score(episode, sample)

    async def _run_loop(
        self, name: str, sampling_params: dict[str, Any], sample: dict[str, Any],
        info: dict[str, Any],
    ) -> Any:
        """What the sample's loop returned, or one failed row (init error, ``sample_timeout``, an
        exception)."""
        entry = self.registry[name]
        timeout = self.sample_timeout
        if name in self.init_errors:
            why = f"({entry.cls.__qualname__}) failed to initialise: {self.init_errors[name]}"
            return [failed_output(RolloutStatus.ERROR, f"agent loop {name!r} {why}")]
        try:
            loop = self._loops.new(entry)
            coro = loop.run(dict(sampling_params), trajectory_info=info, **sample)
            if not trace_enabled():
                output = await (within(coro, timeout) if timeout else coro)
            else:
                with rollout_trace_attr(
                    step=info["step"], sample_index=info["sample_index"],
                    rollout_n=info["rollout_n"], validate=info["validate"], name="agent_loop",
                    trace=bool(info.get("trace")),
                ):
                    output = await within(coro, timeout)
        except Exception as e:  # noqa: BLE001 - a failed sample is data, not a crash
            return loop_failure(e, name, info["sample_index"], timeout)
        return output

    def _postprocess(
        self, results: list[list[AgentLoopOutput]], fields: dict[str, np.ndarray], names: np.ndarray
    ) -> DataProto:
        rows = np.array([i for i, outs in enumerate(results) for _ in outs], dtype=np.int64)
        flat = [o for outs in results for o in outs]
        sample_fields = {k: v[rows] for k, v in fields.items()}
        sample_fields["agent_name"] = np.asarray(names, dtype=object)[rows]
        batch = postprocess(
            flat, trajectory_counts=[len(outs) for outs in results],
            prompt_length=self.engine.prompt_length, response_length=self.engine.response_length,
            pad_token_id=self.pad_token_id, sample_fields=sample_fields,
            calculate_log_probs=self.sampling[False].calculate_log_probs,
            rewards_configured=self.rewards.configured,
            routed_experts_shape=self.routed_experts_shape,
        )
        # multi_modal_inputs; M-RoPE position_ids
        return add_multimodal_outputs(batch, self.processor)


def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks still running."""
    for task in tasks:
        if not task.done():
            task.cancel()

