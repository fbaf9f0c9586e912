"""agentloop's AgentLoopManager in verl 0.9's own trainer (``RayPPOTrainer``).

verl 0.9.1's trainer starts its rollout servers itself (``LLMServerManager``: vLLM / SGLang
replicas on the actor workers, slept, woken and given new weights by verl's checkpoint engine) and
then builds the agent-loop manager from the class named by
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``::

    manager_cls.create(config=..., llm_client=..., teacher_client=...,
                       reward_loop_worker_handles=...)

:class:`VerlTrainerManager` is that class: agentloop's manager (workers, loops, batch layout) over
verl's ``llm_client``.  verl's client is reached through one :class:`VerlClientServer` actor that
speaks agentloop's server protocol, so routing, sticky sessions, sleep / wake and weight updates
stay verl's.  ``python -m agentloop.compat.verl_main`` sets the key (docs/porting-from-verl.md,
"verl's own trainer").
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.errors import ServerError
from agentloop.rollout.manager import AgentLoopManager
from agentloop.routing import AsyncLLMServerManager
from agentloop.servers.base import GenerateBatcher, PauseGate
from agentloop.types import StopReason, TokenOutput

logger = logging.getLogger(__name__)

MANAGER_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
"""verl 0.9's config key naming the agent-loop manager class its trainer builds."""

MANAGER_FQN = "agentloop.compat.verl_trainer.VerlTrainerManager"
"""The value of :data:`MANAGER_KEY` that selects agentloop's manager."""

_BRIDGE_CONCURRENCY = 10_000
"""Calls the bridge actor runs at once (each awaits verl's client; verl's servers queue them)."""


def _token_output(out: Any, max_tokens: int | None) -> TokenOutput:
    """verl's TokenOutput (or agentloop's) as agentloop's; ``length`` when ``max_tokens`` ids came
    back (verl's servers report ``completed`` for both stop and length)."""
    if isinstance(out, TokenOutput):
        return out
    ids = [int(t) for t in out.token_ids]
    reason: Any = out.stop_reason
    if reason in (None, "completed") and max_tokens is not None and len(ids) >= max_tokens:
        reason = StopReason.LENGTH
    return TokenOutput(
        token_ids=ids,
        log_probs=None if out.log_probs is None else [float(x) for x in out.log_probs],
        routed_experts=getattr(out, "routed_experts", None),
        stop_reason=reason,
        num_preempted=getattr(out, "num_preempted", None) or 0,
        extra_fields=dict(getattr(out, "extra_fields", None) or {}),
    )


