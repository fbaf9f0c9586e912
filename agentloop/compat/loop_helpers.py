"""The helper methods verl's ``AgentLoopBase`` gives its subclasses, as a mixin of agentloop's base
class.

Same names and signatures as verl 0.7–0.9 / main: ``apply_chat_template`` (0.7/0.8),
``process_vision_info`` and ``process_multi_modal_info``, the continuous-token trio
``ct_build_initial_tokens`` / ``ct_merge_assistant_token`` / ``ct_merge_context_msg`` (0.9;
``ct_merge_non_assistant_msg`` on main), ``_assert_mm_supported``, ``_get_mm_processor_kwargs``,
``build_sglang_video_payload``, ``_cap_text_prompt_length`` and the ``system_prompt`` ids.  A verl
name this mixin does not provide raises an AttributeError naming it and the docs section (see
:data:`NOT_PROVIDED`).
"""

from __future__ import annotations

import asyncio
import logging
from functools import cached_property
from typing import Any

from agentloop.compat.continuous_token import ContinuousTokenBuilder, MergeResult
from agentloop.loops.prompt import apply_chat_template

logger = logging.getLogger(__name__)

DOCS = "docs/porting-from-verl.md#not-provided"
NOT_PROVIDED = {
    "_compute_score": "rewards are computed by the worker (reward_score / rm_scores), not "
    "by a loop method",
    "_compute_teacher_logprobs": "online policy distillation (teacher servers) is not implemented",
    "teacher_server_manager": "online policy distillation (teacher servers) is not implemented",
    "reward_loop_worker_handles": "verl's reward-loop workers are not part of agentloop",
}


def _ids(value: Any) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "input_ids"):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if value and isinstance(value[0], list):  # a batch of one
        value = value[0]
    return [int(t) for t in value]


