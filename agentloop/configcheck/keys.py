"""Every key of verl's rollout-facing config subtrees, with verl's default and what agentloop does
with it.

:data:`ROLLOUT` (``actor_rollout_ref.rollout``), :data:`MODEL` (``actor_rollout_ref.model``) and
:data:`DATA` (``data``) hold verl 0.9.1's generated trainer config keys (plus a few read from verl's
dataclasses or left from 0.6.1) and agentloop's own, each ``honoured``, ``irrelevant`` (cannot
change a rollout) or ``unsupported`` (a non-default value is reported at start-up).  A key in none
of them (and not in ``agentloop/configs/rollout.yaml``) is unknown: a ConfigError unless
``rollout.agent.strict_config`` is false.  Spec: docs/config.md#no-silent-config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HONOURED = "honoured"
IRRELEVANT = "irrelevant"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Key:
    """One config key (path relative to its subtree)."""

    status: str
    default: Any
    """verl's default (ours for agentloop keys); interpolation strings are kept as written."""
    why: str
    origin: str = "verl"
    """``verl`` (0.9.1 generated config), ``verl-dataclass`` (read by verl, absent from its YAML),
    ``verl-0.6.1`` (removed since) or ``agentloop``."""
    open: bool = False
    """A free-form mapping: its children are not checked."""
    active: Callable[[Any], bool] | None = None
    """For unsupported keys: whether a value turns the feature on (default: differs from
    ``default``)."""


Table = dict[str, Key]


def _add(
    table: Table, status: str, why: str, keys: dict[str, Any], *, origin: str = "verl",
    open_keys: tuple[str, ...] = (), active: dict[str, Callable[[Any], bool]] | None = None,
) -> None:
    for name, default in keys.items():
        table[name] = Key(status, default, why, origin, name in open_keys, (active or {}).get(name))


def _enabled(value: Any) -> bool:
    return isinstance(value, dict) and bool(value.get("enable"))


# --------------------------------------------------------------------------------------------------
# actor_rollout_ref.rollout
# --------------------------------------------------------------------------------------------------
ROLLOUT: Table = {}
_add(
    ROLLOUT,
    HONOURED,
    "engine, sampling and length keys passed to the server / agent loops",
    {
        "name": "???", "prompt_length": "${oc.select:data.max_prompt_length,512}",
        "response_length": "${oc.select:data.max_response_length,512}", "temperature": 1.0,
        "top_k": -1, "top_p": 1, "do_sample": True, "n": 1, "seed": 42, "ignore_eos": False,
        "calculate_log_probs": True, "logprobs_mode": "processed_logprobs", "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5, "enforce_eager": False, "cudagraph_capture_sizes": None,
        "free_cache_engine": True, "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192,
        "max_model_len": None, "max_num_seqs": 256, "enable_chunked_prefill": True,
        "enable_prefix_caching": True, "scheduling_policy": "fcfs", "load_format": "dummy",
        "disable_log_stats": True, "engine_kwargs.vllm": {}, "engine_kwargs.sglang": {},
        "val_kwargs.top_k": -1, "val_kwargs.top_p": 1.0, "val_kwargs.temperature": 0,
        "val_kwargs.do_sample": False, "multi_turn.max_assistant_turns": None,
        "multi_turn.tool_config_path": None, "multi_turn.max_user_turns": None,
        "multi_turn.max_parallel_calls": 1, "multi_turn.max_tool_response_length": 256,
        "multi_turn.tool_response_truncate_side": "middle", "multi_turn.format": "hermes",
        "agent.num_workers": 8, "agent.default_agent_loop": "single_turn_agent",
        "agent.agent_loop_config_path": None,
    },
    open_keys=("engine_kwargs.vllm", "engine_kwargs.sglang"),
)
_add(ROLLOUT, HONOURED, "sampling", {"repetition_penalty": 1.0}, origin="verl-dataclass")
_add(ROLLOUT, HONOURED, "verl 0.6.1's interaction YAML (removed in 0.9.1, kept here)",
     {"multi_turn.interaction_config_path": None}, origin="verl-0.6.1")

