"""``agentloop verify``: recompute a saved rollout's log-probs with the HF model and check its
tool/user-turn tokens against the chat template.

:func:`verify_rollout` checks the inputs before loading any weights (each failure a one-line
:class:`~agentloop.errors.AgentLoopError`, CLI exit 2), recomputes every sampled token's log-prob
with the HF model (fp32, CPU) under the rollout's sampling parameters (its ``config.yaml``,
overridden by the arguments), compares them with ``rollout_log_probs``, runs the template check
(:mod:`agentloop.report.template_check`) when conversations were saved, and returns the verdict:
passed when no token differs by more than ``atol`` and no template check failed. Spec (the steps,
the log-prob definition, the tolerance): docs/report.md#agentloop-verify-output_dir---model-path.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import OmegaConf

from agentloop.config import EngineConfig, SamplingConfig
from agentloop.config.build import read_value
from agentloop.errors import ConfigError, DatasetError
from agentloop.report.outputs import HOW_TO_PRODUCE, load_rollout
from agentloop.report.template_check import TemplateProblem, check_trajectory

if TYPE_CHECKING:
    from agentloop.batch.protocol import DataProto

DEFAULT_ATOL = 1e-3
"""Default tolerance (nats).  Measured: vLLM CPU fp32 vs HF fp32 on the tiny model differ by at most
~3e-5 (tests/integration/test_logprobs_temperature.py, docs/report.md); a bf16 engine needs a much
larger one."""
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
MAX_BATCH_TOKENS = 16384


def _yaml_default(key: str) -> Any:
    """A default of ``agentloop/configs/rollout.yaml`` (``actor_rollout_ref.rollout.<key>``)."""
    return lambda: read_value(None, f"actor_rollout_ref.rollout.{key}")


@dataclass
class Sampling:
    """What the saved log-probs are log-probs of (fields left out: the YAML's defaults)."""

    temperature: float = field(default_factory=_yaml_default("temperature"))
    top_k: int = field(default_factory=_yaml_default("top_k"))
    top_p: float = field(default_factory=_yaml_default("top_p"))
    logprobs_mode: str = field(default_factory=_yaml_default("logprobs_mode"))
    source: str = "defaults"


@dataclass
class VerifyResult:
    """Numbers and problems found by :func:`verify_rollout`."""

    rows: int = 0
    tokens: int = 0
    deltas: np.ndarray = field(default_factory=lambda: np.zeros(0))
    worst: list[tuple[float, int, int, float, float]] = field(default_factory=list)
    """Largest deltas: (|delta|, row, response position, rollout log-prob, HF log-prob)."""
    rows_without_log_probs: int = 0
    template_rows: int | None = None
    """Rows whose conversation was checked; None when the rollout saved no ``messages``."""
    template_turns: int = 0
    template_problems: list[TemplateProblem] = field(default_factory=list)

    def over(self, atol: float) -> int:
        return int((self.deltas > atol).sum())

    def passed(self, atol: float) -> bool:
        return self.over(atol) == 0 and not self.template_problems


def sampling_of(output_dir: Path, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, logprobs_mode: str | None = None) -> Sampling:
    """The sampling parameters of the saved rollout (docs/report.md, verify step 2)."""
    spec = Sampling()
    config = output_dir / "config.yaml"
    if config.is_file():
        root = OmegaConf.load(config)
        sampling, engine = SamplingConfig.from_root(root), EngineConfig.from_root(root)
        spec = Sampling(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            logprobs_mode=engine.logprobs_mode, source=str(config),
        )
    given = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "logprobs_mode": logprobs_mode,
    }
    for key, value in given.items():
        if value is not None:
            setattr(spec, key, value)
            spec.source = "arguments" if spec.source == "defaults" else f"{spec.source} + arguments"
    if spec.logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(
            f"logprobs_mode {spec.logprobs_mode!r} cannot be verified: "
            f"rollout_log_probs are checked "
            f"only for {list(LOGPROBS_MODES)}"
        )
    if not spec.temperature > 0:
        raise ConfigError(f"temperature must be > 0 to verify log-probs, got {spec.temperature}")
    return spec


def check_log_probs(data: DataProto, path: Path) -> None:
    """DatasetError when the rollout has no usable ``rollout_log_probs``."""
    assert data.batch is not None
    fix = ("re-run the rollout with actor_rollout_ref.rollout.calculate_log_probs=true "
           "(`agentloop rollout ... actor_rollout_ref.rollout.calculate_log_probs=true`)")
    if "rollout_log_probs" not in data.batch:
        raise DatasetError(f"{path} has no rollout_log_probs: {fix}")
    mask = data.batch["response_mask"].bool()
    if mask.any() and not bool((data.batch["rollout_log_probs"][mask] != 0).any()):
        raise DatasetError(
            f"{path}: every rollout_log_probs value of a sampled token is "
            f"0.0 (no log-probs were "
            f"recorded): {fix}"
        )


