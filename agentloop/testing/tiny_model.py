"""Build the tiny local model used by the demo and the integration tests (no model hub needed).

:func:`ensure_tiny_model` returns the directory of a Qwen2.5-style checkpoint (a byte-level BPE tokenizer
with ChatML + hermes tool tokens, :data:`CHAT_TEMPLATE`, a 2-layer ``Qwen2ForCausalLM`` trained to call the
calculator), copying the shipped one or building it deterministically under ``$AGENTLOOP_CACHE_DIR`` (file lock, atomic
rename, rebuilt when :data:`BUILDER_VERSION` or the files' hash changes); ``snapshot_step`` gives a weaker
checkpoint of the same run.  Spec (tokenizer, template, weights, cache): docs/testing.md#the-tiny-model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentloop.tools.calculator import CALCULATOR_TOOL_DICT

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BUILDER_VERSION = "5"  # 5: the template skips role-less messages (as Qwen2.5 does); same weights
TRAIN_STEPS = 1100  # ~4.5 min on 2 idle cores; see agentloop.testing.train_tiny
SNAPSHOT_STEP = 400  # a weaker checkpoint of the same run (right about half the time): room for RL to improve
MARKER = "agentloop_tiny_model.json"
CACHE_ENV = "AGENTLOOP_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/agentloop/models").expanduser()
DEFAULT_NAME = "tiny-qwen2"
VOCAB_SIZE = 2048
PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2's pre-tokenizer split; ``\p{N}`` alone puts every digit in its own pre-token.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
CALCULATOR_TOOL: dict[str, Any] = CALCULATOR_TOOL_DICT  # the schema the model is trained to call
TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)

# ChatML + hermes tools, as Qwen2.5 renders them (without Qwen's default system prompt when no tools).
CHAT_TEMPLATE = (
    r"""{%- if tools %}
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
        {%- if not loop.first %}{{- '<|im_start|>system\n' ~ message.content ~ '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' ~ message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' ~ (message.content or '') ~ '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role is defined and message.role %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ (message.content or '') ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
)

_NAMES = (
    "Ann", "Bob", "Cleo", "Dev", "Eve", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Milo", "Nora", "Omar",
    "Pia", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera"
)
_THINGS = (
    "apples", "books", "coins", "marbles", "stamps", "cookies", "pencils", "shells", "stickers", "cards", "eggs",
    "oranges", "bottles", "candles", "flowers", "tickets", "boxes", "chairs", "plates", "cups", "shirts", "socks",
    "bricks", "stones", "buttons", "beads", "balloons", "kites", "toys", "seeds"
)
_PLACES = (
    "school", "the park", "the market", "the library", "the farm", "the shop", "the beach", "the garden",
    "the museum", "home"
)
_WORDS = (
    "the", "a", "an", "and", "or", "but", "if", "then", "when", "while", "because", "so", "that", "this", "there",
    "here", "what", "which", "who", "how", "why", "is", "are", "was", "were", "be", "been", "has", "have", "had",
    "do", "does", "did", "can", "could", "will", "would", "should", "not", "no", "yes", "all", "each", "every",
    "some", "many", "more", "most", "few", "less", "one", "two", "three", "four", "five", "six", "seven", "eight",
    "nine", "ten", "hundred", "thousand", "number", "total", "sum", "difference", "product", "result", "answer",
    "question", "problem", "step", "first", "next", "last", "before", "after", "again", "also", "only", "just",
    "very", "always", "never", "today", "day", "week", "year", "time", "people", "friend", "family", "teacher",
    "student", "water", "food", "money", "price", "cost", "buy", "bought", "sell", "sold", "give", "gave", "take",
    "took", "get", "got", "make", "made", "find", "found", "keep", "left", "right", "big", "small", "new", "old",
    "good", "same", "different", "add", "subtract", "multiply", "plus", "minus", "times", "equals", "count",
    "calculate", "compute", "check", "tool", "function", "call", "use", "help", "helpful", "assistant", "user",
    "system", "reply", "please", "thanks", "you", "your", "my", "our", "their", "his", "her", "we", "they", "he",
    "she", "it", "them", "think", "know", "want", "need", "like", "see", "look", "read", "write", "said", "say",
    "tell", "ask", "show", "try", "work"
)
_PROBLEMS = (
    ("+", "{who} has {a} {thing} and finds {b} more. How many {thing} does {who} have now?"),
    ("+", "There are {a} {thing} in one box and {b} {thing} in another. How many {thing} are there in all?"),
    ("+", "{who} bought {a} {thing} at {place} and then {b} more. How many {thing} did {who} buy?"),
    ("+", "What is {a} plus {b}?"),
    ("-", "{who} had {a} {thing} and gave {b} of them to {other}. How many {thing} are left?"),
    ("-", "A shop had {a} {thing} and sold {b}. How many {thing} does the shop have now?"),
    ("-", "{who} collected {a} {thing} at {place} but lost {b} on the way home. How many are left?"),
    ("-", "What is {a} minus {b}?"),
    ("*", "{who} has {a} bags with {b} {thing} in each bag. How many {thing} does {who} have?"),
    ("*", "Each of {a} students brings {b} {thing} to {place}. How many {thing} are there in total?"),
    ("*", "A crate holds {b} {thing}. How many {thing} are in {a} crates?"),
    ("*", "What is {a} times {b}?"),
    ("+", "Calculate {a} + {b}."),
    ("-", "Calculate {a} - {b}."),
    ("*", "Calculate {a} * {b}."),
)
_ONSETS = (
    "b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g", "gr", "h", "j", "k", "l", "m", "n", "p",
    "pl", "pr", "r", "s", "sh", "sl", "sp", "st", "t", "th", "tr", "v", "w", "y", "z"
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou")
_CODAS = ("", "", "", "n", "nd", "ng", "r", "s", "st", "t", "ck", "ll", "m", "sh", "th", "ve")
_SYSTEM_PROMPTS = (
    DEFAULT_SYSTEM_PROMPT,
    "You are a careful math assistant. Use the calculator tool for arithmetic, then give the answer.",
    "You solve word problems step by step. Always check the result with a tool call.",
)


def cache_dir() -> Path:
    """The model cache: ``$AGENTLOOP_CACHE_DIR`` if set, else :data:`DEFAULT_CACHE_DIR`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR


def tiny_model_path(name: str = DEFAULT_NAME) -> Path:
    """Where :func:`ensure_tiny_model` puts the model called ``name`` by default."""
    return cache_dir() / name


def snapshot_name(snapshot_step: int) -> str:
    """The cache directory name of the snapshot after ``snapshot_step`` training steps (``tiny-qwen2-step400``)."""
    return f"{DEFAULT_NAME}-step{snapshot_step}"


def calculate(a: int, op: str, b: int) -> int:
    """``a op b`` for the three operators of the synthetic corpus."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """A random word problem: ``(question, expression, answer)``; numbers 0-999."""
    op, text = rng.choice(_PROBLEMS)
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    if op == "-" and b > a:
        a, b = b, a
    who, other = rng.sample(_NAMES, 2)
    fields = {"who": who, "other": other, "thing": rng.choice(_THINGS), "place": rng.choice(_PLACES)}
    return text.format(a=a, b=b, **fields), f"{a} {op} {b}", calculate(a, op, b)


def word_problem_rows(n: int, *, agent_name: str, data_source: str, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` word problems as dataset rows in verl's format (system + user prompt, ``agent_name``,
    ``reward_model.ground_truth``, ``extra_info.{index, expression}``), for examples and benchmarks."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, expression, answer = word_problem(rng)
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "system", "content": _SYSTEM_PROMPTS[1]}, {"role": "user", "content": question}],
            "agent_name": agent_name,
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": i, "expression": expression},
        })
    return rows


def _tool_system_text(system: str) -> str:
    return system + TOOLS_HEADER + "\n" + json.dumps(CALCULATOR_TOOL, ensure_ascii=False) + TOOLS_FOOTER


def _conversation(rng: random.Random) -> str:
    """One tool-use conversation as plain text (the ChatML special tokens are left out)."""
    question, expression, answer = word_problem(rng)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    turns = [f"system\n{_tool_system_text(rng.choice(_SYSTEM_PROMPTS))}", f"user\n{question}"]
    turns += [f"assistant\n<tool_call>\n{call}\n</tool_call>", f"user\n<tool_response>\n{answer}\n</tool_response>"]
    return "\n".join([*turns, f"assistant\nThe answer is {answer}."])


def _lexicon(rng: random.Random, size: int = 1500) -> list[str]:
    """English-sounding made-up words (1-3 syllables), so the BPE vocabulary fills up with plausible pieces."""
    words: set[str] = set()
    while len(words) < size:
        syllables = [rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.choice((1, 1, 2, 2, 3)))]
        words.add("".join(syllables) + rng.choice(_CODAS))
    return sorted(words)


def _chatter(rng: random.Random, lexicon: list[str]) -> str:
    """A sentence of English-ish filler: common words with some made-up ones (Zipf-like frequencies)."""
    vocab = _WORDS + _THINGS + _NAMES
    words = [rng.choice(vocab) if rng.random() < 0.7 else _zipf_choice(rng, lexicon) for _ in range(rng.randint(6, 16))]
    sentence = " ".join(words)
    return sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ","])


def _zipf_choice(rng: random.Random, items: list[str]) -> str:
    return items[min(int(len(items) ** rng.random()) - 1, len(items) - 1)]


def synthetic_corpus(n_conversations: int = 2000, n_sentences: int = 6000, seed: int = 0) -> list[str]:
    """The deterministic tokenizer training corpus."""
    rng = random.Random(seed)
    docs = [_conversation(rng) for _ in range(n_conversations)]
    lexicon = _lexicon(rng)
    rng.shuffle(lexicon)
    docs += [_chatter(rng, lexicon) for _ in range(n_sentences)]
    docs += [" ".join(sorted(set(_WORDS + _THINGS + _NAMES + _PLACES)))]
    return docs


def build_tokenizer(out_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """Train the BPE tokenizer, wrap it with the chat template, and save it into ``out_dir`` if given."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer)
    # Added but not special: kept by skip_special_tokens decoding, as in Qwen2.5.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=None, chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"], clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        _save_tokenizer(fast, out_dir)
    return fast


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
    # Name the class AutoTokenizer builds for a qwen2 config anyway (transformers 4.x needs it spelled out).
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def init_model(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised fp32 ``Qwen2ForCausalLM`` sized to ``tokenizer``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = tokenizer.get_vocab()
    pad, eos = vocab[PAD_TOKEN], vocab[IM_END]
    config = Qwen2Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        bos_token_id=pad,  # as in Qwen2.5: no BOS is prepended, the id is <|endoftext|>
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.eval()
    return model


def save_model(model: PreTrainedModel, out_dir: Path) -> None:
    """Save weights (safetensors), ``config.json`` and a ``generation_config.json`` ending at ``<|im_end|>``."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    config = model.config
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: the "Writing model shards" bar is only noise
    try:
        model.save_pretrained(str(out_dir))
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    generation.save_pretrained(str(out_dir))


def content_hash(path: Path) -> str:
    """sha256 over the names and bytes of the model files (everything except the marker)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.name != MARKER):
        digest.update(file.name.encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _is_current(path: Path, train_steps: int, snapshot_step: int | None = None) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
        return (
            marker.get("builder_version") == BUILDER_VERSION
            and marker.get("train_steps", 0) == train_steps
            and marker.get("snapshot_step") == snapshot_step
            and marker.get("content_sha256") == content_hash(path)
        )
    except (OSError, ValueError):
        return False


def default_train_steps() -> int:
    """:data:`TRAIN_STEPS`, or ``$AGENTLOOP_TINY_TRAIN_STEPS`` (0 keeps the random weights)."""
    return int(os.environ.get("AGENTLOOP_TINY_TRAIN_STEPS", TRAIN_STEPS))


def build_into(out_dir: Path, train_steps: int = 0, snapshot_step: int | None = None) -> None:
    """Build the whole model directory into ``out_dir`` (which must exist), marker included.

    With ``train_steps > 0`` the model is trained on synthetic calculator conversations
    (:mod:`agentloop.testing.train_tiny`) before it is saved; the rates it reaches are in the marker.
    With ``snapshot_step`` the ``train_steps`` schedule stops after that many steps (recorded in the marker).
    """
    _check_snapshot(train_steps, snapshot_step)
    tokenizer = build_tokenizer(out_dir)
    model = init_model(tokenizer)
    marker_extra: dict[str, Any] = {"train_steps": train_steps}
    if snapshot_step is not None:
        marker_extra["snapshot_step"] = snapshot_step
    if train_steps > 0:
        from agentloop.testing.train_tiny import evaluate_tool_use, train_tool_use

        marker_extra["training"] = train_tool_use(model, tokenizer, steps=train_steps, stop_after=snapshot_step)
        marker_extra["eval"] = evaluate_tool_use(model, tokenizer)
    save_model(model, out_dir)
    for file in out_dir.iterdir():
        file.chmod(0o644)
    marker = {"builder_version": BUILDER_VERSION, "content_sha256": content_hash(out_dir), "vocab": len(tokenizer),
              **marker_extra}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _check_snapshot(train_steps: int, snapshot_step: int | None) -> None:
    if snapshot_step is not None and not 0 < snapshot_step <= train_steps:
        raise ValueError(f"snapshot_step must be in 1..train_steps={train_steps}, got {snapshot_step} "
                         "(a snapshot is an intermediate checkpoint of a training run)")


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive ``flock`` next to ``target``, so parallel callers build once, one after another."""
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _swap_in(new: Path, target: Path) -> None:
    """Replace ``target`` by the finished directory ``new``; each step is an atomic rename."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets"
"""The trained models shipped in the package (``agentloop/assets/tiny-qwen2`` and its step-400 snapshot), built
by this module (``scripts/make_tiny_model.py --force`` rebuilds and compares the content hash)."""


def shipped_model(train_steps: int, snapshot_step: int | None = None) -> Path | None:
    """The shipped copy of the model these settings build, when the package has it and it is intact
    (its marker matches the builder version, steps and snapshot, and its files match the recorded hash)."""
    name = DEFAULT_NAME if snapshot_step is None else snapshot_name(snapshot_step)
    path = SHIPPED_DIR / name
    return path if path.is_dir() and _is_current(path, train_steps, snapshot_step) else None


def ensure_tiny_model(
    path: str | Path | None = None, *, force: bool = False, train_steps: int | None = None,
    snapshot_step: int | None = None,
) -> Path:
    """Build the tiny model at ``path`` (default :func:`tiny_model_path`) unless it is there and current.

    Idempotent: an up-to-date directory is returned untouched.  When the package ships the trained model these
    settings give (:func:`shipped_model`), it is copied there in well under a second instead of being trained
    (~4-6 min on 2 cores).  ``force`` rebuilds (trains) anyway.
    ``train_steps`` defaults to :func:`default_train_steps`; 0 gives the untrained (random) model.
    ``snapshot_step`` (e.g. :data:`SNAPSHOT_STEP`) gives the weaker checkpoint of the same run after that many
    of its ``train_steps`` steps, by default at ``tiny_model_path(snapshot_name(snapshot_step))``.
    """
    steps = default_train_steps() if train_steps is None else int(train_steps)
    snapshot = None if snapshot_step is None else int(snapshot_step)
    _check_snapshot(steps, snapshot)
    default = tiny_model_path() if snapshot is None else tiny_model_path(snapshot_name(snapshot))
    target = Path(path).expanduser().absolute() if path is not None else default
    if not force and _is_current(target, steps, snapshot):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if not force and _is_current(target, steps, snapshot):  # another caller built it while we waited
            return target
        shipped = shipped_model(steps, snapshot)
        if not force and shipped is not None:  # the trained copy in the package: copied, never retrained
            if target.is_dir() and not (target / MARKER).is_file() and any(target.iterdir()):
                raise FileExistsError(f"{target} is not empty and holds no tiny model ({MARKER}); not replacing it")
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-copy-", dir=target.parent))
            try:
                shutil.copytree(shipped, tmp, dirs_exist_ok=True)
                tmp.chmod(0o755)
                _swap_in(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return target
        if target.is_dir() and not (target / MARKER).is_file() and any(target.iterdir()):
            raise FileExistsError(f"{target} is not empty and holds no tiny model ({MARKER}); not replacing it")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
        try:
            build_into(tmp, steps, snapshot)
            tmp.chmod(0o755)
            _swap_in(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
