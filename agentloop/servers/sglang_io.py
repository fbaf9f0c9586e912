"""Translation between agentloop and SGLang for :class:`agentloop.servers.sglang.SGLangServer`.

In: :func:`server_args` / :func:`engine_kwargs` (SGLang ``ServerArgs`` from verl's rollout keys,
``engine_kwargs.sglang`` last, overriding anything), :func:`request_sampling` (one request's
sampling keys and ``max_new_tokens``) and :func:`structured_sampling` (a ``structured_outputs``
grammar).  Out: :func:`to_token_output` (an ``async_generate`` result as a
:class:`~agentloop.types.TokenOutput`), :func:`routed_experts` (routing replay's rows) and
:data:`FINISH_TO_STOP`.  Spec: docs/sglang.md.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from agentloop.config import EngineConfig, ModelConfig, ServerConfig, ServerSections
from agentloop.errors import ServerError
from agentloop.types import CACHED_TOKENS_KEY, StopReason, TokenOutput

FINISH_TO_STOP = {
    "stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORTED,
}
"""SGLang's ``finish_reason.type`` as a stop reason (anything else: ``stop``)."""
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "stop_token_ids": "stop_token_ids", "stop": "stop",
    "ignore_eos": "ignore_eos", "seed": "sampling_seed", "n": "n",
}
_STRUCTURED = {
    "json": "json_schema", "json_object": "json_schema", "regex": "regex", "grammar": "ebnf",
    "structural_tag": "structural_tag",
}


def structured_sampling(entry: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling keys for a ``structured_outputs`` entry (vLLM's field names;
    gateway/constraints.py).

    Raises:
        ServerError: a constraint SGLang has no sampling key for (``choice``, whitespace options).
    """
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if value is None or value is False:
            continue
        if key not in _STRUCTURED:
            raise ServerError(
                f"structured output {key!r} is not supported with "
                f"rollout.name=sglang; SGLang takes "
                f"{sorted(_STRUCTURED)}"
            )
        if key == "json_object":
            value = '{"type": "object"}'
        elif key == "json" and not isinstance(value, str):
            value = json.dumps(value)
        out[_STRUCTURED[key]] = value
    return out


def server_args(
    engine: EngineConfig, server: ServerConfig, model: ModelConfig, server_index: int = 0
) -> dict[str, Any]:
    """SGLang ``ServerArgs`` from the typed config (verl's key names; ``engine_kwargs.sglang``
    last)."""
    kwargs: dict[str, Any] = {
        "model_path": model.local_path,
        "trust_remote_code": model.trust_remote_code,
        "dtype": engine.dtype,
        "tp_size": engine.tensor_model_parallel_size,
        "mem_fraction_static": engine.gpu_memory_utilization,
        "context_length": engine.context_length,
        "max_running_requests": engine.max_num_seqs,
        "chunked_prefill_size": max(engine.max_num_batched_tokens, engine.context_length),
        "disable_radix_cache": not engine.enable_prefix_caching,
        "enable_memory_saver": engine.free_cache_engine,
        "random_seed": engine.seed + int(server_index),
        "load_format": engine.load_format,
        "skip_tokenizer_init": True,  # token in, token out
        "log_level": "error",
    }
    if model.local_tokenizer_path:
        kwargs["tokenizer_path"] = model.local_tokenizer_path
    if server.priority not in (None, "", "fcfs"):
        kwargs["enable_priority_scheduling"] = True
    if engine.enable_rollout_routing_replay:  # R3: routed experts captured for every request
        kwargs["enable_return_routed_experts"] = True
    kwargs.update(dict(engine.engine_kwargs.get("sglang") or {}))
    return kwargs


def engine_kwargs(rollout: Any, model: Any, server_index: int = 0) -> dict[str, Any]:
    """:func:`server_args` from the rollout and model slices
    (:meth:`ServerSections.from_slices`)."""
    sections = ServerSections.from_slices(rollout, model)
    return server_args(sections.engine, sections.server, sections.model_config, server_index)


def request_sampling(
    params: dict[str, Any], prompt_len: int, prompt_length: int, response_length: int
) -> tuple[dict[str, Any], int]:
    """SGLang's sampling keys for one request (verl's names in ``params``) and its
    ``max_new_tokens``: ``max_tokens`` defaulting to ``response_length``, capped by what
    ``prompt_length + response_length`` leaves after the prompt.

    Raises:
        ServerError: a grammar SGLang cannot take (:func:`structured_sampling`).
    """
    budget = prompt_length + response_length - prompt_len
    max_tokens = int(min(params.get("max_tokens") or min(response_length, budget), budget))
    out = {
        ours: params[theirs]
        for theirs, ours in _SAMPLING.items()
        if params.get(theirs) is not None
    }
    if "top_k" in out and int(out["top_k"]) <= 0:
        out["top_k"] = -1  # verl's "no top-k"
    if params.get("structured_outputs"):  # a grammar from the gateway (gateway/constraints.py)
        out.update(structured_sampling(params["structured_outputs"]))
    out["max_new_tokens"] = max_tokens
    return out, max_tokens


def routed_experts(
    meta: dict[str, Any], shape: tuple[int, int] | None
) -> np.ndarray | None:
    """``meta_info["routed_experts"]`` (SGLang sends base64 of int32 expert ids, rows
    ``routed_experts_start_len .. seqlen - 1``) as an ``[n, layers, top_k]`` array; None when
    ``shape`` is None (routing replay off) or the engine sent none."""
    value = meta.get("routed_experts")
    if shape is None or value is None:
        return None
    flat = (
        np.frombuffer(base64.b64decode(value), dtype=np.int32)
        if isinstance(value, (str, bytes))
        else np.asarray(value, dtype=np.int32)
    )
    return flat.reshape(-1, *shape)


def with_cached_tokens(extra_fields: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """``extra_fields`` plus :data:`~agentloop.types.CACHED_TOKENS_KEY`: the prompt
    tokens SGLang found in its radix cache (``meta_info["cached_tokens"]``); ``extra_fields``
    itself where ``meta`` has none."""
    cached = meta.get("cached_tokens")
    if cached is None:
        return extra_fields
    return {**extra_fields, CACHED_TOKENS_KEY: int(cached)}


def to_token_output(
    result: dict[str, Any], want_logprobs: bool, extra_fields: dict[str, Any],
    routing: tuple[tuple[int, int], int] | None = None,
) -> TokenOutput:
    """An ``async_generate`` result (``output_ids``, ``meta_info``) as a TokenOutput carrying
    ``extra_fields`` and the cached prompt tokens (:func:`with_cached_tokens`); ``routing``
    (routing replay on): the model's ``(layers, top_k)`` and the request's
    ``routed_experts_start_len``."""
    meta = result.get("meta_info") or {}
    ids = [int(t) for t in result.get("output_ids") or []]
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    log_probs = (
        [float(t[0]) for t in meta.get("output_token_logprobs") or []][: len(ids)]
        if want_logprobs
        else None
    )
    return TokenOutput(
        token_ids=ids, log_probs=log_probs,
        stop_reason=FINISH_TO_STOP.get(finish, StopReason.STOP),
        extra_fields=with_cached_tokens(extra_fields, meta),
        routed_experts=routed_experts(meta, routing[0]) if routing else None,
        routed_experts_start=routing[1] if routing else 0,
    )
