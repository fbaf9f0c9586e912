"""A tiny reasoning model: the tiny model's weights and tokenizer, a Qwen3-thinking-style template.

:data:`REASONING_TEMPLATE` is the tiny model's ChatML + hermes format with a ``<think>`` section,
written for this repo after the rendering rules of Qwen3's thinking templates: the generation
prompt opens ``<think>\\n`` (as Qwen3-thinking-2507, QwQ and DeepSeek-R1 do); an assistant turn
after the last user query is rendered with its reasoning (``reasoning_content``) as
``<think>\\n…\\n</think>\\n\\n`` before its content; turns before the last user query lose their
reasoning.  Its reasoning parser is :data:`REASONING_PARSER`.  :func:`ensure_tiny_reasoning_model`
writes the model directory (no training: the weights are the tiny model's, which never learnt
``</think>``, so its whole output is reasoning).  Spec: docs/gateway.md#reasoning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from agentloop.testing.tiny_corpus import DEFAULT_SYSTEM_PROMPT, TOOLS_FOOTER, TOOLS_HEADER
from agentloop.testing.tiny_model import cache_dir, ensure_tiny_model

REASONING_PARSER = "deepseek_r1"
"""The ``gateway.reasoning_parser`` of :data:`REASONING_TEMPLATE` (its prompt opens ``<think>``)."""
DEFAULT_NAME = "tiny-qwen2-reasoning"
MARKER = "agentloop_tiny_reasoning.json"

REASONING_TEMPLATE = (
    r"""{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}
    {%- else %}{{- '""" + DEFAULT_SYSTEM_PROMPT + r"""' }}{%- endif %}
    {{- '""" + TOOLS_HEADER.replace("\n", r"\n") + r"""' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '""" + TOOLS_FOOTER.replace("\n", r"\n") + r"""<|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' ~ message.content ~ '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = message.reasoning_content %}
        {%- set reasoning = reasoning if reasoning is string else '' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\n' ~ reasoning.strip('\n') ~ '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ (message.content or '') ~ '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role is defined and message.role %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ (message.content or '') ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}"""
)


def tiny_reasoning_model_path() -> Path:
    """Where :func:`ensure_tiny_reasoning_model` writes by default (the model cache)."""
    return cache_dir() / DEFAULT_NAME


def _stamp(source: Path) -> dict[str, str]:
    """What the directory is built from: the template's and the source model's hashes."""
    weights = (source / "model.safetensors").read_bytes()
    return {"template_sha256": hashlib.sha256(REASONING_TEMPLATE.encode()).hexdigest(),
            "weights_sha256": hashlib.sha256(weights).hexdigest()}


def ensure_tiny_reasoning_model(path: str | Path | None = None) -> Path:
    """The tiny model (:func:`~agentloop.testing.tiny_model.ensure_tiny_model`) copied to ``path``
    (default :func:`tiny_reasoning_model_path`) with :data:`REASONING_TEMPLATE` as its template.

    Idempotent (a marker file records what it was built from); written to a temporary directory and
    renamed into place.  Returns the directory.
    """
    source = ensure_tiny_model()
    target = Path(path).expanduser().absolute() if path is not None else tiny_reasoning_model_path()
    stamp = _stamp(source)
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for item in source.iterdir():
            if item.is_file() and not item.name.startswith("agentloop_"):
                shutil.copy2(item, tmp / item.name)
        (tmp / "chat_template.jinja").write_text(REASONING_TEMPLATE)
        config_file = tmp / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config.pop("chat_template", None)  # chat_template.jinja is the template
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / MARKER).write_text(json.dumps(stamp, indent=2) + "\n")
        tmp.chmod(0o755)
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        if target.exists():
            os.replace(target, old / target.name)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
