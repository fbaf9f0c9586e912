"""No silent config: unknown keys, unsupported verl keys, bad types, and the verl keys we honour
end to end."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from agentloop.config import CONFIG_DIR, default_config, resolve_config
from agentloop.configcheck import (
    DATA,
    HONOURED,
    IRRELEVANT,
    MODEL,
    ROLLOUT,
    SUBTREES,
    UNSUPPORTED,
    reset_warnings,
)
from agentloop.errors import ConfigError
from agentloop.servers.vllm import engine_args

VERL_KEYS = Path(__file__).parent / "data" / "verl091_trainer_keys.yaml"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()
    yield
    reset_warnings()


def trainer(model_dir, rollout=None, model=None, data=None):
    return {
        "actor_rollout_ref": {
            "model": {"path": str(model_dir), **(model or {})},
            "rollout": rollout or {},
        },
        "data": data or {},
    }


def config_warnings(caplog):
    """Every warning (or worse) any agentloop logger logged: a renamed logger cannot hide one."""
    return [r.getMessage() for r in caplog.records
            if r.name.partition(".")[0] == "agentloop" and r.levelno >= logging.WARNING]


def verl_generated(path: Path = VERL_KEYS) -> dict:
    """verl 0.9.1's generated trainer config, nested from the flat key list in
    ``tests/unit/data``."""
    root: dict = {}
    for dotted, value in yaml.safe_load(path.read_text()).items():
        *parents, leaf = dotted.split(".")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return root


def verl_shaped(model_dir):
    """A trainer config shaped like verl 0.9.1's generated one: verl's keys with verl's defaults
    (Hydra ``_target_`` entries and interpolations included), and the values a verl user must set.
    """
    rollout = {
        "_target_": "verl.workers.config.RolloutConfig",
        "name": "vllm",
        "mode": "async",
        "nnodes": 0,
        "n_gpus_per_node": "${oc.select:trainer.n_gpus_per_node,8}",
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1,
        "full_determinism": False,
        "seed": 42,
        "prompt_length": "${oc.select:data.max_prompt_length,512}",
        "response_length": "${oc.select:data.max_response_length,512}",
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "ignore_eos": False,
        "enforce_eager": False,
        "cudagraph_capture_sizes": None,
        "free_cache_engine": True,
        "tensor_model_parallel_size": 2,
        "data_parallel_size": 1,
        "expert_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "max_num_batched_tokens": 8192,
        "max_model_len": None,
        "max_num_seqs": 256,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "scheduling_policy": "fcfs",
        "load_format": "auto",
        "layered_summon": False,
        "log_prob_micro_batch_size": None,
        "log_prob_micro_batch_size_per_gpu": None,
        "log_prob_use_dynamic_bsz": "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}",
        "disable_log_stats": True,
        "do_sample": True,
        "n": 1,
        "over_sample_rate": 0,
        "multi_stage_wake_up": False,
        "engine_kwargs": {"vllm": {}, "sglang": {}, "trtllm": {}},
        "val_kwargs": {
            "_target_": "verl.workers.config.SamplingConfig", "top_k": -1, "top_p": 1.0,
            "temperature": 0, "n": 1, "do_sample": False,
        },
        "router_config_path": None,
        "multi_turn": {
            "_target_": "verl.workers.config.MultiTurnConfig", "enable": False,
            "max_assistant_turns": None, "tool_config_path": None, "function_tool_path": None,
            "max_user_turns": None, "max_parallel_calls": 1, "max_tool_response_length": 256,
            "tool_response_truncate_side": "middle", "use_inference_chat_template": False,
            "tokenization_sanity_check_mode": "strict", "format": "hermes",
            "num_repeat_rollouts": None,
        },
        "calculate_log_probs": True,
        "agent": {
            "_target_": "verl.workers.config.AgentLoopConfig",
            "num_workers": 8,
            "default_agent_loop": "single_turn_agent",
            "agent_loop_config_path": None,
            "custom_async_server": {
                "_target_": "verl.workers.config.CustomAsyncServerConfig", "path": None,
                "name": None,
            },
        },
        "checkpoint_engine": {
            "_target_": "verl.workers.config.CheckpointEngineConfig", "backend": "naive",
            "update_weights_bucket_megabytes": 2048, "engine_kwargs": {},
            "custom_backend_module": None,
        },
        "trace": {
            "_target_": "verl.workers.config.TraceConfig",
            "project_name": "${oc.select:trainer.project_name,null}",
            "experiment_name": "${oc.select:trainer.experiment_name,null}", "backend": None,
            "token2text": False, "max_samples_per_step_per_worker": None,
        },
        "skip_tokenizer_init": True,
        "enable_rollout_routing_replay": False,
        "moe_load_balance_metrics_interval": 0,
        "profiler": {
            "_target_": "verl.utils.profiler.ProfilerConfig",
            "tool": "${oc.select:global_profiler.tool,null}",
            "tool_config": {"torch": {"contents": [], "discrete": False}},
        },
        "prometheus": {
            "_target_": "verl.workers.config.PrometheusConfig", "enable": False, "port": 9090,
            "file": "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml",
            "served_model_name": "${oc.select:actor_rollout_ref.model.path,null}",
        },
        "quantization": None,
        "quantization_config_file": None,
        "mtp": "${oc.select:actor_rollout_ref.model.mtp, null}",
        "qat": "${oc.select:actor_rollout_ref.actor.fsdp_config.qat,"
        "${oc.select:actor_rollout_ref.actor.megatron.qat,null}}",
        "disaggregation": {
            "enabled": False, "prefill_replicas": 1, "decode_replicas": 1,
            "decode_tensor_model_parallel_size": None, "transfer_backend": "nixl",
            "bootstrap_port": None, "ib_device": None,
        },
    }
    model = {
        "_target_": "verl.workers.config.HFModelConfig",
        "hf_config_path": None,
        "tokenizer_path": None,
        "use_shm": False,
        "trust_remote_code": False,
        "custom_chat_template": None,
        "external_lib": None,
        "override_config": {},
        "enable_gradient_checkpointing": True,
        "use_remove_padding": True,
        "lora_rank": 0,
        "lora_alpha": 16,
        "target_modules": "all-linear",
        "fused_kernel_options": {"impl_backend": "torch"},
        "mtp": {
            "_target_": "verl.workers.config.MtpConfig", "enable": False, "enable_rollout": False,
            "method": "mtp", "num_speculative_tokens": 1,
        },
        "lora": {"type": "lora", "merge": False, "rank": 0, "alpha": 32, "adapter_path": None},
    }
    data = {
        "tokenizer": None,
        "use_shm": False,
        "train_files": "~/data/rlhf/gsm8k/train.parquet",
        "val_files": "~/data/rlhf/gsm8k/test.parquet",
        "train_max_samples": -1,
        "val_max_samples": -1,
        "prompt_key": "prompt",
        "reward_fn_key": "data_source",
        "max_prompt_length": 512,
        "max_response_length": 512,
        "train_batch_size": 1024,
        "gen_batch_size": None,
        "tool_config_path": "${oc.select:actor_rollout_ref.rollout.multi_turn.tool_config_path, "
        "null}",
        "return_raw_chat": True,
        "shuffle": True,
        "truncation": "error",
        "image_key": "images",
        "custom_cls": {"path": None, "name": None},
        "apply_chat_template_kwargs": {},
        "mm_processor_kwargs": {},
    }
    cfg = trainer(model_dir, rollout, model, data)
    cfg.update(
        {
            "trainer": {"n_gpus_per_node": 8, "project_name": "p"},
            "algorithm": {"adv_estimator": "grpo"},
            "actor_rollout_ref": {**cfg["actor_rollout_ref"], "actor": {"use_dynamic_bsz": False}},
        }
    )
    return cfg


def test_verl_shaped_config_loads_silently(model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = resolve_config(verl_shaped(model_dir))
    assert config_warnings(caplog) == []
    assert cfg.rollout.logprobs_mode == "processed_logprobs" and cfg.rollout.seed == 42
    assert cfg.rollout.calculate_log_probs is True and cfg.rollout.tensor_model_parallel_size == 2


def test_verls_own_generated_config_only_warns_about_dummy_weights(model_dir, caplog):
    cfg = OmegaConf.create(verl_generated())
    # verl's default, kept in the key list
    assert cfg.actor_rollout_ref.rollout.load_format == "dummy"
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.model.path = str(model_dir)
    with caplog.at_level(logging.WARNING):
        out = resolve_config(cfg)
    warnings = config_warnings(caplog)
    assert (
        len(warnings) == 1
        and "load_format=dummy" in warnings[0]
        and "RANDOM weights" in warnings[0]
    )
    assert out.rollout.load_format == "dummy"


def test_unknown_keys_are_rejected_by_default_with_suggestions(model_dir, caplog):
    """As verl's Hydra struct configs: a typo fails at start-up, naming the key, a suggestion and
    the fixes."""
    cfg = trainer(
        model_dir,
        {"temprature": 0.5, "multi_turn": {"max_asistant_turns": 2}, "tokenizer_path": "t"},
        data={"max_prompt_len": 10},
    )
    with pytest.raises(ConfigError) as e:
        resolve_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert (
        "actor_rollout_ref.rollout.temprature (did you mean "
        "actor_rollout_ref.rollout.temperature?)" in msg
    )
    assert (
        "multi_turn.max_asistant_turns (did you mean "
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns?)" in msg
    )
    assert "rollout.tokenizer_path (did you mean actor_rollout_ref.model.tokenizer_path?)" in msg
    assert "data.max_prompt_len (did you mean data.max_prompt_length?)" in msg
    # the escape hatches: verl's free-form slot for custom keys, and strict_config=false
    assert (
        "actor_rollout_ref.rollout.custom" in msg
        and "actor_rollout_ref.rollout.agent.strict_config=false" in msg
    )


def test_strict_config_false_only_warns_and_true_also_rejects_unsupported(model_dir, caplog):
    cfg = trainer(
        model_dir, {"temprature": 0.5, "data_parallel_size": 2, "agent": {"strict_config": False}}
    )
    with caplog.at_level(logging.WARNING):
        out = resolve_config(cfg)
    assert out.rollout.temperature == 1.0  # the typo had no effect, as the warning says
    unknown, unsupported = config_warnings(caplog)
    assert "temprature (did you mean actor_rollout_ref.rollout.temperature?)" in unknown
    assert "data_parallel_size=2" in unsupported
    cfg["actor_rollout_ref"]["rollout"]["agent"] = {"strict_config": True}
    with pytest.raises(ConfigError) as e:
        resolve_config(cfg)
    assert "temprature" in str(e.value) and "data_parallel_size=2" in str(e.value)
    assert "strict_config=true" in str(e.value)
    cfg["actor_rollout_ref"]["rollout"]["agent"] = {"strict_config": "yes"}
    with pytest.raises(ConfigError, match="strict_config=\"yes\" .*null, true or false"):
        resolve_config(cfg)


def test_misspelt_section_names_are_caught_but_other_sections_pass(model_dir):
    cfg = trainer(model_dir)
    cfg["actor_rollout_ref"]["rolout"] = {"temperature": 0.5}
    cfg["dat"] = {"train_files": "x.parquet"}
    with pytest.raises(ConfigError) as e:
        resolve_config(cfg)
    assert "actor_rollout_ref.rolout (did you mean actor_rollout_ref.rollout?)" in str(e.value)
    assert "dat (did you mean data?)" in str(e.value)
    # the trainer's own sections (verl's, or a recipe's) are not checked
    ok = {**trainer(model_dir), "critic": {"anything": 1}, "my_recipe": {"x": 1}}
    ok["actor_rollout_ref"]["actor"] = {"ppo_mini_batch_size": 4}
    resolve_config(ok)


def test_custom_keys_under_verls_extension_slot_are_accepted_silently(model_dir, caplog):
    cfg = trainer(model_dir, {"custom": {"my_loop": {"max_steps": 4}}})
    with caplog.at_level(logging.WARNING):
        out = resolve_config(cfg)
    assert config_warnings(caplog) == []
    # custom loops read it from their rollout config
    assert out.rollout.custom.my_loop.max_steps == 4


def test_rollout_only_config_gets_the_same_check(model_dir, caplog):
    with pytest.raises(
        ConfigError,
        match=r"temprature \(did you mean " r"actor_rollout_ref.rollout.temperature\?\)",
    ):
        resolve_config({"temprature": 0.5, "top_p": 0.9}, model_path=str(model_dir))
    with caplog.at_level(logging.WARNING):
        cfg = resolve_config({"temprature": 0.5, "top_p": 0.9, "agent": {"strict_config": False}},
                             model_path=str(model_dir))
    assert cfg.rollout.top_p == 0.9
    (msg,) = config_warnings(caplog)
    assert "temprature (did you mean actor_rollout_ref.rollout.temperature?)" in msg


def test_unsupported_non_default_keys_warn_once_in_one_message(model_dir, caplog):
    cfg = trainer(
        model_dir,
        {"data_parallel_size": 2, "prometheus": {"enable": True}, "expert_parallel_size": 1},
        model={"lora_rank": 8}, data={"apply_chat_template_kwargs": {"enable_thinking": False}},
    )
    with caplog.at_level(logging.WARNING):
        resolve_config(cfg)
        resolve_config(cfg)  # the manager resolves again: no second warning
    (msg,) = config_warnings(caplog)
    for key in (
        "actor_rollout_ref.rollout.data_parallel_size=2",
        "actor_rollout_ref.rollout.prometheus.enable=True", "actor_rollout_ref.model.lora_rank=8",
    ):
        assert key in msg
    # honoured: agent loops pass it to the chat template
    assert "apply_chat_template_kwargs" not in msg
    assert "expert_parallel_size" not in msg  # verl's default value: nothing to report
    assert "see docs/config.md" in msg
    cfg["actor_rollout_ref"]["rollout"]["agent"] = {"strict_config": True}
    with pytest.raises(ConfigError, match="data_parallel_size=2"):
        resolve_config(cfg)


def test_irrelevant_keys_are_silent_even_when_set(model_dir, caplog):
    cfg = trainer(
        model_dir,
        {
            "log_prob_micro_batch_size_per_gpu": 4, "multi_turn": {"enable": True},
            "checkpoint_engine": {"backend": "nccl"}, "profiler": {"enable": True, "anything": 1},
        },
        model={
            "enable_gradient_checkpointing": False,
            "override_config": {"attention_dropout": 0.1},
        },
        data={"shuffle": False, "dataloader_num_workers": 2},
    )
    with caplog.at_level(logging.WARNING):
        resolve_config(cfg)
    assert config_warnings(caplog) == []


@pytest.mark.parametrize("key,value,expected", [
    ("temperature", "hot", 'temperature="hot" (str): expected a number >= 0'),
    ("top_p", 0, "top_p=0 (int): expected a number in (0, 1]"),
    ("top_k", 1.5, "top_k=1.5 (float): expected an int >= -1"),
    ("n", 0, "n=0 (int): expected a positive int"),
    ("response_length", -1, "response_length=-1 (int): expected a positive int"),
    ("calculate_log_probs", "yes", 'calculate_log_probs="yes" (str): expected true or false'),
    ("repetition_penalty", None, "repetition_penalty=None (NoneType): expected a number > 0"),
    ("logprobs_mode", "logits", 'logprobs_mode="logits" (str): expected one of raw_logprobs'),
    ("scheduling_policy", "lifo", 'scheduling_policy="lifo" (str): expected one of fcfs, priority'),
])
def test_bad_types_raise_before_anything_starts(tmp_path, key, value, expected):
    # the type error comes before the model-path check
    cfg = trainer(tmp_path / "no-model-here", {key: value})
    with pytest.raises(ConfigError) as e:
        resolve_config(cfg)
    assert f"actor_rollout_ref.rollout.{expected}" in str(e.value)


def test_all_type_errors_in_one_message(model_dir):
    with pytest.raises(ConfigError) as e:
        resolve_config(
            {"temperature": "hot", "val_kwargs": {"top_k": "x"}, "agent": {"num_workers": 0}},
            model_path=str(model_dir),
        )
    text = str(e.value)
    assert "temperature" in text and "val_kwargs.top_k" in text and "agent.num_workers" in text


def test_key_tables_cover_our_defaults_and_mark_our_keys():
    defaults = OmegaConf.to_container(default_config(), resolve=False)

    def leaves(node, rel=""):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{rel}{k}.")
            else:
                yield f"{rel}{k}"

    for sub, table in SUBTREES.items():
        node = defaults
        for part in sub.split("."):
            node = node[part]
        missing = [k for k in leaves(node) if k not in table]
        assert missing == [], f"{sub}: add these to agentloop/configcheck/keys.py: {missing}"
    # every key marked "agentloop:" in rollout.yaml (and every key under a marked section) is ours
    # in the table
    marked: list[str] = []
    stack: list[tuple[int, str, bool]] = []
    for line in (CONFIG_DIR / "rollout.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_]+):", line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inherited = bool(stack) and stack[-1][2]
        mine = inherited or "# agentloop:" in line
        path = ".".join([s[1] for s in stack] + [m.group(2)])
        stack.append((indent, m.group(2), mine))
        if mine:
            marked.append(path)
    for path in marked:
        for sub, table in SUBTREES.items():
            rel = path[len(sub) + 1:] if path.startswith(sub + ".") else None
            if rel in table:
                assert table[rel].origin == "agentloop", path
    ours = {
        f"{sub}.{k}" for sub, t in SUBTREES.items() for k, e in t.items() if e.origin == "agentloop"
    }
    assert ours <= set(marked), ours - set(marked)
    statuses = {e.status for t in (ROLLOUT, MODEL, DATA) for e in t.values()}
    assert statuses == {HONOURED, IRRELEVANT, UNSUPPORTED}


def vllm_args(cfg, on_cpu: bool, server_index: int = 0) -> dict:
    """The vLLM engine arguments a server of this resolved config gets."""
    return engine_args(cfg.engine, cfg.server, cfg.model_config, on_cpu, server_index)


def test_engine_args_honour_verl_keys(model_dir):
    cfg = resolve_config(
        trainer(
            model_dir,
            {
                "load_format": "dummy", "logprobs_mode": "raw_logprobs",
                "scheduling_policy": "priority", "cudagraph_capture_sizes": [1, 2, 4],
            },
            model={"tokenizer_path": "~/tok"},
        )
    )
    cpu = vllm_args(cfg, on_cpu=True)
    assert cpu["load_format"] == "dummy" and cpu["logprobs_mode"] == "raw_logprobs"
    assert (
        cpu["scheduling_policy"] == "priority"
        and cpu["tokenizer"].endswith("/tok")
        and "~" not in cpu["tokenizer"]
    )
    assert "cudagraph_capture_sizes" not in cpu
    assert cpu["seed"] == 0 and vllm_args(cfg, on_cpu=True, server_index=3)["seed"] == 3
    assert vllm_args(cfg, on_cpu=False)["cudagraph_capture_sizes"] == [1, 2, 4]
    plain = resolve_config(trainer(model_dir))
    args = vllm_args(plain, on_cpu=True)
    assert (
        args["load_format"] == "auto"
        and args["logprobs_mode"] == "processed_logprobs"
        and "tokenizer" not in args
    )


def test_dummy_weights_are_announced(model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        resolve_config(trainer(model_dir, {"load_format": "dummy"}))
    (msg,) = config_warnings(caplog)
    assert "RANDOM weights" in msg and "load_format=auto" in msg


def _save_word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]",
        chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
    )
    fast.save_pretrained(str(path))


def test_tokenizer_path_and_custom_chat_template_are_honoured(tmp_path, model_dir, caplog):
    from agentloop.tokenization.loader import load_processor, load_tokenizer

    tok_dir = tmp_path / "tok"
    _save_word_tokenizer(tok_dir)
    msgs = [{"role": "user", "content": "hello world"}]
    # model_dir has no tokenizer at all
    model = {"path": str(model_dir), "tokenizer_path": str(tok_dir)}
    tok = load_tokenizer(model)
    assert tok.apply_chat_template(msgs, tokenize=False) == "[hello world]"
    assert tok.encode("hello world", add_special_tokens=False) == [2, 3]
    custom = load_tokenizer({**model, "custom_chat_template": "<{{ messages[0]['content'] }}>"})
    assert custom.apply_chat_template(msgs, tokenize=False) == "<hello world>"
    assert load_processor(model) is None  # text-only: answered from the directory listing
    (tok_dir / "preprocessor_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="agentloop.tokenization.loader"):
        assert load_processor(model) is None  # a broken processor never stops a text rollout
    assert any("no processor loaded" in r.getMessage() for r in caplog.records)


def test_trace_backend_verl_has_but_we_do_not_is_refused_before_engines(model_dir):
    with pytest.raises(ConfigError, match="trace.backend.*jsonl"):
        resolve_config(trainer(model_dir, {"trace": {"backend": "weave"}}))
    assert (
        resolve_config(trainer(model_dir, {"trace": {"backend": "jsonl"}})).rollout.trace.backend
        == "jsonl"
    )


def test_verl_keys_the_config_lacks_get_verl_defaults_for_verl_loops(model_dir):
    cfg = resolve_config(trainer(model_dir, {}))
    assert cfg.rollout.full_determinism is False and cfg.root.data.return_raw_chat is True
    assert cfg.rollout.multi_turn.function_tool_path is None