# Hydra/dataclass metadata: names a Python class, not a setting.
_add(
    ROLLOUT,
    IRRELEVANT,
    "Hydra _target_ metadata",
    {
        "_target_": "verl.workers.config.RolloutConfig",
        "val_kwargs._target_": "verl.workers.config.SamplingConfig",
        "multi_turn._target_": "verl.workers.config.MultiTurnConfig",
        "agent._target_": "verl.workers.config.AgentLoopConfig",
        "agent.custom_async_server._target_": "verl.workers.config.CustomAsyncServerConfig",
        "checkpoint_engine._target_": "verl.workers.config.CheckpointEngineConfig",
        "trace._target_": "verl.workers.config.TraceConfig",
        "prometheus._target_": "verl.workers.config.PrometheusConfig",
    },
)
# The trainer recomputes log-probs with the actor; these size its micro-batches.
_add(
    ROLLOUT,
    IRRELEVANT,
    "trainer-side log-prob recomputation",
    {
        "log_prob_micro_batch_size": None,
        "log_prob_micro_batch_size_per_gpu": None,
        "log_prob_use_dynamic_bsz": "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}",
        "log_prob_max_token_len_per_gpu": "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}",  # noqa: E501
    },
)
# How the trainer ships weights into the engine: speed and memory of a sync, never what is
# generated.
_add(
    ROLLOUT,
    IRRELEVANT,
    "trainer-to-rollout weight-sync transport",
    {
        "layered_summon": False, "multi_stage_wake_up": False, "checkpoint_engine.backend": "naive",
        "checkpoint_engine.update_weights_bucket_megabytes": 2048,
        "checkpoint_engine.engine_kwargs": {}, "checkpoint_engine.custom_backend_module": None,
    },
    open_keys=("checkpoint_engine.engine_kwargs",),
)
_add(ROLLOUT, IRRELEVANT, "trainer-to-rollout weight-sync transport", {
    "checkpoint_manager_class": None, "layer_name_map": {}, "enable_sleep_mode": True,
}, origin="verl-dataclass", open_keys=("layer_name_map",))
_add(ROLLOUT, IRRELEVANT, "trainer-to-rollout weight-sync transport",
     {"update_weights_bucket_megabytes": 512}, origin="verl-0.6.1")
_add(ROLLOUT, IRRELEVANT, "profiling only", {"profiler": None}, open_keys=("profiler",))
_add(
    ROLLOUT,
    IRRELEVANT,
    "read by verl's trainer or dataset, not by its agent loops: verl "
    "0.9.1 copies "
    "multi_turn.enable into meta_info for the actor update, val_kwargs.n repeats "
    "validation batches",
    {"multi_turn.enable": False, "val_kwargs.n": 1},
)
_add(
    ROLLOUT,
    IRRELEVANT,
    "read only by verl's legacy SGLang multi-turn rollout, or by nothing in verl 0.9.1",
    {
        "multi_turn.use_inference_chat_template": False,
        "multi_turn.tokenization_sanity_check_mode": "strict",
        "multi_turn.num_repeat_rollouts": None, "over_sample_rate": 0,
    },
)
_add(
    ROLLOUT,
    IRRELEVANT,
    "verl's SGLang HTTP adapter and other backends agentloop does not run "
    "(rollout.name rejects trtllm)",
    {
        "engine_kwargs.trtllm": {}, "server.timeout": 60.0, "server.max_attempts": 3,
        "server.retry_delay": 2.0, "server.max_connections": 1000,
        "server.max_start_wait_time": 300.0, "sglang_engine_mode": "local",
        "moe_tensor_parallel_size": 1, "micro_batch_size": None,
    },
    open_keys=("engine_kwargs.trtllm",),
)
_add(
    ROLLOUT,
    IRRELEVANT,
    "free-form extension slot (verl's RolloutConfig.custom): "
    "agentloop never reads it, custom "
    "agent loops may; its children are not checked",
    {"custom": None},
    origin="verl-dataclass",
    open_keys=("custom",),
)
# The engine keeps its tokenizer either way (stop strings need it); the token ids are the same.
_add(ROLLOUT, IRRELEVANT, "agentloop decides: the engine keeps its tokenizer for stop strings",
     {"skip_tokenizer_init": True})
