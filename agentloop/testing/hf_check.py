"""Compare a batch's engine log-probs with a Hugging Face recompute (tests of weight updates and
engines).

Imported on demand: it needs torch and a loaded ``transformers`` model.
"""

from __future__ import annotations

import copy
from typing import Any


def max_logprob_gap(hf_model: Any, out: Any) -> float:
    """Largest |engine log-prob - HF log-prob| over the sampled tokens of every row of ``out`` (a
    DataProto from ``generate_sequences`` with ``calculate_log_probs``), HF logits taken in float32,
    no temperature. Single-turn rows: the sampled tokens are the last ``response_mask.sum()`` tokens
    of the sequence."""
    import torch  # heavy; this module is imported by tests that already hold a transformers model

    b, worst = out.batch, 0.0
    for i in range(len(out)):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float()
        n_resp = int(b["response_mask"][i].sum())
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0][-n_resp:]
        worst = max(worst, float((b["rollout_log_probs"][i, :n_resp] - expected).abs().max()))
    return worst


def perturbed_weights(
    model: Any, scale: float = 0.05, seed: int = 123
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """New weights for a weight-update test: ``(original, new, updated_model)``.

    ``new`` is every matrix of ``model`` plus ``scale`` x N(0, 1) noise (vectors kept), without
    ``lm_head.weight`` (with tied embeddings the server takes it from the embeddings);
    ``updated_model`` is a copy of ``model`` holding ``new``, for the recompute; ``original``
    restores the server afterwards. ``model`` is unchanged.
    """
    import torch  # heavy, as above

    original = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    new = {k: v + scale * torch.randn_like(v) if v.dim() > 1 else v
           for k, v in original.items() if k != "lm_head.weight"}
    head = (
        new["model.embed_tokens.weight"]
        if model.config.tie_word_embeddings
        else original["lm_head.weight"]
    )
    updated = copy.deepcopy(model)
    updated.load_state_dict({**new, "lm_head.weight": head})
    return original, new, updated
