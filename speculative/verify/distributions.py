"""The distributions tokens are drawn from: temperature, top-k and top-p over a logit row.

Speculative sampling is lossless only if the drafter reports exactly the distribution it drew
each token from, and the verifier applies the same warping to the target's logits; both sides
use these functions for that reason (a native draft chain computes its rows in C and reports
those: see ``samplers.ChainDraws``).
"""

from __future__ import annotations

import numpy as np

from hetspec.protocol.sampling import SamplingError, SamplingParams

__all__ = [
    "SamplingError",
    "SamplingParams",
    "WarpedRows",
    "distribution",
    "draw",
    "draw_rows",
    "keep_nucleus",
    "keep_top_k",
    "kth_largest",
    "softmax",
    "top_tokens",
]


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
    if 0 < params.top_k < out.shape[-1]:
        for row in _rows(out):
            keep_top_k(row, params.top_k)
    else:
        softmax(out, out)
    if params.top_p < 1:
        for row in _rows(out):
            keep_nucleus(row, params.top_p)
    return out


def _rows(array: np.ndarray):
    """Each row (last axis) of an array of any leading shape, as a view (a reshape of a strided
    view, e.g. an arena slot's rows, could be a copy)."""
    return (array[index] for index in np.ndindex(array.shape[:-1]))


def keep_top_k(row: np.ndarray, k: int) -> None:
    """Softmax over a row's k largest entries (all entries equal to the k-th too), in place;
    the others become 0. Only those entries are exponentiated."""
    keep = np.flatnonzero(row >= kth_largest(row, k))
    kept = row[keep]
    np.exp(kept - kept.max(), out=kept)
    row.fill(0)
    row[keep] = kept / kept.sum()


# Distances below a row's largest entry (logits over the temperature) within which the k-th
# largest is looked for first: a partition of the few entries there replaces one of the whole
# row.
KTH_GAPS = (4.0, 16.0, 64.0)


def kth_largest(row: np.ndarray, k: int) -> np.ndarray:
    """The k-th largest entry of a row, ties counted (np.partition's value at size - k), found
    among the entries within a gap of the largest where k of them are (the k-th largest of
    every entry >= t is the row's when there are k of them); else in the whole row."""
    top = row.max()
    for gap in KTH_GAPS:
        near = row[row >= top - gap]
        if near.size >= k:
            return np.partition(near, near.size - k)[near.size - k]
    return np.partition(row, row.size - k)[row.size - k]


class WarpedRows:
    """``distribution(logits, params)`` row by row, each row computed when first read (the
    same values: rows are warped independently), so a verification walk pays only for the
    rows it reaches (docs/bench/sampling.md)."""

    def __init__(self, logits: np.ndarray, params: SamplingParams) -> None:
        self.logits, self.params = logits, params
        self.shape = logits.shape
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, row: int) -> np.ndarray:
        if row not in self._rows:
            self._rows[row] = distribution(self.logits[row], self.params)
        return self._rows[row]


# Thresholds tried in turn for the candidates of a nucleus: entries >= t, at most 1/t of them
# in a probability row, so a sort of the few candidates replaces one of the whole vocabulary
# (docs/bench/sampling.md).
NUCLEUS_THRESHOLDS = (1e-3, 1e-4, 1e-5, 0.0)


def keep_nucleus(
    row: np.ndarray, top_p: float, thresholds: tuple[float, ...] = NUCLEUS_THRESHOLDS
) -> None:
    """Top-p of one probability row, in place: the smallest prefix of the entries in stable
    descending order (ties: lower index first) whose mass reaches ``top_p`` stays, the rest
    become 0, and the row is renormalized. Entry j stays iff the float64 running sum of the
    entries before it in that order is below ``top_p``, so the top entry always stays.

    A prefix of entries >= t is the order's prefix too, and every entry after it has at least
    its mass before it: once that mass reaches ``top_p`` nothing beyond can stay, so only the
    candidates are sorted; the last threshold (0: all positive entries) decides alone.
    ``thresholds=(0.0,)`` sorts every positive entry (the same result, for comparison)."""
    for threshold in thresholds:
        candidates = np.flatnonzero(row > 0 if threshold == 0 else row >= threshold)
        values = row[candidates]
        if threshold > 0 and values.sum(dtype=np.float64) < top_p - 1e-9:
            continue  # short by more than any summation order's rounding: no sort
        # candidates ascend, so a stable sort of their negated values breaks ties by index
        order = candidates[np.argsort(-values, kind="stable")]
        mass = np.cumsum(row[order], dtype=np.float64)
        if threshold == 0 or mass[-1] >= top_p:
            break
    before = np.concatenate(([0.0], mass[:-1]))
    kept = order[before < top_p]
    kept_values = row[kept]
    row.fill(0)
    row[kept] = kept_values
    row /= row.sum()


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