class VerlLoopHelpers:
    """Mixed into :class:`agentloop.loops.base.AgentLoopBase`; expects ``tokenizer``, ``processor``,
    ``rollout_config``, ``data_config``, ``dataset_cls``, ``apply_chat_template_kwargs``,
    ``mm_processor_kwargs`` and ``loop`` on the instance."""

    tokenizer: Any
    processor: Any
    rollout_config: Any
    data_config: Any
    dataset_cls: Any
    apply_chat_template_kwargs: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop

    def __getattr__(self, name: str) -> Any:
        reason = NOT_PROVIDED.get(name)
        if reason is not None:
            raise AttributeError(
                f"verl's AgentLoopBase.{name} is not provided by agentloop: {reason} (see {DOCS})"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- prompt rendering
    # -------------------------------------------------------------------------
    @cached_property
    def continuous_token_builder(self) -> ContinuousTokenBuilder:
        """verl 0.9's per-loop token builder (text models)."""
        return ContinuousTokenBuilder(
            self.tokenizer, chat_template_kwargs=self.apply_chat_template_kwargs
        )

    @cached_property
    def system_prompt(self) -> list[int]:
        """Ids the chat template puts before the first user message when there is no system message
        (verl strips them from renders of appended turns with ``remove_system_prompt``)."""
        one = _ids(
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": ""}], tokenize=True, add_generation_prompt=False,
                **self.apply_chat_template_kwargs,
            )
        )
        two = _ids(
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": ""}] * 2, tokenize=True, add_generation_prompt=False,
                **self.apply_chat_template_kwargs,
            )
        )
        turn = len(two) - len(one)
        return one[:-turn] if 0 < turn <= len(one) else []

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None, videos: list[Any] | None = None,
        audios: list[Any] | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
        remove_system_prompt: bool = False,
    ) -> list[int]:
        """verl 0.7/0.8: prompt ids of ``messages`` with the generation prompt; a processor
        renders images."""
        if self.processor is not None and (images or videos):
            text = self.processor.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False,
                **self.apply_chat_template_kwargs,
            )
            inputs = self.processor(
                text=[text], images=images, videos=videos, return_tensors="pt",
                **(mm_processor_kwargs or self._get_mm_processor_kwargs(audios)),
            )
            ids = _ids(inputs["input_ids"])
        else:
            ids = await self.loop.run_in_executor(
                None,
                lambda: apply_chat_template(
                    self.tokenizer, messages, tools=tools, add_generation_prompt=True,
                    **self.apply_chat_template_kwargs,
                ),
            )
        if remove_system_prompt:
            ids = ids[len(self.system_prompt):]
        if len(ids) > int(self.rollout_config.prompt_length) and (images or videos or audios):
            raise ValueError(
                f"multimodal prompt of {len(ids)} tokens exceeds "
                f"rollout.prompt_length="
                f"{self.rollout_config.prompt_length}; raise prompt_length or "
                f"shrink the inputs"
            )
        return self._cap_text_prompt_length(ids)

    def _cap_text_prompt_length(self, prompt_ids: list[int]) -> list[int]:
        limit = int(self.rollout_config.prompt_length)
        if len(prompt_ids) > limit:
            logger.warning("prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating",
                           len(prompt_ids), limit)
            return prompt_ids[-limit:]
        return prompt_ids

    # ---- multimodal inputs
    # ------------------------------------------------------------------------
    def _get_mm_processor_kwargs(self, audio_data: list[Any] | None = None) -> dict[str, Any]:
        kwargs = dict(self.mm_processor_kwargs or {})
        rate = getattr(getattr(self.processor, "feature_extractor", None), "sampling_rate", None)
        if audio_data is not None and rate is not None:
            kwargs.setdefault("sampling_rate", int(rate))
        return kwargs

    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        if has_multi_modal and (
            self.processor is None or not self.continuous_token_builder.supports_multimodal()
        ):
            raise ValueError(
                "multimodal inputs need a vision-language model with a "
                "processor; agentloop's "
                "continuous-token path renders text only "
                "(docs/porting-from-verl.md#not-provided)"
            )

    async def process_multi_modal_info(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Images / videos / audios found in ``messages`` (only with a processor, as in verl)."""
        if self.processor is None:
            return {}
        dataset = self.dataset_cls
        if dataset is not None and hasattr(dataset, "process_multi_modal_info"):
            images, videos, audios = await dataset.process_multi_modal_info(
                messages, config=self.data_config
            )
        else:
            images = [
                part.get("image")
                for m in messages
                if isinstance(m.get("content"), list)
                for part in m["content"]
                if isinstance(part, dict) and part.get("type") == "image"
            ]
            images, videos, audios = images or None, None, None
        found = {"images": images, "videos": videos, "audios": audios}
        return {k: v for k, v in found.items() if v is not None}

    async def process_vision_info(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """verl's older name of :meth:`process_multi_modal_info`."""
        return await self.process_multi_modal_info(messages)

    @staticmethod
    def build_sglang_video_payload(
        videos: Any, mm_inputs: dict[str, Any]
    ) -> list[dict[str, Any]] | None:
        """Processor features for SGLang video input; None without videos (vLLM takes raw
        frames)."""
        if not videos or "pixel_values_videos" not in mm_inputs:
            return None
        keys = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
        return [{"format": "processor_output", **{k: mm_inputs[k] for k in keys if k in mm_inputs}}]

    # ---- continuous tokens (verl 0.9)
    # -------------------------------------------------------------
    async def ct_build_initial_tokens(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None, videos: list[Any] | None = None,
        audios: list[Any] | None = None, mm_inputs_out: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids (left-truncated to ``rollout.prompt_length`` for text prompts)."""
        self._assert_mm_supported(bool(images or videos or audios))
        ids = self.continuous_token_builder.build_initial_tokens(messages, tools=tools)
        return self._cap_text_prompt_length(ids)

    async def ct_merge_assistant_token(
        self, runtime_token_ids: list[int], assistant_token_ids: list[int],
        response_mask: list[int], response_logprobs: list[float] | None = None,
        assistant_logprobs: list[float] | None = None,
    ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append sampled ids; returns (merge, response mask, response log-probs)."""
        builder = self.continuous_token_builder
        merge = builder.merge_assistant_tokens(runtime_token_ids, assistant_token_ids)
        mask, logprobs = builder.align_response_metadata(merge, response_mask, response_logprobs,
                                                         assistant_logprobs=assistant_logprobs)
        return merge, mask, logprobs

    async def ct_merge_context_msg(
        self, previous_messages: list[dict[str, Any]], updated_messages: list[dict[str, Any]],
        runtime_token_ids: list[int], response_mask: list[int],
        response_logprobs: list[float] | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append the new tool / user messages (mask 0); returns (merge, response mask, response
        log-probs)."""
        builder = self.continuous_token_builder
        merge = await self.loop.run_in_executor(None, lambda: builder.merge_context_tokens(
            previous_messages, updated_messages, runtime_token_ids, tools=tools))
        mask, logprobs = builder.align_response_metadata(merge, response_mask, response_logprobs)
        return merge, mask, logprobs

    ct_merge_non_assistant_msg = ct_merge_context_msg
