"""Where each verl module a custom agent loop imports lives in agentloop.

A verl user ports a loop file by rewriting its imports (``agentloop port FILE``,
:mod:`agentloop.compat.port`) with :data:`VERL_IMPORT_MAP`.  Modules verl loops import that
agentloop deliberately does not provide are in :data:`VERL_NOT_PROVIDED`, each with the reason and
what to use instead.  Both tables are rendered into ``docs/porting-from-verl.md``
(``python -m agentloop.compat.import_map`` prints the import-map table; a test checks the doc and
this module agree).

Matching rules:

* an import statement's module must be a key of the map (``import verl.x.y`` needs ``verl.x.y``): a
  prefix is not enough, because agentloop's packages are not laid out like verl's;
* a dotted reference in code (``verl.utils.profiler.simple_timer``, after a plain
  ``import verl...``) is rewritten by the longest key that prefixes it; the bare ``verl`` key only
  covers verl's top-level names (:data:`VERL_TOP_LEVEL_NAMES`), since everything else under
  ``verl.`` is a subpackage.
"""

from __future__ import annotations

from agentloop.errors import AgentLoopError

DOCS = "docs/porting-from-verl.md"
DOCS_IMPORT_MAP = f"{DOCS}#import-map"
DOCS_NOT_PROVIDED = f"{DOCS}#not-provided"

_ENTRIES: dict[str, str] = {
    "verl": "agentloop", "verl.protocol": "agentloop.protocol",
    "verl.experimental.agent_loop": "agentloop.compat.agent_loop",
    "verl.experimental.agent_loop.agent_loop": "agentloop.compat.agent_loop",
    "verl.experimental.agent_loop.tool_parser": "agentloop.parsers.base",
    "verl.experimental.agent_loop.utils": "agentloop.compat.gpt_oss_utils",
    "verl.experimental.agent_loop.single_turn_agent_loop": "agentloop.loops.single_turn",
    "verl.experimental.agent_loop.tool_agent_loop": "agentloop.loops.tool_agent",
    "verl.workers.rollout.replica": "agentloop.types",
    "verl.workers.rollout.llm_server": "agentloop.routing",
    "verl.workers.rollout.async_server": "agentloop.routing",
    "verl.tools.schemas": "agentloop.tools.schemas", "verl.tools.base_tool": "agentloop.tools.base",
    "verl.tools.function_tool": "agentloop.tools.function_tool",
    "verl.tools.tool_registry": "agentloop.tools.registry",
    "verl.tools.utils.tool_registry": "agentloop.tools.registry",
    "verl.tools.gsm8k_tool": "agentloop.tools.gsm8k",
    "verl.interactions.base": "agentloop.interactions.base",
    "verl.interactions.utils.interaction_registry": "agentloop.interactions.registry",
    "verl.utils.profiler": "agentloop.compat.profiler",
    "verl.utils.rollout_trace": "agentloop.compat.rollout_trace",
    "verl.utils.tensordict_utils": "agentloop.utils.tensordict_utils",
}

VERL_IMPORT_MAP: dict[str, str] = dict(
    sorted(_ENTRIES.items(), key=lambda kv: (-kv[0].count("."), kv[0]))
)
"""verl module → agentloop module, most specific (deepest) first."""

VERL_TOP_LEVEL_NAMES: frozenset[str] = frozenset({"DataProto", "__version__"})
"""What ``verl/__init__.py`` exports; ``verl.<other>`` is a verl subpackage, not a name in
``agentloop``."""

