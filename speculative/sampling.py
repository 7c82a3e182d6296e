"""The distributions tokens are drawn from: temperature, top-k and top-p over a logit row.

Speculative sampling is lossless only if the drafter reports exactly the distribution it drew
each token from, and the verifier applies the same warping to the target's logits; both sides
use these functions for that reason (a native draft chain computes its rows in C and reports
those: see ``samplers.ChainDraws``).
"""

from __future__ import annotations

import numpy as np

from hetspec.protocol.sampling import SamplingError, SamplingParams

__all__ = ["SamplingError", "SamplingParams", "distribution", "draw", "draw_rows", "softmax",
           "top_tokens"]  # fmt: skip


def softmax(logits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Row-wise softmax in float32 (into ``out`` when given, which may be ``logits`` itself)."""
    out = np.subtract(logits, logits.max(axis=-1, keepdims=True), out=out, dtype=np.float32)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    return out


def distribution(
    logits: np.ndarray, params: SamplingParams, out: np.ndarray | None = None
) -> np.ndarray:
    """The probability rows tokens are drawn from, for logit rows of shape (..., vocab).

    Greedy decoding picks the argmax and has no sampling distribution; it gets the plain
    softmax (temperature 1), whose top probability is the drafter's confidence.
    """
    if params.greedy:
        return softmax(logits, out)
    out = np.divide(logits, params.temperature, out=out, dtype=np.float32)
    vocab = out.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(out, vocab - params.top_k, axis=-1)[..., vocab - params.top_k]
        out[out < kth[..., None]] = -np.inf
    softmax(out, out)
    if params.top_p < 1:
        order = np.argsort(-out, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(out, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = np.zeros_like(out, dtype=bool)
        np.put_along_axis(drop, order, before >= params.top_p, axis=-1)
        out[drop] = 0
        out /= out.sum(axis=-1, keepdims=True)
    return out


def top_tokens(row: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` highest entries of a row, best first, ties to the lower index: the order
    of a stable descending sort, without sorting the whole vocabulary (a 4k-token argsort
    cost 0.2 ms, as much as a forward of the demo target)."""
    if count == 1:
        return np.array([int(row.argmax())])
    kth = np.partition(row, row.size - count)[row.size - count]
    above = np.flatnonzero(row > kth)
    ties = np.flatnonzero(row == kth)[: count - len(above)]
    candidates = np.concatenate([above, ties])
    return candidates[np.lexsort((candidates, -row[candidates]))]


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn in proportion to ``weights`` (they need not sum to 1)."""
    cumulative = np.cumsum(weights, dtype=np.float64)
    pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(pick, len(weights) - 1)  # round-off must not land past the last index


def draw_rows(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of ``probs`` (..., vocab), in row order."""
    flat = probs.reshape(-1, probs.shape[-1])
    return np.array([draw(row, rng) for row in flat]).reshape(probs.shape[:-1])
