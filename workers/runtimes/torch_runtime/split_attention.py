"""Attention split at a point fixed by each row's position: the keys before it read in place
from the cache, the last few gathered into position order, both in one softmax.

A width-invariant verifier needs every token to see the same keys in the same places whether
it is evaluated on its own, in a chain or in a tree (static_forward.py). Gathering each row's whole
path into position order gives that but copies the span a path; reading the cache in place
does not, but a tree's siblings sit between a node's ancestors there. The keys that a tree can
have moved are only its last few positions, so each row splits at
``split_point(p) = block * floor(p / block) - 2 * block``: the keys before it are committed
(in their own slots) for any row at most ``2 * block`` deep below where its path leaves the
cache's order, and are read in place through a mask that depends on ``p`` only; the
``3 * block`` positions from it on are gathered per row from its own path. Both parts'
scores (float32) sit side by side in one softmax, and each part's weights multiply its own
values. The arithmetic a row runs depends on its position, its keys and the forward's fixed
shape only, so a tree costs a chain plus a small gathered tail, and the bits are the same
on its own, in a chain or in a tree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SplitRows:
    """What split attention needs of a forward's rows beside each layer's bias: their tails'
    cache slots (n, tail), their positions (n,), the block, and whether split_kernel.py's
    Triton kernel computes it (it needs no bias) or the torch arithmetic here does."""

    tail_slots: torch.Tensor
    positions: torch.Tensor
    block: int
    kernel: bool = False


def split_point(positions, block: int):
    """First key of each row's gathered tail (numpy or torch integers, elementwise)."""
    start = positions // block * block - 2 * block
    if isinstance(start, torch.Tensor):
        return start.clamp(min=0)
    return np.maximum(start, 0)


def tail_length(block: int) -> int:
    """Keys in a row's gathered tail: it ends at the row itself, at most 3 blocks on."""
    return 3 * block


def split_mask(positions: torch.Tensor, span: int, block: int, window: int | None) -> torch.Tensor:
    """Which keys rows at ``positions`` (n,) see, (n, span + tail): cache slots before their
    split point, then their tail's positions up to their own; ``window``: keys no more than
    window - 1 positions back (None: all)."""
    start = split_point(positions, block)[:, None]
    slots = torch.arange(span, device=positions.device)[None].expand(len(positions), -1)
    tail = start + torch.arange(tail_length(block), device=positions.device)[None]
    keys = torch.cat([slots, tail], dim=1)  # each key's position
    mine = positions[:, None]
    seen = torch.cat([slots < start, tail <= mine], dim=1)
    return seen if window is None else seen & (keys > mine - window)


def split_bias(positions: torch.Tensor, span: int, block: int, window: int | None) -> torch.Tensor:
    """``split_mask`` as split_attention takes it: float32, 0 where a key is seen, -inf
    where not (an addition: cheaper than masking the scores of every head)."""
    seen = split_mask(positions, span, block, window)
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))


def split_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tail_slots: torch.Tensor,
    bias: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q (heads, n, d) over the cache ``keys``/``values`` (kv_heads, slots, d):
    in place over its first ``span`` slots and over the slots ``tail_slots`` (n, tail) lists,
    where ``bias`` (n, span + tail, ``split_bias``) is 0 (every row sees at least one key).
    One float32 softmax over both parts' scores side by side. Returns (heads, n, d) in q's
    dtype."""
    kv_heads, (n, tail) = keys.shape[0], tail_slots.shape
    span = bias.shape[-1] - tail
    heads, d = q.shape[0], q.shape[-1]
    group = heads // kv_heads  # query heads per KV head, h -> h // group
    query = (q.float() * scale).contiguous().view(kv_heads, group, n, d)
    before = torch.matmul(
        query.view(kv_heads, group * n, d), keys[:, :span].float().transpose(1, 2)
    )
    flat = tail_slots.reshape(-1)
    tail_keys = keys.index_select(1, flat).view(kv_heads, n, tail, d).float()
    recent = torch.matmul(query.transpose(1, 2), tail_keys.transpose(2, 3)).transpose(1, 2)
    scores = torch.cat([before.view(kv_heads, group, n, span), recent], dim=-1)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = (scores + bias).softmax(-1)
    out = torch.matmul(
        weights[..., :span].reshape(kv_heads, group * n, span), values[:, :span].float()
    ).view(kv_heads, group, n, d)
    tail_values = values.index_select(1, flat).view(kv_heads, n, tail, d).float()
    out = out + torch.matmul(weights[..., span:].transpose(1, 2), tail_values).transpose(1, 2)
    return out.reshape(heads, n, d).to(q.dtype)


def path_tails(
    committed: int, parents: np.ndarray, depths: np.ndarray, rows: np.ndarray, block: int
) -> np.ndarray | None:
    """Each row's tail slots, (len(rows), tail), for nodes ``rows`` of a pending tree whose
    node i sits in cache slot committed + i at position committed + depths[i] below node
    parents[i] (-1: the committed end); slots past a row's own position are 0. None where a
    row's split point lies past where its path leaves the cache's order (its keys before it
    are not all in their own slots)."""
    # ordered[i]: how many of node i's path's nodes, from the top, sit in their depth's slot.
    # Nodes before the first whose parent is not the node before it form that chain.
    count = len(parents)
    breaks = np.flatnonzero(parents != np.arange(-1, count - 1))
    chain = int(breaks[0]) if len(breaks) else count
    ordered = np.arange(1, count + 1)
    for node in range(chain, count):  # below the chain: what their branch point's path kept
        parent = int(parents[node])
        ordered[node] = ordered[parent] if parent >= chain else parent + 1
    depth = depths[rows]
    start = split_point(committed + depth, block)
    kept = ordered[rows]
    if (start - committed > kept).any():
        return None
    tails = start[:, None] + np.arange(tail_length(block))  # each tail key's position
    tails[tails > (committed + depth)[:, None]] = 0  # past the row: slot 0, never seen
    for row in np.flatnonzero(kept <= depth).tolist():  # paths that left the cache's order
        walk, row_kept, first = int(rows[row]), int(kept[row]), int(start[row])
        while walk >= 0 and depths[walk] >= row_kept:
            tails[row, committed + depths[walk] - first] = committed + walk
            walk = int(parents[walk])
    return tails
