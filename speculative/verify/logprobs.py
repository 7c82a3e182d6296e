"""Log-probabilities of generated tokens, as the API reports them: the target's own."""

from __future__ import annotations

import numpy as np

from hetspec.protocol.sampling import TokenLogprob


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """``token``'s log-probability under the softmax of one row of ``logits`` (the model's
    distribution, before temperature and truncation), with the ``top`` most likely tokens,
    most likely first (ties: the lower id first). Exponentials in float32, their sum in
    float64 (docs/api.md, "Log-probabilities", says what that costs and how close it is)."""
    row = np.asarray(logits, dtype=np.float32)
    shift = row.max()
    log_total = float(shift) + float(np.log(np.exp(row - shift).sum(dtype=np.float64)))
    alternatives = []
    if top > 0:
        top = min(top, row.size)
        ids = np.argpartition(row, row.size - top)[row.size - top :]
        ids = ids[np.lexsort((ids, -row[ids]))]
        alternatives = [(int(i), float(row[i]) - log_total) for i in ids]
    return TokenLogprob(token, float(row[token]) - log_total, alternatives)
