"""SingleTurnAgentLoop: one chat-completion turn, registered as ``single_turn_agent``.

Spec:
1. Render ``raw_prompt`` with the chat template (generation prompt appended); apply the
   prompt-length policy (left truncation, counted; or an error).
2. One ``server_manager.generate`` call with a fresh request id.
3. Every sampled token gets mask 1; the response is cut to ``response_length``.
4. Status: ``length`` when the engine stopped on ``max_tokens`` (or the cut applied), ``aborted``
   when the engine aborted, else ``stop``.  ``num_turns`` is 2 (user + assistant), as in verl.
5. ``extra_fields``: ``prompt_truncated``, and the weight version of the call as
   ``min_global_steps`` / ``max_global_steps`` (verl's columns; None when the server reports no
   version).
6. Images (verl's behaviour): the sample's ``multi_modal_data["image"]`` is decoded and each image's
   placeholder expanded as the model's processor renders it (docs/multimodal.md), passed as
   ``image_data`` and returned as ``multi_modal_data``; ``multi_modal_data["video"]`` is passed
   through as ``video_data``.
"""

from __future__ import annotations

import time
from typing import Any

from agentloop.batch.multimodal import decode_images, encode_images, sample_media
from agentloop.batch.routed_experts import RoutedExpertsTrace
from agentloop.loops.base import AgentLoopBase, register
from agentloop.loops.prompt import apply_chat_template, as_messages, fit_prompt
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    RolloutStatus,
    StopReason,
    unchecked_builder,
)
from agentloop.utils.ids import fresh_hex


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """Naive loop: render the prompt, generate once, return the response."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = as_messages(kwargs["raw_prompt"])
        # Rendered inline: a fast tokenizer takes ~0.1 ms here, less than a thread-pool hop
        # (measured:
        # run_in_executor cost ~5% throughput in scripts/bench_overhead.py).
        prompt_ids = apply_chat_template(self.tokenizer, messages, add_generation_prompt=True,
                                         **self.apply_chat_template_kwargs)
        images: list[Any] = []
        videos: list[Any] = []
        if kwargs.get("multi_modal_data") is not None:  # else no media to look for
            images, videos = sample_media(kwargs), sample_media(kwargs, "video")
        media: dict[str, Any] = {}
        if images:
            # a vision-language model: pixels decoded, placeholders expanded
            if self.processor is not None:
                images = decode_images(images, "sample image")
                prompt_ids = encode_images(self.processor, prompt_ids, images)
            media["image_data"] = images
        if videos:
            media["video_data"] = videos
        prompt_ids, dropped = fit_prompt(prompt_ids, self.prompt_length, self.prompt_truncation)

        start = time.perf_counter()
        output = await self.server_manager.generate(
            request_id=fresh_hex(), prompt_ids=prompt_ids, sampling_params=sampling_params, **media
        )
        metrics = _metrics(
            generate_sequences=time.perf_counter() - start, num_preempted=output.num_preempted
        )

        response_ids = output.token_ids[: self.response_length]
        versions = output.extra_fields.get("weight_versions")
        reason = output.stop_reason
        if reason is StopReason.LENGTH or len(output.token_ids) > self.response_length:
            status = RolloutStatus.LENGTH
        elif reason is StopReason.ABORTED:
            status = RolloutStatus.ABORTED
        else:
            status = RolloutStatus.STOP
        return _output(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=[1] * len(response_ids),
            response_logprobs=output.log_probs[: self.response_length]
            if output.log_probs is not None
            else None,
            response_weight_versions=list(versions[: self.response_length])
            if versions is not None
            else None,
            routed_experts=None if output.routed_experts is None
            else _routed_rows(prompt_ids, output, response_ids),
            num_turns=2,
            metrics=metrics,
            multi_modal_data={"image": images} if images else None,
            extra_fields={
                "prompt_truncated": dropped,
                "min_global_steps": output.extra_fields.get("min_global_steps"),
                "max_global_steps": output.extra_fields.get("max_global_steps"),
            },
            status=status,
        )


# built unchecked (types.unchecked_builder): every value comes from a validated TokenOutput
_metrics = unchecked_builder(AgentLoopMetrics, "generate_sequences", "num_preempted")
_output = unchecked_builder(
    AgentLoopOutput, "prompt_ids", "response_ids", "response_mask", "response_logprobs",
    "response_weight_versions", "routed_experts", "num_turns", "metrics", "multi_modal_data",
    "extra_fields", "status",
)


def _routed_rows(prompt_ids: list[int], output: Any, response_ids: list[int]) -> Any:
    """The routed experts of ``prompt_ids + response_ids`` from the call's output (routing
    replay)."""
    routing = RoutedExpertsTrace()
    routing.add(prompt_ids, output)
    return routing.rows_for(prompt_ids, response_ids)