# Only read when the switch next to them (checked as unsupported) is on.
_add(ROLLOUT, HONOURED, "names the trace file (rollout_traces/<project>/<experiment>.jsonl)", {
    "trace.project_name": "${oc.select:trainer.project_name,null}",
    "trace.experiment_name": "${oc.select:trainer.experiment_name,null}",
})
_add(
    ROLLOUT,
    IRRELEVANT,
    "only read when its switch (nnodes, prometheus.enable, "
    "disaggregation.enabled, skip_rollout) is on",
    {
        "n_gpus_per_node": "${oc.select:trainer.n_gpus_per_node,8}", "prometheus.port": 9090,
        "prometheus.file": "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml",
        "prometheus.served_model_name": "${oc.select:actor_rollout_ref.model.path,null}",
        "disaggregation.prefill_replicas": 1, "disaggregation.decode_replicas": 1,
        "disaggregation.decode_tensor_model_parallel_size": None,
        "disaggregation.transfer_backend": "nixl", "disaggregation.bootstrap_port": None,
        "disaggregation.ib_device": None,
    },
)
_add(ROLLOUT, IRRELEVANT, "only read when nnodes > 0", {"standalone_gpu_memory_utilization": None},
     origin="verl-dataclass")
_add(
    ROLLOUT, IRRELEVANT, "only read when skip_rollout is on",
    {"skip_dump_dir": "/tmp/rollout_dump"}, origin="verl-0.6.1",
)

_add(
    ROLLOUT,
    UNSUPPORTED,
    "placement/parallelism not implemented (one server per "
    "tensor_model_parallel_size "
    "GPUs; size the pool with rollout.server.num_servers)",
    {
        "nnodes": 0, "data_parallel_size": 1, "expert_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "disaggregation.enabled": False,
        "router_config_path": None,
    },
)
_add(ROLLOUT, UNSUPPORTED, "only the async agent-loop rollout exists", {"mode": "async"})
_add(ROLLOUT, UNSUPPORTED, "changes sampling numerics (batch-invariant kernels, per-request seeds)",
     {"full_determinism": False})
_add(ROLLOUT, UNSUPPORTED, "changes the weights the engine runs", {
    "quantization": None, "quantization_config_file": None,
    "qat": "${oc.select:actor_rollout_ref.actor.fsdp_config.qat,"
           "${oc.select:actor_rollout_ref.actor.megatron.qat,null}}",
}, open_keys=("qat",), active={"qat": _enabled})
_add(ROLLOUT, IRRELEVANT, "a copy of actor_rollout_ref.model.mtp, checked there",
     {"mtp": "${oc.select:actor_rollout_ref.model.mtp, null}"}, open_keys=("mtp",))
_add(
    ROLLOUT,
    UNSUPPORTED,
    "extra outputs/hooks not implemented (custom server or manager classes)",
    {"agent.custom_async_server.path": None, "agent.custom_async_server.name": None},
)
_add(ROLLOUT, HONOURED, "routed experts per token in routed_experts (MoE models, vLLM on GPUs)",
     {"enable_rollout_routing_replay": False})
_add(ROLLOUT, HONOURED, "function tools loaded once per worker (load_all_tools)",
     {"multi_turn.function_tool_path": None})
_add(
    ROLLOUT, UNSUPPORTED, "extra outputs/hooks not implemented",
    {"agent.agent_loop_manager_class": None}, origin="verl-dataclass",
)
_add(
    ROLLOUT, UNSUPPORTED, "multimodal prompts per request", {"limit_images": None},
    origin="verl-dataclass",
)
_add(
    ROLLOUT,
    HONOURED,
    "rollout traces (agentloop.trace): backends jsonl and mlflow "
    "(verl's weave/trackio are "
    "refused with a ConfigError when the workers start)",
    {
        "trace.backend": None, "trace.token2text": False,
        "trace.max_samples_per_step_per_worker": None,
    },
)
_add(ROLLOUT, UNSUPPORTED, "metrics export not implemented", {
    "prometheus.enable": False, "moe_load_balance_metrics_interval": 0,
})
_add(ROLLOUT, UNSUPPORTED, "replays dumped rollouts instead of generating", {"skip_rollout": False},
     origin="verl-0.6.1")

