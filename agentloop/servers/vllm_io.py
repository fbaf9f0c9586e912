"""Translation between agentloop and vLLM for :class:`agentloop.servers.vllm.VLLMServer`.

In: :func:`engine_args` (``AsyncEngineArgs`` from the typed config, verl's key names) and
:func:`sampling_params` (one request's ``SamplingParams``).  Out: :func:`to_token_output` (a final
``RequestOutput`` as a :class:`~agentloop.types.TokenOutput`), :data:`FINISH_TO_STOP`,
:func:`stop_sequence`, :func:`sampled_logprobs` (the fields of a completion) and
:func:`with_cached_tokens` (the engine's prefix-cache hits, ``extra_fields["num_cached_tokens"]``).
vLLM itself is imported only where an engine runs.  Keys: docs/concepts.md ("The vLLM server").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from agentloop.batch.routed_experts import PROMPT_START_KEY
from agentloop.config import EngineConfig, ModelConfig, ServerConfig
from agentloop.errors import ConfigError
from agentloop.servers.vllm_plugin import engine_arg_defaults
from agentloop.servers.weight_sync import WORKER_EXTENSION
from agentloop.types import CACHED_TOKENS_KEY, StopReason, TokenOutput

SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop_token_ids", "ignore_eos",
)
"""Sampling keys passed to vLLM's ``SamplingParams`` under their own names."""
ROUTING_REPLAY_ON_CPU = (
    "actor_rollout_ref.rollout.enable_rollout_routing_replay: vLLM returns routed experts only "
    "from its Model Runner V2, which needs Triton with a GPU backend; vLLM CPU cannot (vLLM 0.32: "
    "'AuxOutput Connector requires Model Runner V2'). Run the servers on GPUs or set it to false"
)
"""The error of a vLLM CPU server started with routing replay on."""
FINISH_TO_STOP = {
    "stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORTED,
}
"""vLLM's ``finish_reason`` as a stop reason (anything else: ``stop``)."""


def engine_args(engine: EngineConfig, server: ServerConfig, model: ModelConfig, on_cpu: bool,
                server_index: int = 0) -> dict[str, Any]:
    """vLLM ``AsyncEngineArgs`` from the typed config (verl's key names; ``engine_kwargs.vllm``
    last, so it overrides anything).  Each server is seeded ``seed + server_index``, as verl seeds
    its replicas, so servers given the same requests do not sample the same tokens.

    Raises:
        ConfigError: routing replay on a CPU server (:data:`ROUTING_REPLAY_ON_CPU`)."""
    args: dict[str, Any] = {
        "model": model.local_path,
        "trust_remote_code": model.trust_remote_code,
        "load_format": engine.load_format,
        "logprobs_mode": engine.logprobs_mode,
        "scheduling_policy": engine.scheduling_policy,
        "dtype": engine.dtype,
        "max_model_len": engine.context_length,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": max(engine.max_num_batched_tokens, engine.context_length),
        "enable_prefix_caching": engine.enable_prefix_caching,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed + int(server_index),
        "disable_log_stats": engine.disable_log_stats,
        "tensor_parallel_size": engine.tensor_model_parallel_size,
        # On CPU this is the fraction of the NUMA node's memory that must be free at start-up
        # (vLLM's default 0.92 fails as soon as the page cache holds a GiB); the KV cache itself is
        # sized by VLLM_CPU_KVCACHE_SPACE.
        "gpu_memory_utilization": engine.gpu_memory_utilization,
    }
    if model.local_tokenizer_path:
        args["tokenizer"] = model.local_tokenizer_path
    if on_cpu:
        args["distributed_executor_backend"] = "uni" if args["tensor_parallel_size"] == 1 else "mp"
    else:
        args["enable_sleep_mode"] = engine.free_cache_engine
        args["enable_chunked_prefill"] = engine.enable_chunked_prefill
        if engine.cudagraph_capture_sizes:
            args["cudagraph_capture_sizes"] = list(engine.cudagraph_capture_sizes)
    if server.priority not in (None, "", "fcfs"):  # the router sends priorities
        args["scheduling_policy"] = "priority"
    args["worker_extension_cls"] = WORKER_EXTENSION  # weight updates without files (weight_sync.py)
    if engine.enable_rollout_routing_replay:  # R3: routed experts in every output
        if on_cpu:
            raise ConfigError(ROUTING_REPLAY_ON_CPU)
        args["enable_return_routed_experts"] = True
    # Qwen2-VL without torchvision: no videos (vllm_plugin.py)
    args.update(engine_arg_defaults(args["model"]))
    args.update(dict(engine.engine_kwargs.get("vllm") or {}))
    return args