def check_model(model_path: str, data: DataProto) -> Any:
    """The model's HF config, after checking that ``model_path`` is a local model whose vocabulary
    holds every token id of the rollout (no weights are loaded)."""
    # heavy (~1 s): the CLI imports this module for every command
    from transformers import AutoConfig

    path = Path(model_path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--model {model_path!r} is not a local HF model directory (no "
            f"config.json): pass the "
            "actor_rollout_ref.model.path the rollout was made with"
        )
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config
        raise ConfigError(
            f"--model {model_path!r}: cannot read its config.json ({type(e).__name__}: {e})"
        ) from e
    vocab = int(
        getattr(config, "vocab_size", 0) or getattr(config.get_text_config(), "vocab_size", 0)
    )
    assert data.batch is not None
    ids = data.batch["input_ids"][data.batch["attention_mask"].bool()]
    top = int(ids.max()) if ids.numel() else -1
    if vocab and top >= vocab:
        raise ConfigError(
            f"--model {model_path!r} has a vocabulary of {vocab} ids but the "
            f"rollout holds token id "
            f"{top}: it is not the model the rollout was made with (pass its "
            "actor_rollout_ref.model.path)"
        )
    return config


def _log_probs(logits: Any, targets: Any, spec: Sampling) -> Any:
    """Log-probs of ``targets`` [N] under ``logits`` [N, V] as the engine reported them
    (``spec``)."""
    # heavy (torch): the CLI imports this module for every command
    import torch

    if spec.logprobs_mode == "raw_logprobs":
        scaled = logits
    else:
        scaled = logits / spec.temperature
        if spec.top_k > 0:
            kth = scaled.topk(min(spec.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if spec.top_p < 1.0:
            probs, order = scaled.softmax(-1).sort(dim=-1, descending=True)
            drop_sorted = (probs.cumsum(-1) - probs) >= spec.top_p
            scaled = scaled.masked_fill(
                torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf")
            )
    return torch.log_softmax(scaled, -1).gather(-1, targets[:, None])[:, 0]


@dataclass
class Row:
    """One trajectory, unpadded."""

    index: int
    ids: list[int]
    """Prompt + response ids."""
    prompt_length: int
    response: np.ndarray
    mask: np.ndarray
    log_probs: np.ndarray

    def has_log_probs(self) -> bool:
        return bool((self.log_probs[self.mask.astype(bool)] != 0).any())


def _rows(data: DataProto) -> list[Row]:
    """Every row of ``data`` without its padding."""
    assert data.batch is not None
    b = data.batch
    p_len = b["prompts"].shape[1]
    attn = b["attention_mask"].numpy().astype(bool)
    out = []
    for i in range(len(data)):
        prompt = b["prompts"][i].numpy()[attn[i, :p_len]]
        keep = attn[i, p_len:]
        response = b["responses"][i].numpy()[keep]
        out.append(
            Row(
                i, [*prompt.tolist(), *response.tolist()], len(prompt), response,
                b["response_mask"][i].numpy()[keep],
                b["rollout_log_probs"][i].float().numpy()[keep],
            )
        )
    return out


def _media_inputs(data: DataProto) -> dict[int, dict[str, Any]]:
    """Row -> its ``multi_modal_inputs`` (pixel_values, image_grid_thw), for the rows that have
    images."""
    cells = data.non_tensor_batch.get("multi_modal_inputs")
    if cells is None:
        return {}
    return {
        i: dict(c)
        for i, c in enumerate(cells)
        if isinstance(c, dict) and c.get("pixel_values") is not None
    }


def recompute(model: Any, data: DataProto, spec: Sampling, result: VerifyResult) -> None:
    """Steps 3: fill ``result``'s deltas with |rollout - HF| over every compared token.  Rows with
    images run one at a time with their ``multi_modal_inputs`` (the model computes its own M-RoPE
    positions from them)."""
    # heavy (torch): the CLI imports this module for every command
    import torch

    media = _media_inputs(data)
    rows = [r for r in _rows(data) if r.mask.any()]
    result.rows_without_log_probs = sum(1 for r in rows if not r.has_log_probs())
    rows = sorted((r for r in rows if r.has_log_probs()), key=lambda r: len(r.ids))
    deltas: list[np.ndarray] = []

    def compare(r: Row, logits: Any) -> None:
        pos = np.nonzero(r.mask)[0]
        at = r.prompt_length + pos  # the token at `at` was predicted by the logits at `at - 1`
        hf = _log_probs(logits[at - 1], torch.tensor(r.ids)[at], spec).numpy().astype(np.float64)
        saved = r.log_probs[pos].astype(np.float64)
        delta = np.abs(hf - saved)
        deltas.append(delta)
        result.worst.extend((float(d), r.index, int(k), float(s), float(h))
                            for d, k, s, h in zip(delta, pos, saved, hf, strict=True))
        result.worst = sorted(result.worst, reverse=True)[:5]

    image_token = getattr(getattr(model, "config", None), "image_token_id", None)
    for r in [r for r in rows if r.index in media]:
        mm, ids = media[r.index], torch.tensor([r.ids])
        # 1: image token
        kinds = (ids == image_token).long() if image_token is not None else torch.zeros_like(ids)
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
                pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
            ).logits.float()
        compare(r, logits[0])
    rows = [r for r in rows if r.index not in media]
    start = 0
    # batches of rows of similar length (sorted), at most MAX_BATCH_TOKENS padded
    while start < len(rows):
        end = start + 1
        while end < len(rows) and len(rows[end].ids) * (end - start + 1) <= MAX_BATCH_TOKENS:
            end += 1
        group = rows[start:end]
        width = max(len(r.ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        attn = torch.zeros((len(group), width), dtype=torch.long)
        for j, r in enumerate(group):  # right padding: real tokens keep positions 0..L-1
            ids[j, :len(r.ids)] = torch.tensor(r.ids)
            attn[j, :len(r.ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits.float()
        for j, r in enumerate(group):
            compare(r, logits[j])
        start = end
    result.rows = len(deltas)
    result.deltas = np.concatenate(deltas) if deltas else np.zeros(0)
    result.tokens = int(result.deltas.size)


def check_templates(tokenizer: Any, data: DataProto, result: VerifyResult) -> None:
    """Step 4, for the rows that saved their conversation."""
    nt = data.non_tensor_batch
    if "messages" not in nt or "raw_prompt" not in nt:
        return
    result.template_rows = 0
    for r in _rows(data):
        messages, prompt = nt["messages"][r.index], nt["raw_prompt"][r.index]
        if not messages or prompt is None or not len(r.response):
            continue
        saved = [dict(m) for m in messages]
        # the prompt is what the conversation holds before the first sampled turn: the row's
        # raw_prompt for tool_agent, the environment's first messages for env_agent / self-play
        first = next((i for i, m in enumerate(saved) if m.get("role") == "assistant"), 0)
        if first:
            prompt_messages = saved[:first]
        else:
            prompt_messages = json.loads(prompt) if isinstance(prompt, str) else list(prompt)
        checked, problem = check_trajectory(
            tokenizer, r.index, prompt_messages, list(messages), r.response, r.mask
        )
        result.template_rows += 1
        result.template_turns += checked
        if problem is not None:
            result.template_problems.append(problem)


def verify_rollout(
    output_dir: str | Path, model_path: str, spec: Sampling | None = None
) -> VerifyResult:
    """Run the checks of docs/report.md (verify) on ``output_dir`` with the HF model at
    ``model_path``."""
    directory = Path(output_dir).expanduser()
    data = load_rollout(directory)
    check_log_probs(data, directory / "rollout.dataproto")
    check_model(model_path, data)
    spec = spec or sampling_of(directory)
    # heavy (torch, transformers): the CLI imports this module for every command
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # images: a VL model
    auto = AutoModelForImageTextToText if _media_inputs(data) else AutoModelForCausalLM
    model = auto.from_pretrained(str(Path(model_path).expanduser()), dtype=torch.float32).eval()
    result = VerifyResult()
    recompute(model, data, spec, result)
    if "messages" in data.non_tensor_batch:
        check_templates(
            AutoTokenizer.from_pretrained(str(Path(model_path).expanduser())), data, result
        )
    return result


def format_result(result: VerifyResult, atol: float, spec: Sampling) -> list[str]:
    """The lines ``agentloop verify`` prints."""
    d = result.deltas
    stats = (
        f"max {d.max():.2e}, p99 {np.percentile(d, 99):.2e}, mean {d.mean():.2e}"
        if d.size
        else "no tokens"
    )
    lines = [
        f"log-probs: {result.rows} trajectories, {result.tokens} sampled tokens; "
        f"|rollout - HF| {stats} nats; "
        f"{result.over(atol)} tokens over --atol {atol:g} (temperature "
        f"{spec.temperature:g}, top_k {spec.top_k}, "
        f"top_p {spec.top_p:g}, {spec.logprobs_mode}; from {spec.source})"
    ]
    if result.rows_without_log_probs:
        lines.append(
            f"  skipped {result.rows_without_log_probs} trajectories whose "
            f"log-probs are all 0.0 (their "
            "loop returned none)"
        )
    for delta, row, pos, saved, hf in result.worst[:5] if result.over(atol) else []:
        if delta > atol:
            lines.append(f"  row {row} response position {pos}: rollout {saved:.5f} vs HF {hf:.5f} "
                         f"(|delta| {delta:.2e})")
    if result.template_rows is None:
        lines.append("template: not checked (no messages column; roll out with "
                     "actor_rollout_ref.rollout.multi_turn.return_messages=true)")
    else:
        lines.append(
            f"template: {result.template_rows} conversations, "
            f"{result.template_turns} tool/user turns "
            f"(mask 0) checked; {len(result.template_problems)} mismatches"
        )
        lines += [f"  row {p.row}: {p.message}" for p in result.template_problems[:5]]
    verdict = "PASSED" if result.passed(atol) else "FAILED"
    lines.append(
        f"verify: {verdict}" + ("" if math.isfinite(atol) else " (atol inf: log-probs not judged)")
    )
    return lines


__all__ = [
    "DEFAULT_ATOL", "HOW_TO_PRODUCE", "Sampling", "VerifyResult", "format_result", "sampling_of",
    "verify_rollout",
]