VERL_NOT_PROVIDED: dict[str, str] = {
    "verl.experimental.agent_loop.prometheus_utils": (
        "Prometheus wiring of verl's server replicas; agentloop servers are not scraped by "
        "Prometheus"
    ),
    "verl.experimental.reward": "reward workers belong to the trainer; set "
    "AgentLoopOutput.reward_score in the loop",
    "verl.experimental.reward_loop": (
        "reward workers belong to the trainer; set AgentLoopOutput.reward_score in the loop"
    ),
    "verl.experimental.teacher_loop": "distillation teachers are not supported",
    "verl.single_controller": (
        "worker groups: pass yours as AgentLoopManager(config, worker_group) for colocated "
        "servers; the "
        "manager places them itself (docs/concepts.md, Placement)"
    ),
    "verl.workers.config": "typed verl configs: read the same keys from the DictConfig the "
    "loop receives",
    "verl.workers.rollout.schemas": "verl's SGLang-era request schemas (Message, ...): use "
    "OpenAI message dicts",
    "verl.utils": "hf_tokenizer / hf_processor: loops receive tokenizer and processor; else "
    "use transformers.Auto*",
    "verl.utils.fs": "copy_to_local: pass a local path",
    "verl.utils.model": "compute_position_id_with_mask: agentloop computes position ids "
    "after the loop returns",
    "verl.models.transformers.qwen2_vl": "get_rope_index: agentloop computes M-RoPE "
    "position ids itself",
    "verl.utils.ray_utils": "get_event_loop: use asyncio.get_running_loop() inside the loop",
    "verl.utils.dataset.rl_dataset": "RLHFDataset: agentloop.data.load_dataset reads "
    "parquet / jsonl into a DataProto",
    "verl.utils.transferqueue_utils": "TransferQueue is not supported; outputs return as a "
    "DataProto",
    "verl.utils.tokenizer": "verl 0.9's token builders are the ct_* methods of AgentLoopBase",
    "verl.utils.import_utils": "resolve_config_path: pass an absolute or "
    "working-directory-relative path",
    "verl.utils.config": "omega_conf_to_dataclass: read the keys from the DictConfig",
    "verl.utils.reward_score": "scoring functions: point custom_reward_function.{path,name} "
    "at your scorer (verl's "
    "signature); agentloop.rewards has calculator and gsm8k compute_score",
    "verl.trainer": "the PPO trainer is not part of agentloop; run verl's own trainer with "
    "agentloop's manager (python -m agentloop.compat.verl_main) or call "
    "AgentLoopManager.generate_sequences from yours",
}
"""verl modules that loops import which agentloop deliberately does not provide → reason and
replacement.

An entry covers its submodules too (``verl.single_controller.ray``), except those in
:data:`_EXACT_ONLY`.
"""

_EXACT_ONLY = frozenset({"verl.utils"})
"""Not-provided entries that say nothing about their submodules (``verl.utils.profiler`` is
mapped)."""

_NAME_HINTS: dict[str, str] = {
    "AgentLoopWorkerBase": "subclassing the worker is not supported; customise the loop "
    "(AgentLoopBase) instead",
    "_InternalAgentLoopOutput": "padding is internal to agentloop; return AgentLoopOutput "
    "from the loop",
    "_DummyConfig": "loops receive the rollout config; see the loop-constructor note in the docs",
    "RolloutReplica": "servers are started by AgentLoopManager; see agentloop.servers",
    "get_rollout_replica_class": "servers are started by AgentLoopManager; see agentloop.servers",
    "LLMServerManager": "AgentLoopManager starts the servers; loops call "
    "AsyncLLMServerManager.generate",
    "FullyAsyncLLMServerClient": "fully-async rollout is not supported yet; use "
    "AsyncLLMServerManager",
    "GPUMemoryLogger": "trainer-side memory logging; use torch.cuda.memory_allocated() "
    "where you need it",
    "log_gpu_memory_usage": "trainer-side memory logging; use torch.cuda.memory_allocated() "
    "where you need it",
    "DistProfiler": "device profilers are not wired into agentloop",
    "DistProfilerExtension": "device profilers are not wired into agentloop",
    "ProfilerConfig": "device profilers are not wired into agentloop",
    "HermesToolParser": "built-in parsers are in agentloop.parsers (or "
    "get_tool_parser('hermes', tokenizer))",
    "GptOssToolParser": "built-in parsers are in agentloop.parsers (or "
    "get_tool_parser('gpt-oss', tokenizer))",
}