@dataclass(frozen=True)
class NoBudget:
    """What :func:`sampling_params` returns when the request has no tokens left (``max_tokens``
    <= 0): vLLM's ``SamplingParams`` refuses that, the server answers ``length`` with no tokens."""

    max_tokens: int


def sampling_params(
    params: dict[str, Any], prompt_len: int, prompt_length: int, response_length: int,
    stream: bool = False,
) -> Any:
    """vLLM ``SamplingParams`` for one request: ``params`` (verl's sampling keys), ``max_tokens``
    defaulting to ``response_length`` and capped by what ``prompt_length + response_length`` leaves
    after the prompt; delta outputs when ``stream``; a :class:`NoBudget` when nothing is left."""
    # vLLM is imported only where an engine runs (after start(): already loaded, the import is a
    # lookup)
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    budget = prompt_length + response_length - prompt_len
    max_tokens = params.get("max_tokens") or min(response_length, budget)
    if min(max_tokens, budget) <= 0:  # vLLM refuses max_tokens < 1: the caller ends it as length
        return NoBudget(max_tokens=int(min(max_tokens, budget)))
    kwargs = {k: params[k] for k in SAMPLING_KEYS if params.get(k) is not None}
    if params.get("logprobs"):
        kwargs["logprobs"] = 0
    if params.get(PROMPT_START_KEY):  # routing replay: routing known from earlier turns
        kwargs[PROMPT_START_KEY] = int(params[PROMPT_START_KEY])
    if params.get("stop"):  # stop strings need the engine to detokenize
        kwargs["stop"] = params["stop"]
    # a grammar (gateway/constraints.py): vLLM's own field names
    if params.get("structured_outputs"):
        kwargs["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    return SamplingParams(
        max_tokens=int(min(max_tokens, budget)), detokenize=bool(params.get("stop")),
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        **kwargs,
    )


def stop_sequence(completion: Any) -> str | None:
    """The stop string that ended a completion: vLLM reports it as ``stop_reason`` (a token id there
    is an end-of-turn / stop token, not a stop string)."""
    reason = getattr(completion, "stop_reason", None)
    return reason if isinstance(reason, str) and completion.finish_reason == "stop" else None


def sampled_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """The logprob of each sampled token (vLLM returns a {token: Logprob} dict per position)."""
    return [
        float(lp[t].logprob) for lp, t in zip(completion.logprobs or [], token_ids, strict=False)
    ]


def with_cached_tokens(extra_fields: dict[str, Any], output: Any) -> dict[str, Any]:
    """``extra_fields`` plus :data:`CACHED_TOKENS_KEY`: a ``RequestOutput``'s
    ``num_cached_tokens`` (the prompt tokens vLLM found in its prefix cache); ``extra_fields``
    itself where the output has none (None or no such attribute)."""
    cached = getattr(output, "num_cached_tokens", None)
    if cached is None:
        return extra_fields
    return {**extra_fields, CACHED_TOKENS_KEY: int(cached)}


def to_token_output(
    final: Any, want_logprobs: bool, extra_fields: dict[str, Any], routed_experts_start: int = 0
) -> TokenOutput:
    """A final ``RequestOutput`` as a TokenOutput carrying ``extra_fields`` and the engine's
    cached prompt tokens (:func:`with_cached_tokens`), ``num_preempted`` -1 where vLLM does not
    report it and, with routing replay on, the completion's ``routed_experts`` from position
    ``routed_experts_start``."""
    completion = final.outputs[0]
    token_ids = list(completion.token_ids)
    log_probs = sampled_logprobs(completion, token_ids) if want_logprobs else None
    preempted = getattr(final, "num_preemptions", None)
    return TokenOutput(
        token_ids=token_ids, log_probs=log_probs,
        stop_reason=FINISH_TO_STOP.get(completion.finish_reason or "abort", StopReason.STOP),
        stop_sequence=stop_sequence(completion),
        num_preempted=int(preempted) if preempted is not None else -1,
        extra_fields=with_cached_tokens(extra_fields, final),
        routed_experts=getattr(completion, "routed_experts", None),
        routed_experts_start=routed_experts_start,
    )


async def no_outputs() -> AsyncIterator[Any]:
    """An engine stream that yields nothing (a request a pause held and then ended)."""
    return
    yield
