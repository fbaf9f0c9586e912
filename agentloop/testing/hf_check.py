"""Compare a batch's engine log-probs with a Hugging Face recompute (tests of weight updates and engines).

Imported on demand: it needs torch and a loaded ``transformers`` model.
"""

from __future__ import annotations

from typing import Any


def max_logprob_gap(hf_model: Any, out: Any) -> float:
    """Largest |engine log-prob - HF log-prob| over the sampled tokens of every row of ``out`` (a DataProto
    from ``generate_sequences`` with ``calculate_log_probs``), HF logits taken in float32, no temperature.
    Single-turn rows: the sampled tokens are the last ``response_mask.sum()`` tokens of the sequence."""
    import torch

    b, worst = out.batch, 0.0
    for i in range(len(out)):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].unsqueeze(0)
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float()
        n_resp = int(b["response_mask"][i].sum())
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0][-n_resp:]
        worst = max(worst, float((b["rollout_log_probs"][i, :n_resp] - expected).abs().max()))
    return worst