class MissingVerlNameError(AgentLoopError, ImportError):
    """A verl name that agentloop's mirror of a verl module does not provide.

    An ImportError (not an AttributeError) so that ``from mirror import Name`` shows this message
    instead of Python's generic "cannot import name".
    """


def is_verl_module(module: str | None) -> bool:
    """True for ``verl`` and ``verl.*`` (and False for ``verl_utils`` or a relative import)."""
    return module is not None and (module == "verl" or module.startswith("verl."))


def map_module(verl_module: str) -> str | None:
    """The agentloop module an import of ``verl_module`` becomes, or None when it is not in the
    map."""
    return VERL_IMPORT_MAP.get(verl_module)


def map_reference(dotted: str) -> tuple[str, str] | None:
    """``(matched verl prefix, agentloop replacement)`` for a dotted reference in code, or None.

    The longest key that equals ``dotted`` or prefixes it at a dot wins; the bare ``verl`` key only
    matches ``verl.<top-level name>`` (see :data:`VERL_TOP_LEVEL_NAMES`).
    """
    for key, target in VERL_IMPORT_MAP.items():  # deepest first
        if key == "verl":
            head = dotted.split(".")[1] if "." in dotted else None
            return (key, target) if head in VERL_TOP_LEVEL_NAMES else None
        if dotted == key or dotted.startswith(key + "."):
            return key, target
    return None


def not_provided_reason(verl_module: str) -> tuple[str, str] | None:
    """``(verl module or package, reason)`` when ``verl_module`` (or a package above it) is not
    provided."""
    parts = verl_module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in VERL_NOT_PROVIDED and (key == verl_module or key not in _EXACT_ONLY):
            return key, VERL_NOT_PROVIDED[key]
    return None


def unknown_module_message(verl_module: str) -> str:
    """What to tell a user whose file imports ``verl_module``, which is not in the map."""
    found = not_provided_reason(verl_module)
    if found is not None:
        return f"{verl_module} is not provided by agentloop ({found[1]}); see {DOCS_NOT_PROVIDED}"
    return (
        f"{verl_module} has no agentloop counterpart in the import map; port what the loop "
        f"uses from it by "
        f"hand (see {DOCS_IMPORT_MAP} for the modules that are mapped)"
    )


def missing_verl_name(verl_module: str, name: str) -> str:
    """The message for ``from <verl_module> import <name>`` when the agentloop counterpart lacks
    ``name``.

    Used by the mirror modules (:mod:`agentloop.compat.agent_loop`,
    :mod:`agentloop.compat.profiler`, ...) in their module ``__getattr__`` and by ``agentloop port``
    when it checks the names a file imports.
    """
    target = map_module(verl_module) or "agentloop"
    hint = _NAME_HINTS.get(name)
    why = f": {hint}" if hint else ""
    return (
        f"verl's {verl_module}.{name} is not provided by agentloop ({target}, where "
        f"{verl_module} is "
        f"mirrored, has no {name!r}){why}. See {DOCS_NOT_PROVIDED} and {DOCS_IMPORT_MAP}"
    )


def import_map_markdown() -> str:
    """The import map as the Markdown table embedded in the docs (alphabetical, for readers)."""
    rows = ["| verl module | agentloop module |", "| --- | --- |"]
    rows += [f"| `{verl}` | `{ours}` |" for verl, ours in sorted(VERL_IMPORT_MAP.items())]
    return "\n".join(rows)


def not_provided_markdown() -> str:
    """The not-provided list as the Markdown table embedded in the docs."""
    rows = ["| verl module | why not, and what to use instead |", "| --- | --- |"]
    rows += [f"| `{verl}` | {reason} |" for verl, reason in sorted(VERL_NOT_PROVIDED.items())]
    return "\n".join(rows)


if __name__ == "__main__":
    print(import_map_markdown())
    print()
    print(not_provided_markdown())
