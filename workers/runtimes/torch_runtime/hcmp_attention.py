"""Attention over a part of the keys, and the exact merge of two parts (online softmax).

HCMP (hcmp_forward.py) splits each head's attention at a key boundary: the dense part (the
queries against the committed KV cache) on one side, the sparse part (against the draft
tree's keys, under the tree mask) on the other. Each side returns its part's output
normalised by its own softmax sum and that sum's log (``Partial``); ``merge`` rescales both
by ``exp(lse_part - lse_whole)``, which is softmax over all the keys, exactly up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Partial:
    """One part's attention: ``out`` (heads, n, d) float32, normalised within the part;
    ``lse`` (heads, n, 1) float32, the log of the part's softmax sum (-inf: no key seen)."""

    out: torch.Tensor
    lse: torch.Tensor

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Partial:
        return Partial(
            self.out.to(device, non_blocking=non_blocking),
            self.lse.to(device, non_blocking=non_blocking),
        )


def partial_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None = None,
) -> Partial:
    """Attention of q (heads, n, d) over ``keys``/``values`` (kv_heads, k, d) where the boolean
    ``mask`` (n, k) allows (None: every key), in float32. Query head h reads key head
    h // (heads // kv_heads). A row that sees no key gets out 0 and lse -inf."""
    heads, n, d = q.shape
    kv_heads, count = keys.shape[0], keys.shape[1]
    if count == 0:
        return Partial(
            torch.zeros(heads, n, d, device=q.device),
            torch.full((heads, n, 1), float("-inf"), device=q.device),
        )
    group = heads // kv_heads
    query = (q.float() * scale).reshape(kv_heads, group * n, d)
    scores = torch.matmul(query, keys.float().transpose(1, 2)).view(kv_heads, group, n, count)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.view(kv_heads, group * n, count), values.float())
    out = out.view(kv_heads, group, n, d) / torch.where(total > 0, total, torch.ones_like(total))
    lse = top + torch.log(total)
    return Partial(out.reshape(heads, n, d), lse.reshape(heads, n, 1))


def merge(first: Partial, second: Partial) -> torch.Tensor:
    """Softmax attention over both parts' keys, (heads, n, d) float32, from their partials
    (on one device). A row must see a key in at least one part."""
    top = torch.maximum(first.lse, second.lse)
    a, b = torch.exp(first.lse - top), torch.exp(second.lse - top)
    return (a * first.out + b * second.out) / (a + b)
