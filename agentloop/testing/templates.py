"""Chat templates of four tool-calling families, written for this repo, and small tokenizers to go
with them.

``chatml_hermes`` (Qwen2.5), ``qwen3``, ``llama3_json`` (Llama 3.1-3.3) and ``harmony`` (gpt-oss)
reproduce the rendering format of the vendors' templates (not their text), so that
:func:`agentloop.tokenization.check_incremental` runs on each family without downloading a model;
:data:`STOP_TOKENS` holds each family's end-of-turn tokens, and :func:`make_template_tokenizer`
trains a small byte-level BPE tokenizer for a family (cached).  Spec (each family's format, where
harmony differs from OpenAI's template): docs/tokenization.md#test-chat-templates.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentloop.testing.tiny_model import (
    CHAT_TEMPLATE,
    PRETOKENIZE_REGEX,
    TOOLS_FOOTER,
    TOOLS_HEADER,
    synthetic_corpus,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def _lit(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return json.dumps(text)


CHATML_HERMES = CHAT_TEMPLATE

QWEN3 = (
    r"""{%- macro text(x) -%}
    {%- if x is none -%}{%- elif x is string -%}{{- x -}}{%- else -%}{{- x | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')
        and m.content.endswith('</tool_response>')) %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- """
    + _lit(TOOLS_HEADER.lstrip("\n"))
    + r""" }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- """
    + _lit(TOOLS_FOOTER)
    + r""" + '<|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'assistant' %}
        {%- set content = text(message.content) %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""
)

LLAMA_TOOLS_PROMPT = (
    "Answer with a JSON function call if one of these functions helps with the request. Use "
    "the form "
    '{"name": function name, "parameters": object of argument names and values}. Use '
    "literal values, not "
    "variables.\n\n"
)

