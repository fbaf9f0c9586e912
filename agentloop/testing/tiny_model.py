"""Build the tiny local model used by the demo and the integration tests (no model hub needed).

:func:`ensure_tiny_model` returns the directory of a Qwen2.5-style checkpoint (a byte-level BPE
tokenizer with ChatML + hermes tool tokens, :data:`CHAT_TEMPLATE`, a 2-layer ``Qwen2ForCausalLM``
trained to call the calculator), copying the shipped one or building it deterministically under
``$AGENTLOOP_CACHE_DIR`` (file lock, atomic rename, rebuilt when :data:`BUILDER_VERSION` or the
files' hash changes); ``snapshot_step`` gives a weaker checkpoint of the same run.  Spec (tokenizer,
template, weights, cache): docs/testing.md#the-tiny-model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentloop.testing.tiny_corpus import (
    CALCULATOR_TOOL,
    CHAT_TEMPLATE,
    DEFAULT_SYSTEM_PROMPT,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SYSTEM_PROMPTS,
    TOOLS_FOOTER,
    TOOLS_HEADER,
    calculate,
    synthetic_corpus,
    word_problem,
    word_problem_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# the chat format and synthetic data are agentloop.testing.tiny_corpus's, re-exported here
__all__ = [
    "BUILDER_VERSION", "CACHE_ENV", "CALCULATOR_TOOL", "CHAT_TEMPLATE", "DEFAULT_CACHE_DIR",
    "DEFAULT_NAME", "DEFAULT_SYSTEM_PROMPT", "IM_END", "IM_START", "MARKER", "MODEL_SHAPE",
    "PAD_TOKEN", "PRETOKENIZE_REGEX", "SHIPPED_DIR", "SNAPSHOT_STEP", "SPECIAL_TOKENS",
    "TOOLS_FOOTER", "TOOLS_HEADER", "TOOL_TOKENS", "TRAIN_STEPS", "VOCAB_SIZE", "build_into",
    "build_tokenizer", "cache_dir", "calculate", "content_hash", "default_train_steps",
    "ensure_tiny_model", "init_model", "save_model", "shipped_model", "snapshot_name",
    "synthetic_corpus", "tiny_model_path", "word_problem", "word_problem_rows",
]
_SYSTEM_PROMPTS = SYSTEM_PROMPTS  # its former name here (tests and scripts import it)

BUILDER_VERSION = "5"  # 5: the template skips role-less messages (as Qwen2.5 does); same weights
TRAIN_STEPS = 1100  # ~4.5 min on 2 idle cores; see agentloop.testing.train_tiny
# a weaker checkpoint of the same run (right about half the time): room for RL to improve
SNAPSHOT_STEP = 400
MARKER = "agentloop_tiny_model.json"
CACHE_ENV = "AGENTLOOP_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/agentloop/models").expanduser()
DEFAULT_NAME = "tiny-qwen2"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2's pre-tokenizer split; ``\p{N}`` alone puts every digit in its own pre-token.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}


def cache_dir() -> Path:
    """The model cache: ``$AGENTLOOP_CACHE_DIR`` if set, else :data:`DEFAULT_CACHE_DIR`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR


def tiny_model_path(name: str = DEFAULT_NAME) -> Path:
    """Where :func:`ensure_tiny_model` puts the model called ``name`` by default."""
    return cache_dir() / name


def snapshot_name(snapshot_step: int) -> str:
    """The cache directory name of the snapshot after ``snapshot_step`` training steps
    (``tiny-qwen2-step400``)."""
    return f"{DEFAULT_NAME}-step{snapshot_step}"


