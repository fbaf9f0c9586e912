"""AgentLoopWorker: runs one agent loop per sample of a batch chunk and pads the results.

A plain class (usable in-process with :class:`agentloop.testing.ScriptedServer`); the manager wraps
it in a Ray actor and the dispatcher streams groups of rows to it: ``generate_sequences_stream``
yields each group's rows and a :class:`WorkerStats` as soon as the group is done;
``generate_sequences`` is that stream collected as one group. Each sample runs
``registry[agent_name](...).run(sampling_params, **fields)`` in its own task (under
``agent.sample_timeout``); an exception or timeout becomes an ``error`` / ``timeout`` row, a failing
scorer marks only its row, so the batch always comes back whole. Rows are padded into verl's
DataProto layout (:func:`agentloop.batch.postprocess.postprocess`). :func:`check_batch` raises
``DatasetError`` / ``UnknownAgentError`` before anything runs.

Spec: docs/concepts.md#one-samples-life; the output layout: docs/concepts.md#the-output-layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from agentloop.batch.multimodal import add_multimodal_outputs
from agentloop.batch.postprocess import postprocess
from agentloop.batch.protocol import DataProto
from agentloop.compat.chat_template import with_list_chat_template
from agentloop.compat.rollout_trace import (
    RolloutTraceConfig,
    rollout_trace_attr,
    select_traced_rows,
)
from agentloop.config import EngineConfig, ModelConfig, MultiTurnConfig, TraceConfig, WorkerSections
from agentloop.errors import DatasetError
from agentloop.loops.base import (
    DictConfigWrap,
    ResolvedAgentLoop,
    ToolListWrap,
    lookup,
    resolve_registry,
)
from agentloop.report.timing import attach_generate_calls, collect_generate_calls
from agentloop.rewards.episode import EpisodeRewardConfig
from agentloop.rewards.scoring import TrajectoryScorer
from agentloop.routing import build_router
from agentloop.routing.tail import make_priority
from agentloop.tokenization.loader import load_processor, load_tokenizer
from agentloop.tools.registry import load_all_tools
from agentloop.trace import enabled as trace_enabled
from agentloop.trace import flush as trace_flush
from agentloop.trace import set_token_decoder
from agentloop.types import AgentLoopOutput, MultiTrajectoryAgentLoopOutput, RolloutStatus
from agentloop.utils.gcheap import freeze_startup_heap
from agentloop.utils.process import restore_normal_priority

if TYPE_CHECKING:
    from agentloop.gateway.actor import GatewayManager

logger = logging.getLogger(__name__)


def load_rollout_tools(multi_turn: MultiTurnConfig) -> list[Any]:
    """The tools of ``multi_turn.tool_config_path`` (and ``function_tool_path``), loaded once per
    process and config (the worker hands them to verl 0.9 loops and to ``tool_agent``)."""
    key = (multi_turn.tool_config_path, multi_turn.function_tool_path)
    if key not in _TOOLS:
        _TOOLS[key] = (
            load_all_tools(tool_config_path=key[0], function_tool_path=key[1]) if any(key) else []
        )
    return _TOOLS[key]


_TOOLS: dict[tuple[Any, Any], list[Any]] = {}


def _start_tracing(trace: TraceConfig) -> int | None:
    """verl's ``rollout.trace``: configure this process's trace recorder; returns how many samples a
    worker traces per step (None: all).  An unsupported backend raises ConfigError (the manager
    reports it)."""
    if trace.backend:
        RolloutTraceConfig.init(
            trace.project_name or "agentloop", trace.experiment_name or "rollout", trace.backend,
            trace.token2text, trace.max_samples_per_step_per_worker,
        )
    return trace.max_samples_per_step_per_worker


def _model_type(model: ModelConfig) -> str | None:
    """``model_type`` of the model's config.json (verl passes it to loops as ``hf_model_type``)."""
    try:
        return json.loads((Path(model.local_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def trajectory_info(index: np.ndarray, step: int, validate: bool) -> list[dict[str, Any]]:
    """verl's trajectory info: ``rollout_n`` counts earlier rows with the same sample index."""
    seen: Counter = Counter()
    out = []
    for idx in index.tolist():
        out.append(
            {"step": step, "sample_index": idx, "rollout_n": seen[idx], "validate": validate}
        )
        seen[idx] += 1
    return out


def agent_names(batch: DataProto, default_agent: str) -> np.ndarray:
    """The per-sample agent names: ``agent_name``, ``default_agent`` where the column or the
    value is absent."""
    given = batch.non_tensor_batch.get("agent_name")
    names = np.empty(len(batch), dtype=object)
    values = given.tolist() if given is not None else [None] * len(batch)
    names[:] = [str(n) if n else default_agent for n in values]
    return names


def check_batch(
    batch: DataProto, registry: dict[str, ResolvedAgentLoop], default_agent: str
) -> np.ndarray:
    """Fail before any generation if ``raw_prompt`` is missing or an ``agent_name`` is unknown.

    Returns the per-sample agent names (:func:`agent_names`).

    Raises:
        DatasetError: no ``raw_prompt`` column.
        UnknownAgentError: an ``agent_name`` is not registered (the message lists the registered
        names).
    """
    if "raw_prompt" not in batch.non_tensor_batch:
        raise DatasetError(
            f"batch has no 'raw_prompt' column (non-tensor keys: "
            f"{sorted(batch.non_tensor_batch)}); "
            "each sample needs its chat messages under non_tensor_batch['raw_prompt']"
        )
    names = agent_names(batch, default_agent)
    for name in set(names.tolist()):
        lookup(registry, str(name))
    return names


@dataclass
class WorkerStats:
    """What a worker reports with a group's rows, besides the rows."""

    server_failovers: int = 0
    """Requests its router moved to another server (a server died) since the previous group."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Per row, in row order: the loop's timing metrics (verl's ``meta_info["metrics"]``)."""

    @classmethod
    def take(cls, rows: DataProto, server_failovers: int = 0) -> WorkerStats:
        """The stats of freshly padded ``rows``: their per-row metrics move out of ``meta_info`` (a
        list per part, which ``DataProto.concat`` would fold into a dict) into the stats."""
        return cls(server_failovers, rows.meta_info.pop("metrics", None) or [])


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

    Raises:
        ConfigError: a bad tool config or reward function (the worker fails to start).
    """

    def __init__(
        self, sections: WorkerSections, trainer_config: DictConfig, server_handles: list[Any],
        balancer: Any = None, registry: dict[str, ResolvedAgentLoop] | None = None,
        tokenizer: Any = None, gateways: list[Any] | None = None, processor: Any = None,
        worker_id: str | None = None,
    ) -> None:
        self.trainer_config = trainer_config
        self.agent, self.engine, model = sections.agent, sections.engine, sections.model_config
        # Ray starts actors at nice 15
        self.priority = restore_normal_priority(self.engine.normal_priority)
        # transformers 4's apply_chat_template(tokenize=True) -> ids, which verl 0.6/0.7 loops rely
        # on
        self.tokenizer = with_list_chat_template(
            tokenizer if tokenizer is not None else load_tokenizer(model)
        )
        self.processor = (processor if processor is not None or tokenizer is not None
                          else load_processor(model, self.tokenizer))
        self.server_manager = build_router(
            sections.router, server_handles, balancer, owner=worker_id
        )
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
        self.hf_model_type = _model_type(model)
        self.init_errors: dict[str, str] = {}
        for entry in self.registry.values():
            self._init_loop_class(entry)
        self._gateways: GatewayManager | None = None
        if gateways:
            self.attach_gateways(gateways)
        self.sample_timeout = self.agent.sample_timeout or None
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.trace_samples = _start_tracing(sections.trace)
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
                "init_errors": dict(self.init_errors), "gc_frozen": self.gc_frozen}

    async def ping(self) -> bool:
        """Answered by this worker's event loop: the pool's mid-batch look for a loop something
        blocks."""
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
        rows.meta_info["metrics"] = stats.metrics
        return rows

    async def generate_sequences_stream(
        self, batch: DataProto, group_starts: list[int], timeout: float | None = None
    ) -> AsyncIterator[tuple[int, DataProto, WorkerStats]]:
        """Roll out ``batch`` (already checked: the dispatcher's caller checks a batch once) and
        yield ``(group, rows, stats)`` for each group as soon as all of its samples are done (a Ray
        streaming generator in the actor).  Groups are contiguous row ranges starting at
        ``group_starts`` (ascending, first 0); an empty group is yielded at once.  Samples still
        running at ``timeout`` seconds are cancelled (``timeout`` rows); closing the stream cancels
        every sample still running (engine requests aborted). ``stats``: the group's per-row metrics
        and the server failovers since the previous group."""
        failovers = self.server_manager.num_failovers
        names, fields, tasks = self._start_samples(batch)
        bounds = [*group_starts, len(batch)]
        # groups whose samples are all done, in that order
        finished: asyncio.Queue[int] = asyncio.Queue()
        waits = [asyncio.gather(*tasks[a:b], return_exceptions=True)
                 for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        for g, wait in enumerate(waits):
            wait.add_done_callback(functools.partial(_put_group, finished, g))
        # at the deadline every sample still running is cancelled: each then finishes as a timeout
        # row
        deadline = (
            asyncio.get_running_loop().call_later(timeout, _cancel, tasks) if timeout else None
        )
        try:
            for _ in waits:
                g = await finished.get()
                # the mlflow backend writes from a thread: done before the group is
                if trace_enabled():
                    await asyncio.to_thread(trace_flush)
                a, b = bounds[g], bounds[g + 1]
                results = [_result_of(task, timeout) for task in tasks[a:b]]
                rows = self._postprocess(
                    results, {k: v[a:b] for k, v in fields.items()}, names[a:b]
                )
                before, failovers = failovers, self.server_manager.num_failovers
                yield g, rows, WorkerStats.take(rows, failovers - before)
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
        for i in range(len(batch)):
            sample = {k: v[i] for k, v in fields.items()}
            sample["agent_name"] = str(names[i])
            infos[i]["trace"] = i in traced
            tasks.append(
                asyncio.create_task(self._sample(str(names[i]), sampling_params, sample, infos[i]))
            )
        return names, fields, tasks

    async def _sample(
        self, name: str, sampling_params: dict[str, Any], sample: dict[str, Any],
        info: dict[str, Any],
    ) -> list[AgentLoopOutput]:
        """One sample: its loop run as one episode (:func:`_episode`; an error row when it failed),
        then each trajectory given its reward (:mod:`agentloop.rewards.scoring`).  With
        ``agent.record_timing`` each engine call's server and times go on the first trajectory
        (``generate_calls``, for ``agentloop report``)."""
        with collect_generate_calls() if self.record_timing else contextlib.nullcontext() as calls:
            episode = _episode(await self._run_loop(name, sampling_params, sample, info), name)
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
            return [
                _failed(
                    RolloutStatus.ERROR,
                    f"agent loop {name!r} "
                    f"({entry.cls.__qualname__}) failed to "
                    f"initialise: {self.init_errors[name]}",
                )
            ]
        try:
            loop = entry.cls(*self._loop_args, **{**self._loop_kwargs, **entry.kwargs})
            coro = loop.run(dict(sampling_params), trajectory_info=info, **sample)
            with rollout_trace_attr(
                step=info["step"], sample_index=info["sample_index"], rollout_n=info["rollout_n"],
                validate=info["validate"], name="agent_loop", trace=bool(info.get("trace")),
            ):
                output = await (asyncio.wait_for(coro, timeout) if timeout else coro)
        except asyncio.TimeoutError:
            logger.warning(
                "sample %s (%s) timed out after %ss", info["sample_index"], name, timeout
            )
            return [
                _failed(
                    RolloutStatus.TIMEOUT, f"agent loop {name!r} exceeded sample_timeout={timeout}s"
                )
            ]
        except Exception as e:  # noqa: BLE001 - a failed sample is data, not a crash
            logger.warning("sample %s (%s) failed: %r", info["sample_index"], name, e)
            return [_failed(RolloutStatus.ERROR, f"{type(e).__name__}: {e}")]
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
        )
        # multi_modal_inputs; M-RoPE position_ids
        return add_multimodal_outputs(batch, self.processor)


def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks still running."""
    for task in tasks:
        if not task.done():
            task.cancel()


def _result_of(task: asyncio.Task, timeout: float | None) -> list[AgentLoopOutput]:
    """A finished sample task's outputs; a cancelled one (deadline) is a ``timeout`` row, one that
    raised (a bug outside the loop's own error handling) an ``error`` row."""
    if task.cancelled():
        return [
            _failed(
                RolloutStatus.TIMEOUT,
                f"the batch deadline (agent.batch_timeout) "
                f"passed after "
                f"{timeout or 0:.0f}s with this sample still "
                f"running",
            )
        ]
    e = task.exception()
    if e is not None:
        logger.error("a sample task failed outside its agent loop: %r", e)
        return [_failed(RolloutStatus.ERROR, f"{type(e).__name__}: {e}")]
    return task.result()


def error_batch(chunk: DataProto, status: RolloutStatus, message: str, *, engine: EngineConfig,
                calculate_log_probs: bool, pad_token_id: int, default_agent: str) -> DataProto:
    """The rows of ``chunk`` when no worker could roll them out (its worker died and retries ran
    out, or it hung past the batch deadline): one ``status`` row per sample with ``message``, in
    verl's padded layout (the ``engine`` section's lengths), keeping each sample's non-tensor fields
    (uid, index...)."""
    fields = {k: v for k, v in chunk.non_tensor_batch.items()}
    fields["agent_name"] = agent_names(chunk, default_agent)
    output = postprocess(
        [_failed(status, message) for _ in range(len(chunk))],
        prompt_length=engine.prompt_length, response_length=engine.response_length,
        pad_token_id=pad_token_id, sample_fields=fields, calculate_log_probs=calculate_log_probs,
        rewards_configured=False,
    )
    return output


def _episode(output: Any, name: str) -> MultiTrajectoryAgentLoopOutput:
    """What a loop returned (an AgentLoopOutput, a list of them or a MultiTrajectoryAgentLoopOutput)
    as one episode of checked trajectories; anything else is one error row.  Every trajectory gets
    the episode's ``session_id`` in ``extra_fields``: the episode's own, else one a trajectory
    carries (the first), else a fresh one."""
    episode = output if isinstance(output, MultiTrajectoryAgentLoopOutput) else None
    if episode is not None:
        outputs = episode.trajectories
    elif isinstance(output, list):
        outputs = output
    else:
        outputs = [output]
    if not outputs or not all(isinstance(o, AgentLoopOutput) for o in outputs):
        msg = (
            f"agent loop {name!r} returned {type(output).__name__}; expected "
            f"AgentLoopOutput, a list of them or "
            "a MultiTrajectoryAgentLoopOutput"
        )
        outputs, episode = [_failed(RolloutStatus.ERROR, msg)], None
    outputs = [_checked(o, name) for o in outputs]
    given = [
        o.extra_fields.get("session_id")
        for o in outputs
        if o.extra_fields.get("session_id") is not None
    ]
    if episode is not None and episode.session_id is not None:
        session_id = str(episode.session_id)
    elif given:
        session_id = str(given[0])
    else:
        session_id = uuid.uuid4().hex
    for o in outputs:
        o.extra_fields = {**o.extra_fields, "session_id": session_id}
    if episode is None:
        return MultiTrajectoryAgentLoopOutput(trajectories=outputs, session_id=session_id)
    return episode.model_copy(update={"trajectories": outputs, "session_id": session_id})


def _checked(output: AgentLoopOutput, name: str) -> AgentLoopOutput:
    """The output, or an error row when its per-token lists disagree in length (one bad trajectory
    must not fail its neighbours' padding)."""
    n = len(output.response_ids)
    problem = None
    if len(output.response_mask) != n:
        problem = f"response_mask has {len(output.response_mask)} entries for {n} response ids"
    elif output.response_logprobs is not None and len(output.response_logprobs) != n:
        problem = (
            f"response_logprobs has {len(output.response_logprobs)} entries for {n} response ids"
        )
    if problem is None:
        return output
    logger.warning("agent loop %r returned a malformed trajectory: %s", name, problem)
    return _failed(
        RolloutStatus.ERROR,
        f"agent loop {name!r} returned a malformed "
        f"trajectory: {problem} (one "
        "mask value and, with log-probs, one log-prob per "
        "response token)",
    )


def _failed(status: RolloutStatus, message: str) -> AgentLoopOutput:
    return AgentLoopOutput(
        prompt_ids=[], response_ids=[], response_mask=[], status=status, error=message
    )


def _put_group(finished: asyncio.Queue[int], group: int, _: Any) -> None:
    """Done-callback of a group's gather: queue the group as finished."""
    finished.put_nowait(group)
