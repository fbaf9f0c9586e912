"""Build the tiny local model used by the demo and the integration tests (no hub access needed).

What it builds, deterministically (fixed seeds, sorted inputs), in a few seconds on 2 cores:

1. a byte-level BPE tokenizer (vocab 2048, digits split one per token) trained on a synthetic
   corpus of arithmetic word problems, hermes-style tool calls and answers; special tokens
   ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos); added, *non-special* tokens
   ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` (they survive
   ``skip_special_tokens`` decoding, as in Qwen2.5);
2. our own ChatML + hermes-tools chat template;
3. a ``Qwen2ForCausalLM`` (hidden 128, 2 layers, 4 heads / 2 KV heads, MLP 512, tied embeddings,
   fp32) with random weights from ``torch.manual_seed(0)``.

The model lives under ``$AGENTLOOP_CACHE_DIR`` (default ``~/.cache/agentloop/models``); a marker
file records the builder version so a changed builder rebuilds.  Builds are atomic (temp dir +
rename), so concurrent callers never see a half-written model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

BUILDER_VERSION = "1"
MARKER = "agentloop_tiny_model.json"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set f = tc['function'] if tc.get('function') else tc %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_dir() -> Path:
    """``$AGENTLOOP_CACHE_DIR`` or ``~/.cache/agentloop/models``."""
    return Path(os.environ.get("AGENTLOOP_CACHE_DIR", "~/.cache/agentloop/models")).expanduser()


def tiny_model_path(name: str = "tiny-qwen2") -> Path:
    """Where :func:`ensure_tiny_model` puts the model by default."""
    return cache_dir() / name


def _corpus(n: int = 3000) -> list[str]:
    rng = random.Random(0)
    names = ["Ann", "Bob", "Cleo", "Dev", "Eve", "Finn", "Gus", "Hana"]
    things = ["apples", "books", "coins", "marbles", "stamps", "cookies", "pencils", "shells"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        who, what = rng.choice(names), rng.choice(things)
        lines.append(f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?")
        call = {"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}}
        lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        lines.append(f"<tool_response>\n{eval_simple(a, op, b)}\n</tool_response>")
        lines.append(f"The answer is {eval_simple(a, op, b)}.")
    lines.append("You are a helpful assistant. Tell me about the sea, a cat, numbers, rain, the moon, music.")
    return lines


def eval_simple(a: int, op: str, b: int) -> int:
    """``a op b`` for the three operators of the synthetic corpus."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def build_tokenizer(out_dir: Path):  # type: ignore[no-untyped-def]
    """Train and save the tokenizer; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        model_max_length=4096,
    )
    fast.add_tokens(TOOL_TOKENS)  # added but not special: kept by skip_special_tokens decoding
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(out_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Random-init Qwen2 (seed 0) sized to the tokenizer; saved as fp32 safetensors."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=128, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=eos).save_pretrained(str(out_dir))


def _is_current(path: Path) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("builder_version") == BUILDER_VERSION
    except json.JSONDecodeError:
        return False


def ensure_tiny_model(path: str | Path | None = None, *, force: bool = False) -> Path:
    """Build the tiny model at ``path`` (default :func:`tiny_model_path`) unless it is already there."""
    target = Path(path).expanduser() if path is not None else tiny_model_path()
    if not force and _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = build_tokenizer(tmp)
        build_model(tmp, tokenizer)
        (tmp / MARKER).write_text(json.dumps({"builder_version": BUILDER_VERSION, "vocab": len(tokenizer)}))
        if target.exists():
            if _is_current(target) and not force:  # someone else finished first
                shutil.rmtree(tmp)
                return target
            shutil.rmtree(target)
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