LLAMA3_JSON = (
    r"""{%- macro text(x) -%}
    {%- if x is none -%}{%- elif x is string -%}{{- x -}}{%- else -%}{{- x | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- macro tool_block(tools) -%}
    {{- """
    + _lit(LLAMA_TOOLS_PROMPT)
    + r""" -}}
    {%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\n\n' -}}{%- endfor -%}
{%- endmacro -%}
{%- set in_user = tools_in_user_message if tools_in_user_message is defined else true %}
{%- set ns = namespace(pending=true if (tools and in_user) else false) %}
{{- bos_token }}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + (date_string if date_string is defined else '26 Jul 2024')
    + '\n\n' }}
{%- if tools and not in_user %}{{- tool_block(tools) }}{%- endif %}
{%- if messages and messages[0].role == 'system' %}{{- text(messages[0].content) | trim }}{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if not loop.first %}{{- '; ' }}{%- endif %}
            {{- '{"name": "' + fn.name + '", "parameters": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + text(message.content) + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
        {%- if message.role == 'user' and ns.pending %}
            {{- tool_block(tools) }}
            {%- set ns.pending = false %}
        {%- endif %}
        {{- (text(message.content) | trim) + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if ns.pending %}{{- raise_exception('tools go into the first user message, and there is none') }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""
)

HARMONY_CHANNELS = (
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)

HARMONY = (
    r"""{%- macro text(x) -%}
    {%- if x is none -%}{%- elif x is string -%}{{- x -}}{%- else -%}{{- x | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- macro ts_type(s) -%}
    {%- if s.enum is defined -%}
        {%- for v in s.enum -%}{{- (' | ' if not loop.first else '') + (v | tojson) -}}{%- endfor -%}
    {%- elif s.type == 'string' -%}{{- 'string' -}}
    {%- elif s.type in ['integer', 'number'] -%}{{- 'number' -}}
    {%- elif s.type == 'boolean' -%}{{- 'boolean' -}}
    {%- elif s.type == 'array' -%}{{- (ts_type(s['items']) if s['items'] is defined else 'any') + '[]' -}}
    {%- else -%}{{- 'any' -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro ts_namespace(tools) -%}
    {{- '## functions\n\nnamespace functions {\n\n' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {%- if fn.description -%}{{- '// ' + fn.description + '\n' -}}{%- endif -%}
        {%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} -%}
        {%- if params.properties -%}
            {{- 'type ' + fn.name + ' = (_: {\n' -}}
            {%- for pname, p in params.properties.items() -%}
                {%- if p.description -%}{{- '// ' + p.description + '\n' -}}{%- endif -%}
                {{- pname + ('' if pname in (params.required or []) else '?') + ': ' + ts_type(p) + ',\n' -}}
            {%- endfor -%}
            {{- '}) => any;\n\n' -}}
        {%- else -%}
            {{- 'type ' + fn.name + ' = () => any;\n\n' -}}
        {%- endif -%}
    {%- endfor -%}
    {{- '} // namespace functions' -}}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role in ['system', 'developer'] %}
{%- set end_rewrite = return_as_end is defined and return_as_end %}
{{- '<|start|>system<|message|>' + (model_identity if model_identity is defined else 'You are a helpful assistant.')
    + '\nKnowledge cutoff: 2024-06\n\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium')
    + '\n\n' + """
    + _lit(HARMONY_CHANNELS)
    + r""" }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- if has_system or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if has_system %}{{- '# Instructions\n\n' + text(messages[0].content) }}{%- endif %}
    {%- if has_system and tools %}{{- '\n\n' }}{%- endif %}
    {%- if tools %}{{- '# Tools\n\n' + ts_namespace(tools) }}{%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set ns = namespace(tool_name='') %}
{%- for message in messages %}
    {%- set later = namespace(final=false) %}
    {%- for m in messages[loop.index0 + 1:] %}
        {%- if m.role == 'assistant' and not m.tool_calls %}{%- set later.final = true %}{%- endif %}
    {%- endfor %}
    {%- if has_system and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception('harmony: one tool call per message') }}
        {%- endif %}
        {%- if message.thinking and message.content %}
            {{- raise_exception('harmony: a tool-call message has thinking or content, not both') }}
        {%- endif %}
        {%- set fn = message.tool_calls[0].function if message.tool_calls[0].function is defined
            else message.tool_calls[0] %}
        {%- set analysis = message.thinking or message.content %}
        {%- if analysis and not later.final %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + analysis + '<|end|>' }}
        {%- endif %}
        {{- '<|start|>assistant to=functions.' + fn.name + '<|channel|>commentary json<|message|>' }}
        {{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '<|call|>' }}
        {%- set ns.tool_name = fn.name %}
    {%- elif message.role == 'assistant' %}
        {%- if message.thinking and loop.last and not add_generation_prompt %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + text(message.content) }}
        {{- '<|end|>' if end_rewrite and not (loop.last and not add_generation_prompt) else '<|return|>' }}
    {%- elif message.role == 'tool' %}
        {%- set name = message.name if message.name is defined and message.name else ns.tool_name %}
        {%- if not name %}{{- raise_exception('harmony: a tool message needs a preceding tool call') }}{%- endif %}
        {{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' }}
        {{- text(message.content) + '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message.role + '<|message|>' + text(message.content) + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""
)

LLAMA3_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PRETOKENIZE_REGEX = "|".join(
    (
        
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
    )
)


@dataclass(frozen=True)
class TemplateFamily:
    """A chat template with the tokens and conventions an engine and an agent loop need."""

    name: str
    chat_template: str
    special_tokens: tuple[str, ...]  # special: dropped by decode(skip_special_tokens=True)
    added_tokens: tuple[str, ...]  # single tokens that are not special (tool / think tags)
    eos_token: str
    pad_token: str
    stop_tokens: tuple[str, ...]  # the engine stops on these; a sampled turn ends with one of them
    pretokenize_regex: str
    bos_token: str | None = None
    reasoning_key: str | None = None  # the message field the template reads reasoning from
    max_calls_per_turn: int = 8


_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_HERMES_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, TemplateFamily] = {
    "chatml_hermes": TemplateFamily(
        "chatml_hermes", CHATML_HERMES, _QWEN_SPECIAL, _HERMES_TAGS, "<|im_end|>", "<|endoftext|>",
        ("<|im_end|>",), PRETOKENIZE_REGEX,
    ),
    "qwen3": TemplateFamily(
        "qwen3", QWEN3, _QWEN_SPECIAL, (*_HERMES_TAGS, "<think>", "</think>"), "<|im_end|>",
        "<|endoftext|>", ("<|im_end|>",), PRETOKENIZE_REGEX, reasoning_key="reasoning_content",
    ),
    "llama3_json": TemplateFamily(
        "llama3_json",
        LLAMA3_JSON,
        (
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
        ),
        (),
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
        ("<|eot_id|>",),
        LLAMA3_PRETOKENIZE_REGEX,
        bos_token="<|begin_of_text|>",
    ),
    "harmony": TemplateFamily(
        "harmony",
        HARMONY,
        (
            "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
            "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
        ),
        (),
        "<|return|>",
        "<|endoftext|>",
        ("<|return|>", "<|call|>"),
        O200K_PRETOKENIZE_REGEX,
        reasoning_key="thinking",
        max_calls_per_turn=1,
    ),
}
STOP_TOKENS: dict[str, tuple[str, ...]] = {name: fam.stop_tokens for name, fam in FAMILIES.items()}
_VOCAB_SIZE = 1024


def family(name: str) -> TemplateFamily:
    """The family called ``name`` (one of :data:`FAMILIES`)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(
            f"unknown template family {name!r}; choose one of {sorted(FAMILIES)}"
        ) from None


def _template_literals(template: str, specials: tuple[str, ...]) -> list[str]:
    """The quoted strings of a template, special tokens cut out: boilerplate the BPE should
    learn."""
    texts = []
    for raw in re.findall(r"'((?:[^'\\\n]|\\.)*)'|\"((?:[^\"\\\n]|\\.)*)\"", template):
        text = (raw[0] or raw[1]).replace("\\n", "\n").replace('\\"', '"')
        for token in specials:
            text = text.replace(token, "\n")
        texts.append(text)
    return texts


def _corpus(fam: TemplateFamily) -> list[str]:
    docs = synthetic_corpus(n_conversations=200, n_sentences=300, seed=7)
    docs += _template_literals(fam.chat_template, fam.special_tokens + fam.added_tokens) * 20
    calls = [json.dumps({"name": "calculator", key: {"expression": f"{a} * {a + 3}"}})
             for a in range(40) for key in ("arguments", "parameters")]
    return docs + calls


@functools.cache
def make_template_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer for family ``name``, with its special tokens and chat
    template.

    Trained (deterministically, well under a second) on the tiny model's synthetic corpus plus the
    template's own boilerplate; the pre-tokenizer uses the family's split regex (Qwen2, Llama 3,
    o200k). Cached per family: callers share one instance and must not modify it.
    """
    # heavy (tokenizers, transformers): only when a test tokenizer is built
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    fam = family(name)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(fam.pretokenize_regex), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE, special_tokens=list(fam.special_tokens),
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()), show_progress=False,
    )
    tok.train_from_iterator(_corpus(fam), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=fam.eos_token, pad_token=fam.pad_token,
        bos_token=fam.bos_token, unk_token=None, chat_template=fam.chat_template,
        clean_up_tokenization_spaces=False,
    )
