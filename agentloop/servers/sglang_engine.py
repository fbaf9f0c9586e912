"""The one place that touches SGLang: loading it and the calls of its ``Engine`` API (0.5 line).

:func:`load_sglang` imports SGLang (an optional dependency, the ``[sglang]`` extra) or names the
fix; :class:`SGLangEngineAPI` wraps one ``sglang.Engine`` with the calls
:class:`agentloop.servers.sglang.SGLangServer` makes (generate, abort, memory release / resume,
weights from tensors, cache flush, child processes).  Spec: docs/sglang.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.errors import ConfigError, ServerError

INSTALL_HINT = "pip install -e '.[sglang]' (SGLang needs a CUDA GPU)"


def load_sglang() -> tuple[Any, Any]:
    """``(sglang.Engine, sglang.srt.managers.io_struct)``, or a ConfigError naming the fix."""
    try:  # SGLang is an optional dependency (the [sglang] extra)
        import sglang
        from sglang.srt.managers import io_struct
    except ImportError as e:
        raise ConfigError(
            f"actor_rollout_ref.rollout.name=sglang but SGLang is not "
            f"installed ({e}); "
            f"install it with {INSTALL_HINT}, or use rollout.name=vllm"
        ) from e
    return sglang.Engine, io_struct


class SGLangEngineAPI:
    """The SGLang calls the server makes, in one place (see the module docstring)."""

    def __init__(self, engine: Any, io_struct: Any, serializer: Any = None) -> None:
        self.engine, self.io, self._serializer = engine, io_struct, serializer
        self.tm = engine.tokenizer_manager
        args = getattr(engine, "server_args", None)
        self.incremental_stream = bool(getattr(args, "incremental_streaming_output", False))
        self.tp_size = int(getattr(args, "tp_size", 1) or 1)

    async def generate(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str, *, logprobs: bool,
        image_data: list[Any] | None, priority: int | None, stream: bool,
        video_data: list[Any] | None = None, routed_experts_start: int | None = None,
    ) -> Any:
        kwargs: dict[str, Any] = {
            "input_ids": list(input_ids), "sampling_params": sampling, "rid": rid,
            "return_logprob": logprobs, "stream": stream,
        }
        if routed_experts_start is not None:  # routing replay: rows from this position on
            kwargs["return_routed_experts"] = True
            kwargs["routed_experts_start_len"] = int(routed_experts_start)
        if image_data:
            kwargs["image_data"] = image_data
        if video_data:
            kwargs["video_data"] = video_data
        if priority:
            kwargs["priority"] = int(priority)
        return await self.engine.async_generate(**kwargs)

    async def abort(self, rid: str) -> None:
        result = self.tm.abort_request(rid)
        if asyncio.iscoroutine(result):
            await result

    async def release_memory(self) -> None:
        await self.tm.release_memory_occupation(self.io.ReleaseMemoryOccupationReqInput(), None)

    async def resume_memory(self) -> None:
        await self.tm.resume_memory_occupation(self.io.ResumeMemoryOccupationReqInput(), None)

    async def load_tensors(self, named: list[tuple[str, Any]]) -> None:
        if self._serializer is None:
            # SGLang is an optional dependency, installed where this engine runs
            from sglang.srt.utils import MultiprocessingSerializer

            self._serializer = MultiprocessingSerializer
        # one per TP rank
        payload = [self._serializer.serialize(named) for _ in range(self.tp_size)]
        result = await self.tm.update_weights_from_tensor(
            self.io.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payload, flush_cache=False
            ),
            None,
        )
        ok = result[0] if isinstance(result, tuple) else getattr(result, "success", True)
        if not ok:
            raise ServerError(f"SGLang refused the weights: {result}")

    async def flush_cache(self) -> None:
        await self.tm.flush_cache()

    def child_pids(self) -> list[int]:
        get = getattr(self.engine, "get_all_child_pids", None)
        return list(get()) if get is not None else []

    def shutdown(self) -> None:
        self.engine.shutdown()
