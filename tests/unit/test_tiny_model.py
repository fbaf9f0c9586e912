"""tiny_model: deterministic build, tokenizer as AutoTokenizer loads it, chat template, model
load, caching."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop.testing import tiny_model, train_tiny
from agentloop.testing.tiny_model import MARKER, ensure_tiny_model, tiny_model_path

TOOL_CALL_TEXT = (
    'Ann has 12 apples. <tool_call>\n{"name": "calculator", "arguments": {"expression": "12 '
    '* 7"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", train_steps=0)


@pytest.fixture(scope="module")
def tok(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


def file_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = ensure_tiny_model(tmp_path / "again", train_steps=0)
    first, second = file_hashes(model_dir), file_hashes(again)
    for name in (
        "tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors", MARKER,
    ):
        assert first[name] == second[name], name
    assert first == second
    assert sorted(first) == sorted(
        [
            MARKER, "chat_template.jinja", "config.json", "generation_config.json",
            "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        ]
    )


def test_ensure_is_idempotent_and_rebuilds_when_stale(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path / "m", train_steps=0)
    stamps = {
        name: (path / name).stat().st_mtime_ns
        for name in (MARKER, "model.safetensors", "tokenizer.json")
    }
    inode = path.stat().st_ino
    assert ensure_tiny_model(path, train_steps=0) == path
    assert {name: (path / name).stat().st_mtime_ns for name in stamps} == stamps
    assert path.stat().st_ino == inode
    marker = json.loads((path / MARKER).read_text())
    assert marker["builder_version"] == tiny_model.BUILDER_VERSION
    (path / MARKER).write_text(json.dumps({**marker, "builder_version": "old"}))
    ensure_tiny_model(path, train_steps=0)
    assert json.loads((path / MARKER).read_text()) == marker
    assert path.stat().st_ino != inode  # rebuilt and swapped in
    # no leftovers
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m-") and p.is_dir()]


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(tmp_path, train_steps=0)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE_DIR", str(tmp_path))
    assert tiny_model_path() == tmp_path / "tiny-qwen2"
    assert tiny_model_path("other") == tmp_path / "other"
    monkeypatch.delenv("AGENTLOOP_CACHE_DIR")
    assert tiny_model_path() == tiny_model.DEFAULT_CACHE_DIR / "tiny-qwen2"


def test_auto_tokenizer_matches_saved_tokenizer(model_dir: Path, tok) -> None:  # type: ignore[no-untyped-def]
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [
        TOOL_CALL_TEXT, "The answer is 1234567890.", "<tool_response>\n-84\n</tool_response>",
        "It's 3.5 km!",
    ]
    texts += tiny_model.synthetic_corpus(n_conversations=20, n_sentences=20, seed=7)
    for text in texts:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids) == text
    assert len(tok) == 2048
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_digits_and_tool_tags(tok) -> None:  # type: ignore[no-untyped-def]
    assert tok.convert_ids_to_tokens(tok.encode("2026")) == ["2", "0", "2", "6"]
    for tag in tiny_model.TOOL_TOKENS:
        assert len(tok.encode(tag)) == 1
    ids = tok.encode("<|im_start|>assistant\n" + TOOL_CALL_TEXT + "<|im_end|>")
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n" + TOOL_CALL_TEXT
    assert tok.decode(ids[-1:]) == "<|im_end|>"


def test_chat_template_skips_messages_without_a_role_like_qwen25(tok) -> None:  # type: ignore[no-untyped-def]
    """verl 0.6's tool_agent measures the template's preamble with ``apply_chat_template([{}])`` and
    cuts that many tokens off every tool turn it renders; Qwen2.5 renders nothing for a role-less
    message, and so do we."""
    assert tok.apply_chat_template([{}], tokenize=False) == ""
    tool_turn = tok.apply_chat_template(
        [{"role": "tool", "content": "5"}], tokenize=False, add_generation_prompt=True
    )
    assert tool_turn.startswith("<|im_start|>user\n<tool_response>\n5")


def test_chat_template_conversation(tok) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "You are a careful math assistant."},
        {"role": "user", "content": "What is 12 * 7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}},
                }
            ],
        },
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": "The answer is 84."},
    ]
    expected = (
        "<|im_start|>system\nYou are a careful math assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "12 * 7"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 84.<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        expected + "<|im_start|>assistant\n"
    )


def test_chat_template_tools_grouped_responses(tok) -> None:  # type: ignore[no-untyped-def]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Add both."},
        {"role": "assistant", "content": "Two calls.", "tool_calls": [
            {"function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'}},
            {"name": "calculator", "arguments": {"expression": "3 + 4"}}]},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "7"},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "calculator", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nAdd both.<|im_end|>\n"
        "<|im_start|>assistant\nTwo calls.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + '
        '4"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    rendered = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected


def test_model_loads_and_runs(model_dir: Path, tok) -> None:  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert model.dtype == torch.float32
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 4)
    assert config.num_key_value_heads == 2 and config.tie_word_embeddings
    assert config.vocab_size >= len(tok) and config.vocab_size % 64 == 0
    assert (
        config.eos_token_id
        == tok.convert_tokens_to_ids("<|im_end|>")
        == model.generation_config.eos_token_id
    )
    assert config.pad_token_id == tok.pad_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tok.encode(TOOL_CALL_TEXT)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("which", ["built", "auto"])
def test_fast_examples_match_make_example(tok, which: str) -> None:  # type: ignore[no-untyped-def]
    tokenizer = tiny_model.build_tokenizer() if which == "built" else tok
    maker = train_tiny.ExampleMaker(tokenizer)
    for system_prompt in tiny_model.SYSTEM_PROMPTS:
        fast_rng, ref_rng = random.Random(5), random.Random(5)
        fast = maker.examples(fast_rng, 40, system_prompt)
        ref = [
            train_tiny.make_example(tokenizer, ref_rng, system_prompt=system_prompt)
            for _ in range(40)
        ]
        assert fast == ref
        # the same draws, so training data are unchanged
        assert fast_rng.random() == ref_rng.random()


def test_prefix_cached_loss_matches_full_forward(model_dir: Path, tok) -> None:  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prefix, suffix, mask = train_tiny.prefix_batch(
        train_tiny.ExampleMaker(tok), random.Random(3), 4
    )
    assert prefix.shape[0] > 150 and not mask[:, 0].any()
    loss = train_tiny.batch_loss(model, prefix, suffix, mask)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ids = torch.cat([prefix.expand(4, -1), suffix], dim=1)
    labels = torch.cat(
        [torch.full((4, prefix.shape[0]), -100), torch.where(mask, suffix, -100)], dim=1
    )
    reference = model(input_ids=ids, labels=labels).loss
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for grad, param in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, param.grad, rtol=1e-4, atol=1e-6)


def test_train_and_evaluate_run(model_dir: Path, tok) -> None:  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    info = train_tiny.train_tool_use(model, tok, steps=2, batch_size=4)
    assert info["steps"] == 2 and info["final_loss"] == info["final_loss"]  # not NaN
    rates = train_tiny.evaluate_tool_use(model, tok, n=1)
    assert set(rates) == {
        "well_formed_call", "exact_expression", "right_answer_given_result", "end_to_end",
    }
    assert all(0.0 <= v <= 1.0 for v in rates.values())


def test_the_shipped_trained_model_is_installed_without_training(tmp_path: Path) -> None:
    from agentloop.testing.tiny_model import (
        MARKER,
        SNAPSHOT_STEP,
        TRAIN_STEPS,
        content_hash,
        ensure_tiny_model,
        shipped_model,
    )

    for snapshot in (None, SNAPSHOT_STEP):
        shipped = shipped_model(TRAIN_STEPS, snapshot)
        assert shipped is not None, (
            "agentloop/assets lacks an intact trained model (make_tiny_model.py --force)"
        )
        target = tmp_path / shipped.name
        path = ensure_tiny_model(target, train_steps=TRAIN_STEPS, snapshot_step=snapshot)
        assert path == target and content_hash(path) == content_hash(shipped)
        marker = json.loads((path / MARKER).read_text())
        # trained, not random
        assert marker["train_steps"] == TRAIN_STEPS and marker["eval"]["end_to_end"] > 0.3
    # other settings are built, not taken from the package
    assert shipped_model(TRAIN_STEPS + 1) is None