def build_tokenizer(out_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """Train the BPE tokenizer, wrap it with the chat template, and save it into ``out_dir`` if
    given."""
    # heavy (tokenizers, transformers): only when building; a shipped model is copied without them
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

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()), show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer)
    # Added but not special: kept by skip_special_tokens decoding, as in Qwen2.5.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=None,
        chat_template=CHAT_TEMPLATE, model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        _save_tokenizer(fast, out_dir)
    return fast


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
    # Name the class AutoTokenizer builds for a qwen2 config anyway (transformers 4.x needs it
    # spelled out).
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def init_model(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised fp32 ``Qwen2ForCausalLM`` sized to ``tokenizer``."""
    # heavy (torch, transformers): only when building
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
    """Save weights (safetensors), ``config.json`` and a ``generation_config.json`` ending at
    ``<|im_end|>``."""
    # heavy (transformers): only when building
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    config = model.config
    bar_was_on = hf_logging.is_progress_bar_enabled()
    # one tiny shard: the "Writing model shards" bar is only noise
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out_dir))
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
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
    (:mod:`agentloop.testing.train_tiny`) before it is saved; the rates it reaches are in the
    marker. With ``snapshot_step`` the ``train_steps`` schedule stops after that many steps
    (recorded in the marker).
    """
    _check_snapshot(train_steps, snapshot_step)
    tokenizer = build_tokenizer(out_dir)
    model = init_model(tokenizer)
    marker_extra: dict[str, Any] = {"train_steps": train_steps}
    if snapshot_step is not None:
        marker_extra["snapshot_step"] = snapshot_step
    if train_steps > 0:
        # imported only to train: it loads torch and the tokenization stack
        from agentloop.testing.train_tiny import evaluate_tool_use, train_tool_use

        marker_extra["training"] = train_tool_use(
            model, tokenizer, steps=train_steps, stop_after=snapshot_step
        )
        marker_extra["eval"] = evaluate_tool_use(model, tokenizer)
    save_model(model, out_dir)
    for file in out_dir.iterdir():
        file.chmod(0o644)
    marker = {
        "builder_version": BUILDER_VERSION, "content_sha256": content_hash(out_dir),
        "vocab": len(tokenizer), **marker_extra,
    }
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _check_snapshot(train_steps: int, snapshot_step: int | None) -> None:
    if snapshot_step is not None and not 0 < snapshot_step <= train_steps:
        raise ValueError(
            f"snapshot_step must be in 1..train_steps={train_steps}, got "
            f"{snapshot_step} "
            "(a snapshot is an intermediate checkpoint of a training run)"
        )


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive ``flock`` next to ``target``, so parallel callers build once, one after
    another."""
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


def build_in_place(
    target: Path, fill: Callable[[Path], None], is_current: Callable[[Path], bool], *,
    force: bool = False, label: str = "build",
) -> Path:
    """Make ``target`` a current model directory: unless ``is_current(target)`` (and not
    ``force``), ``fill`` writes a fresh one into a temporary directory beside it, swapped in by
    atomic renames under a file lock (parallel callers build once).

    Returns:
        ``target``.

    Raises:
        FileExistsError: ``target`` is a non-empty directory that holds no tiny model (no
            :data:`MARKER`); it is not replaced.
    """
    if not force and is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        # another caller built it while we waited
        if not force and is_current(target):
            return target
        if target.is_dir() and not (target / MARKER).is_file() and any(target.iterdir()):
            raise FileExistsError(
                f"{target} is not empty and holds no tiny model ({MARKER}); not replacing it"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-{label}-", dir=target.parent))
        try:
            fill(tmp)
            tmp.chmod(0o755)
            _swap_in(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets"
"""The trained models shipped in the package (``agentloop/assets/tiny-qwen2`` and its step-400
snapshot), built by this module (``scripts/make_tiny_model.py --force`` rebuilds and compares the
content hash)."""


def shipped_model(train_steps: int, snapshot_step: int | None = None) -> Path | None:
    """The shipped copy of the model these settings build, when the package has it and it is intact
    (its marker matches the builder version, steps and snapshot, and its files match the recorded
    hash)."""
    name = DEFAULT_NAME if snapshot_step is None else snapshot_name(snapshot_step)
    path = SHIPPED_DIR / name
    return path if path.is_dir() and _is_current(path, train_steps, snapshot_step) else None


def ensure_tiny_model(
    path: str | Path | None = None, *, force: bool = False, train_steps: int | None = None,
    snapshot_step: int | None = None,
) -> Path:
    """Build the tiny model at ``path`` (default :func:`tiny_model_path`) unless it is there and
    current.

    Idempotent: an up-to-date directory is returned untouched.  When the package ships the trained
    model these settings give (:func:`shipped_model`), it is copied there in well under a second
    instead of being trained (~4-6 min on 2 cores).  ``force`` rebuilds (trains) anyway.
    ``train_steps`` defaults to :func:`default_train_steps`; 0 gives the untrained (random) model.
    ``snapshot_step`` (e.g. :data:`SNAPSHOT_STEP`) gives the weaker checkpoint of the same run after
    that many of its ``train_steps`` steps, by default at
    ``tiny_model_path(snapshot_name(snapshot_step))``.
    """
    steps = default_train_steps() if train_steps is None else int(train_steps)
    snapshot = None if snapshot_step is None else int(snapshot_step)
    _check_snapshot(steps, snapshot)
    default = tiny_model_path() if snapshot is None else tiny_model_path(snapshot_name(snapshot))
    target = Path(path).expanduser().absolute() if path is not None else default
    # the trained copy in the package: copied, never retrained
    shipped = None if force else shipped_model(steps, snapshot)

    def fill(out_dir: Path) -> None:
        if shipped is not None:
            shutil.copytree(shipped, out_dir, dirs_exist_ok=True)
        else:
            build_into(out_dir, steps, snapshot)

    return build_in_place(
        target, fill, lambda p: _is_current(p, steps, snapshot), force=force,
        label="build" if shipped is None else "copy",
    )
