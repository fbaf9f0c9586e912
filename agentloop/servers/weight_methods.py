"""The weight-update actor methods both engine servers share, delegating to their ``weights`` part.

:class:`WeightUpdateMethods` is a base of :class:`agentloop.servers.vllm.VLLMServer` and
:class:`agentloop.servers.sglang.SGLangServer`: ``global_steps``, ``set_global_steps``,
``begin_weight_update``, ``load_weight_bucket``, ``finish_weight_update``, ``abort_weight_update``
and ``update_weights`` of the :class:`~agentloop.servers.base.LLMServer` protocol, each a call of
the server's :class:`~agentloop.servers.base.WeightLoader` (``VLLMWeights`` | ``SGLangWeights``).
Spec: docs/concepts.md ("Weight sync").
"""

from __future__ import annotations

from typing import Any

from agentloop.servers.base import WeightLoader, load_whole
from agentloop.servers.weight_sync import WeightBucket, Weights


class WeightUpdateMethods:
    """Weight-update methods over ``self.weights``; the server defines :meth:`_require_awake`."""

    weights: WeightLoader

    def _require_awake(self) -> None:
        """Raise ServerError unless the engine is started and awake (each backend's own)."""
        raise NotImplementedError

    @property
    def global_steps(self) -> int:
        """Version of the weights being served (verl's name; 0 before any update):
        ``weights.version``."""
        return self.weights.version

    async def set_global_steps(self, global_steps: int) -> None:
        """Set the weight version reported in ``extra_fields["global_steps"]`` without loading
        weights (verl's server method of the same name)."""
        self.weights.version = int(global_steps)

    async def begin_weight_update(
        self, global_steps: int | None = None, *, transport: str = "auto"
    ) -> None:
        """Open a weight update: in-flight requests finish on the old weights (vLLM keep mode: are
        frozen and go on after it), new ones wait until :meth:`finish_weight_update`.
        ``global_steps`` becomes the served version at the end (default: the current one + 1);
        ``transport`` is ``auto`` (the server's own), ``direct`` or ``file``.

        Raises:
            ServerError: the server is not started or asleep, or an update is open.
        """
        self._require_awake()
        await self.weights.begin(global_steps, transport)

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket of the open update (HF names; any order; a layer may straddle
        buckets)."""
        await self.weights.load(bucket)

    async def finish_weight_update(self) -> dict[str, Any]:
        """Apply the update, reset the prefix cache, publish the new version and let requests run.
        Returns what was loaded: version, transport, tensors, bytes, seconds."""
        return await self.weights.finish()

    async def abort_weight_update(self) -> None:
        """Close an open weight update without publishing its version and let requests run (a no-op
        when none is open).  Layers that got all their tensors keep the new values: run the update
        again.
        """
        await self.weights.abort()

    async def update_weights(self, named_tensors: Weights, global_steps: int | None = None, *,
                             transport: str = "auto") -> dict[str, Any]:
        """The whole update in one call (one bucket): begin, load, finish.  With tied embeddings and
        no ``lm_head.weight`` given, vLLM loads the output layer from
        ``model.embed_tokens.weight``.

        Raises:
            ServerError: the server is not started or asleep, or an update is open.
        """
        self._require_awake()
        return await load_whole(self.weights, named_tensors, global_steps, transport)