class VerlClientServer:
    """agentloop's server protocol (:class:`~agentloop.servers.base.LLMServer`) over verl 0.9's
    ``LLMServerClient``: ``generate`` goes to verl's client, which picks verl's server.

    Sleep, wake-up, weight updates and KV-cache resets are verl's checkpoint engine's job in verl's
    trainer: here they are no-ops (``supports_sleep`` False) or refused (weight updates).

    Args:
        client: verl's ``LLMServerClient`` (anything with verl's async ``generate``).
    """

    supports_sleep = False

    def __init__(self, client: Any) -> None:
        self.client = client
        self.gate = PauseGate()
        self.batcher = GenerateBatcher(self.generate)
        self.global_steps = 0

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None, video_data: list[Any] | None = None,
    ) -> TokenOutput:
        """One generation through verl's client; returns agentloop's TokenOutput.

        Raises:
            ServerError: verl's client or server failed (the message names the cause)."""
        async with self.gate.admitted(request_id):
            try:
                out = await self.client.generate(
                    request_id, prompt_ids=list(prompt_ids), sampling_params=dict(sampling_params),
                    image_data=image_data, video_data=video_data,
                )
            except Exception as e:  # noqa: BLE001 - any failure of verl's side is a server error
                raise ServerError(f"verl's llm_client failed: {type(e).__name__}: {e}") from e
        return _token_output(out, sampling_params.get("max_tokens"))

    async def generate_batch(
        self, requests: list[dict[str, Any]]
    ) -> AsyncIterator[list[tuple[int, Any]]]:
        """Many :meth:`generate` calls in one (see :class:`GenerateBatcher`)."""
        async for group in self.batcher.run(requests):
            yield group

    def busy_seconds(self) -> float:
        """Seconds with at least one request in flight."""
        return self.gate.busy_seconds()

    async def abort(self, request_id: str) -> None:
        """verl's client cannot abort one request; a no-op."""

    async def pause(self, for_update: bool = False) -> int:
        """Not supported through verl's client: returns 0 (nothing cut)."""
        return 0

    async def resume(self) -> None:
        """No-op (see :meth:`pause`)."""

    async def wake_up(self) -> None:
        """No-op: verl's checkpoint engine wakes its servers."""

    async def sleep(self) -> None:
        """No-op: verl's checkpoint engine puts its servers to sleep."""

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the weight version (verl's servers tag their outputs themselves)."""
        self.global_steps = int(global_steps)

    async def clear_kv_cache(self) -> None:
        """No-op: verl's servers reset their caches on weight updates."""

    async def start_profile(self, **kwargs: Any) -> None:
        """No-op: verl's trainer profiles its servers itself."""

    async def stop_profile(self) -> None:
        """No-op (see :meth:`start_profile`)."""

    async def update_weights(self, named_tensors: Any, global_steps: int | None = None) -> Any:
        """Refused: in verl's trainer the checkpoint engine updates verl's servers.

        Raises:
            ServerError: always."""
        raise ServerError("weights of verl's servers are updated by verl's checkpoint engine")


def _without_manager_key(config: Any) -> Any:
    """A copy of a trainer config without :data:`MANAGER_KEY` when it names this class (it is
    verl's switch, not a rollout setting); other configs are returned as they are."""
    if not isinstance(config, DictConfig):
        return config
    agent = OmegaConf.select(config, "actor_rollout_ref.rollout.agent")
    if agent is None or agent.get("agent_loop_manager_class") != MANAGER_FQN:
        return config
    copy = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    copy.actor_rollout_ref.rollout.agent.pop("agent_loop_manager_class")
    return copy


def _as_agentloop(batch: Any) -> DataProto:
    """verl's DataProto (or agentloop's) as agentloop's, sharing its tensors and arrays."""
    if isinstance(batch, DataProto):
        return batch
    return DataProto(
        batch=batch.batch, non_tensor_batch=dict(batch.non_tensor_batch),
        meta_info=dict(batch.meta_info),
    )


def score_with_verl_workers(out: Any, workers: list[Any]) -> None:
    """Score every row of ``out`` (verl's DataProto) with verl's reward-loop workers, in place.

    Rows are split into contiguous slices, one ``compute_score_batch`` call per worker; each row's
    ``reward_score`` goes on its last response token of ``rm_scores`` (rows without response tokens
    score 0), its ``reward_extra_info`` into a non-tensor column per key, named in
    ``meta_info["reward_extra_keys"]`` (verl's agent-loop output).
    """
    n, size = len(out), -(-len(out) // len(workers))
    refs = [workers[i // size].compute_score_batch.remote(out[i:i + size])
            for i in range(0, n, size)]
    results = [r for chunk in ray.get(refs) for r in chunk]
    mask = out.batch["response_mask"]
    lengths = out.batch["attention_mask"][:, -mask.shape[1]:].sum(-1)
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    for row, (result, length) in enumerate(zip(results, lengths.tolist(), strict=True)):
        if length > 0:
            scores[row, length - 1] = float(result["reward_score"])
    out.batch["rm_scores"] = scores
    infos = [r.get("reward_extra_info") or {} for r in results]
    keys = list(infos[0]) if infos else []
    for key in keys:
        out.non_tensor_batch[key] = np.array([info.get(key) for info in infos], dtype=object)
    out.meta_info["reward_extra_keys"] = keys


class VerlTrainerManager(AgentLoopManager):
    """agentloop's :class:`~agentloop.rollout.manager.AgentLoopManager` as verl 0.9's trainer builds
    its manager (``create(config, llm_client, teacher_client, reward_loop_worker_handles)``).

    Differences from the base class: a verl ``llm_client`` (not agentloop's) is wrapped in one
    :class:`VerlClientServer` actor; ``generate_sequences`` takes and returns verl's own DataProto
    class when given one, and where agentloop left a batch unscored (no ``custom_reward_function``,
    no loop ``reward_score``) it scores the rows with verl's ``reward_loop_worker_handles``
    (``compute_score_batch``, as verl's reward loop does: ``rm_scores`` on each row's last response
    token, ``reward_extra_info`` columns named in ``meta_info["reward_extra_keys"]``).
    ``teacher_client`` is still refused.
    """

    def __init__(self, config: Any, *args: Any, llm_client: Any = None,
                 reward_loop_worker_handles: Any = None, **kwargs: Any) -> None:
        self._bridge: Any = None
        self._reward_workers = list(reward_loop_worker_handles or [])
        if llm_client is not None and not isinstance(llm_client, AsyncLLMServerManager):
            if not ray.is_initialized():
                ray.init()
            self._bridge = (
                ray.remote(VerlClientServer)
                .options(max_concurrency=_BRIDGE_CONCURRENCY, num_cpus=0)
                .remote(llm_client)
            )
            llm_client = SimpleNamespace(server_handles=[self._bridge])
        try:
            super().__init__(_without_manager_key(config), *args, llm_client=llm_client, **kwargs)
        except BaseException:
            self._kill_bridge()
            raise

    def generate_sequences(self, batch: Any) -> Any:
        """agentloop's ``generate_sequences``; a verl DataProto in gives a verl DataProto out."""
        out = super().generate_sequences(_as_agentloop(batch))
        if not isinstance(batch, DataProto):
            out = type(batch)(batch=out.batch, non_tensor_batch=out.non_tensor_batch,
                              meta_info=out.meta_info)
        # TensorDict has no `in`: keys() it is
        keys = out.batch.keys() if out.batch is not None else ()
        if "rm_scores" not in keys and self._reward_workers and len(out):
            score_with_verl_workers(out, self._reward_workers)
        return out

    def shutdown(self) -> None:
        """Stop the workers (base class) and the bridge actor; verl's servers stay verl's."""
        try:
            super().shutdown()
        finally:
            self._kill_bridge()

    def _kill_bridge(self) -> None:
        if self._bridge is not None:
            ray.kill(self._bridge)
            self._bridge = None