_add(ROLLOUT, HONOURED, "agentloop's own key (see docs/config.md)", {
    "normal_priority": True, "gc_freeze": True, "gc_threshold": 50000,
    "multi_turn.tool_timeout": 30, "multi_turn.return_messages": False,
    "multi_turn.context_window": None, "multi_turn.max_context_edits": None,
    "multi_turn.reward_to": "all", "multi_turn.reward_gamma": 0.9,
    "multi_turn.tool_executor": "thread", "multi_turn.tool_max_workers": 32,
    "agent.prompt_truncation": "left", "agent.sample_timeout": None, "agent.strict_config": None,
    "agent.max_failure_fraction": 0.5, "agent.result_channel": "tcp",
    "agent.batch_timeout": None, "agent.max_sample_retries": 1, "agent.restart_preempted": False,
    "agent.record_timing": None, "agent.stall_timeout": 300, "server.max_failovers": None,
    "server.restart_dead": True, "server.weight_update_timeout": 600, "server.stall_timeout": 300,
    "server.num_servers": None, "server.num_cpus_per_server": 1, "server.device": "auto",
    "server.max_cache_size": 10000, "server.batch_calls": True, "server.priority": None,
    "server.balancer": "shared", "server.routing": "sticky",
    "server.placement_strategy": "PACK", "server.weight_update": None,
    "gateway.num_gateways": 1, "gateway.host": "127.0.0.1", "gateway.max_body_bytes": 8388608,
    "gateway.max_image_bytes": 5242880, "gateway.reasoning_parser": None,
    "gateway.session_timeout": None, "gateway.max_concurrent_sessions": 0,
    "gateway.trajectories": "all", "gateway.reward_to": "all",
    "env.default": None, "env.config_path": None, "env.max_turns": None, "env.step_timeout": 60,
}, origin="agentloop")

# --------------------------------------------------------------------------------------------------
# actor_rollout_ref.model
# --------------------------------------------------------------------------------------------------
MODEL: Table = {}
_add(
    MODEL,
    HONOURED,
    "model and tokenizer loading (agentloop/tokenization/loader.py, servers/vllm.py)",
    {
        "path": "~/models/deepseek-llm-7b-chat", "tokenizer_path": None, "trust_remote_code": False,
        "custom_chat_template": None,
    },
)
_add(
    MODEL,
    IRRELEVANT,
    "Hydra _target_ metadata",
    {
        "_target_": "verl.workers.config.HFModelConfig",
        "mtp._target_": "verl.workers.config.MtpConfig",
    },
)
# What the trainer builds and how fast it trains; verl's vLLM server loads `path` and gets none of
# these.
_add(
    MODEL,
    IRRELEVANT,
    "training-side model options (verl's rollout engine loads model.path without them)",
    {
        "hf_config_path": None, "override_config": {}, "use_shm": False,
        "enable_gradient_checkpointing": True, "enable_activation_offload": False,
        "use_remove_padding": True, "use_liger": False, "use_fused_kernels": False,
        "fused_kernel_options.impl_backend": "torch", "tiled_mlp.enabled": False,
        "tiled_mlp.num_shards": 4, "mtp.enable_train": False, "mtp.detach_encoder": False,
        "mtp.mtp_loss_scaling_factor": 0.1,
    },
    open_keys=("override_config",),
)
_add(
    MODEL,
    IRRELEVANT,
    "only read when LoRA (lora_rank / lora.rank) or MTP rollout (mtp.enable_rollout) is on",
    {
        "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None,
        "lora.type": "lora", "lora.merge": False, "lora.alpha": 32, "lora.dropout": 0.0,
        "lora.target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "lora.exclude_modules": [], "lora.dropout_position": "pre",
        "lora.lora_A_init_method": "xavier", "lora.lora_B_init_method": "zero",
        "lora.a2a_experimental": False, "lora.dtype": None, "lora.freeze_vision_model": True,
        "lora.freeze_vision_projection": True, "lora.freeze_language_model": True,
        "mtp.enable": False, "mtp.speculative_algorithm": "EAGLE", "mtp.speculative_num_steps": 3,
        "mtp.speculative_eagle_topk": 1, "mtp.speculative_num_draft_tokens": 4, "mtp.method": "mtp",
        "mtp.num_speculative_tokens": 1,
    },
)
_add(
    MODEL, IRRELEVANT, "only read when LoRA is on", {"lora.fully_sharded_loras": False},
    origin="verl-dataclass",
)
_add(
    MODEL,
    UNSUPPORTED,
    "LoRA adapters are not served (a trainer that merges LoRA into the "
    "weights and calls "
    "update_weights works)",
    {"lora_rank": 0, "lora_adapter_path": None, "lora.rank": 0, "lora.adapter_path": None},
)
_add(MODEL, UNSUPPORTED, "speculative decoding with MTP heads", {"mtp.enable_rollout": False})
_add(MODEL, UNSUPPORTED, "custom model code imported before loading", {"external_lib": None})

# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------
DATA: Table = {}
_add(
    DATA,
    HONOURED,
    "read by `agentloop rollout` / the length defaults",
    {
        "train_files": "~/data/rlhf/gsm8k/train.parquet", "prompt_key": "prompt",
        "max_prompt_length": 512, "max_response_length": 512, "train_batch_size": 1024,
    },
)
_add(
    DATA, HONOURED, "agentloop's own key (see docs/config.md)", {"max_samples": -1},
    origin="agentloop",
)
# The trainer's dataloader and reward manager: order, batching, workers and fields the trainer
# wants.
_add(
    DATA,
    IRRELEVANT,
    "trainer-side dataloader / validation / reward manager",
    {
        "tokenizer": None,
        "use_shm": False,
        "val_files": "~/data/rlhf/gsm8k/test.parquet",
        "val_max_samples": -1,
        "reward_fn_key": "data_source",
        "gen_batch_size": None,
        "val_batch_size": None,
        "tool_config_path": "${oc.select:actor_rollout_ref.rollout.multi_turn.tool_config_path, "
        "null}",
        "function_tool_path": "${oc.select:actor_rollout_ref.rollout.multi_turn.function_tool_path, "  # noqa: E501
        ""
        ""
        "null}",
        "return_raw_input_ids": False,
        "return_raw_chat": True,
        "return_full_prompt": False,
        "shuffle": True,
        "seed": None,
        "dataloader_num_workers": 8,
        "validation_shuffle": False,
        "filter_overlong_prompts_workers": 1,
        "trust_remote_code": False,
        "return_multi_modal_inputs": True,
    },
)
_add(
    DATA,
    IRRELEVANT,
    "trainer-side dataloader",
    {
        "cache_dir": "~/.cache/verl/rlhf", "chat_template_func": None, "need_tools_kwargs": False,
        "filter_prompts": True,
    },
    origin="verl-dataclass",
)
_add(
    DATA,
    IRRELEVANT,
    "trainer-side dataloader",
    {
        "datagen.name": None, "datagen.path": None, "sampler.class_name": None,
        "sampler.class_path": None,
    },
    origin="verl-0.6.1",
)
_add(DATA, UNSUPPORTED, "changes which rows or prompts are rolled out (use data.max_samples and "
     "rollout.agent.prompt_truncation)", {
         "train_max_samples": -1, "truncation": "error", "filter_overlong_prompts": False,
         "custom_cls.path": None, "custom_cls.name": None,
     })
_add(DATA, HONOURED, "passed to the chat template by agent loops (self.apply_chat_template_kwargs)",
     {"apply_chat_template_kwargs": {}}, open_keys=("apply_chat_template_kwargs",))
_add(
    DATA,
    HONOURED,
    "multimodal dataset columns, read into multi_modal_data as verl's "
    "RLHFDataset does "
    "(agentloop.batch.data.media_columns)",
    {"image_key": "images", "video_key": "videos"},
)
_add(DATA, UNSUPPORTED, "audio columns and processor options of the dataset are not read", {
    "audio_key": "audios", "image_patch_size": 14, "mm_processor_kwargs": {},
}, open_keys=("mm_processor_kwargs",))

SUBTREES: dict[str, Table] = {
    "actor_rollout_ref.rollout": ROLLOUT, "actor_rollout_ref.model": MODEL, "data": DATA,
}
"""Full path of each checked subtree -> its table."""

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""vLLM 0.32's ``LogprobsMode`` (``vllm.config.model``)."""


def parents(table: Table) -> set[str]:
    """Every inner node of a table (``multi_turn``, ``agent.custom_async_server``, ...)."""
    out: set[str] = set()
    for name in table:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out
