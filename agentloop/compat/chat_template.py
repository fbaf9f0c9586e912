"""transformers 4's ``apply_chat_template(tokenize=True) -> list[int]`` on transformers 5
tokenizers.

verl 0.6/0.7 loops (and many user loops) call
``tokenizer.apply_chat_template(messages, tokenize=True)`` and use the result as the prompt ids.
transformers 5 (which vLLM 0.32 needs) returns a ``BatchEncoding`` there unless
``return_dict=False`` is passed, so those loops would send a dict to the engine.  The worker hands
loops a tokenizer whose ``apply_chat_template`` defaults ``return_dict`` to False when tokenizing;
an explicit ``return_dict=True`` still gets the dict. Everything else about the tokenizer is
unchanged.
"""

from __future__ import annotations

from typing import Any

_COMPAT_CLASSES: dict[type, type] = {}


def _apply_chat_template(self: Any, conversation: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("tokenize", True) and "return_dict" not in kwargs:
        kwargs["return_dict"] = False
    return super(type(self), self).apply_chat_template(conversation, *args, **kwargs)


def with_list_chat_template(tokenizer: Any) -> Any:
    """Make ``tokenizer.apply_chat_template(..., tokenize=True)`` return ids (in place; returns
    it)."""
    try:
        # heavy (~1 s); loaded by the tokenizer's owner anyway
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return tokenizer
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or cls in _COMPAT_CLASSES.values():
        return tokenizer
    if cls not in _COMPAT_CLASSES:
        _COMPAT_CLASSES[cls] = type(
            cls.__name__, (cls,),
            {"apply_chat_template": _apply_chat_template, "__module__": cls.__module__},
        )
    tokenizer.__class__ = _COMPAT_CLASSES[cls]
    return tokenizer
