"""Split attention (split_attention.py) as one Triton kernel: a program per row and KV head.

The torch arithmetic of split_attention.py is a score matrix over the whole span bucket and
twenty-odd small kernels a layer. Here each program walks its row's keys itself: the blocks
before the row's split point in place (only those: the span bucket does not matter), then
its gathered tail, with the running maximum, sum and weighted values of an online softmax,
all in float32. What a program computes depends on its row's position, its query and the
keys it reads, never on the other rows or on how many there are, so a row's bits are the
same on its own, in a chain or in a tree by construction, as the torch version's are.

Triton compiles for the GPU; with ``TRITON_INTERPRET=1`` it runs on the CPU (slowly), which
is how the tests check it where there is no GPU.
"""

from __future__ import annotations

import functools

import torch

from hetspec.workers.runtimes.torch_runtime.split_attention import tail_length

NO_SCORE = -1.0e38  # the running maximum before any key: finite, below every real score
TILE_ELEMENTS = 8192  # a step's products (heads of a group x keys x head size): registers


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (imported where the kernel runs, never on the CPU path)
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def split_attention(  # noqa: PLR0917
        q,
        keys,
        values,
        tail,
        positions,
        out,
        q_row,
        q_head,
        kv_head,
        kv_slot,
        tail_row,
        out_row,
        scale,
        softcap,
        window,
        no_score,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        D: tl.constexpr,
        D_P: tl.constexpr,
        BLOCK: tl.constexpr,
        TAIL: tl.constexpr,
        STEP: tl.constexpr,
        SOFTCAP: tl.constexpr,
        WINDOWED: tl.constexpr,
    ):
        """out[row, heads of KV head h] = attention of those heads' queries over the row's
        keys before its split point (in place) and its tail (``tail``'s slots)."""
        row, head = tl.program_id(0), tl.program_id(1)
        p = tl.load(positions + row).to(tl.int32)  # one integer type for the loop's bounds
        start = tl.maximum(p // BLOCK * BLOCK - 2 * BLOCK, 0)
        g = tl.arange(0, GROUP_P)
        dims = tl.arange(0, D_P)
        heads = head * GROUP + g
        q_mask = (g < GROUP)[:, None] & (dims < D)[None, :]
        query = (
            tl.load(
                q + row * q_row + heads[:, None] * q_head + dims[None, :], mask=q_mask, other=0.0
            ).to(tl.float32)
            * scale
        )
        top = tl.full((GROUP_P,), no_score, tl.float32)
        total = tl.full((GROUP_P,), 0.0, tl.float32)
        acc = tl.full((GROUP_P, D_P), 0.0, tl.float32)
        k_base = keys + head * kv_head
        v_base = values + head * kv_head
        first = 0
        if WINDOWED:  # blocks wholly before the window: skipped
            first = tl.maximum(p - window + 1, 0) // BLOCK * BLOCK
        offsets = tl.arange(0, STEP)
        d_mask = (dims < D)[None, :]
        # STEP keys a step from the first, in place before the split point and gathered from
        # it on: for a given position always the same steps over the same keys
        for begin in range(first, start + TAIL, STEP):
            at = begin + offsets  # each key's position
            valid = (at <= p) & (at < start + TAIL)
            if WINDOWED:
                valid &= at > p - window
            gathered = tl.load(
                tail + row * tail_row + at - start, mask=valid & (at >= start), other=0
            )
            slots = tl.where(at >= start, gathered, at)
            where = slots[:, None] * kv_slot + dims[None, :]
            k = tl.load(k_base + where, mask=valid[:, None] & d_mask, other=0.0).to(tl.float32)
            v = tl.load(v_base + where, mask=valid[:, None] & d_mask, other=0.0).to(tl.float32)
            scores = tl.sum(query[:, None, :] * k[None, :, :], axis=2)
            if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1
                scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            keep = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top[:, None])
            total = total * keep + tl.sum(weights, axis=1)
            acc = acc * keep[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
            top = new_top
        result = acc / total[:, None]
        tl.store(
            out + row * out_row + heads[:, None] * D + dims[None, :],
            result.to(out.dtype.element_ty),
            mask=q_mask,
        )

    return split_attention


def split_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tail_slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    block: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """split_attention.split_attention's result for rows at ``positions`` (n,), computed by
    the kernel: q (heads, n, d), the cache ``keys``/``values`` (kv_heads, slots, d) with
    unit stride along d, ``tail_slots`` (n, tail). Returns (n, heads, d) in q's dtype."""
    heads, n, d = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    if keys.stride(2) != 1 or values.stride() != keys.stride() or q.stride(2) != 1:
        raise ValueError("the kernel reads q, keys and values with unit stride along d")
    if tail_slots.shape != (n, tail_length(block)):
        raise ValueError(
            f"tail_slots must be ({n}, {tail_length(block)}), not {tuple(tail_slots.shape)}"
        )
    import triton  # noqa: PLC0415 (where the kernel runs, Triton is installed)

    tail = tail_slots.contiguous()
    out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    group_p, d_p = triton.next_power_of_2(group), triton.next_power_of_2(d)
    step = max(16, min(64, TILE_ELEMENTS // (group_p * d_p)))  # powers of two, all
    kernel = _kernel()
    kernel[(n, kv_heads)](
        q,
        keys,
        values,
        tail,
        positions,
        out,
        q.stride(1),
        q.stride(0),
        keys.stride(0),
        keys.stride(1),
        tail.stride(0),
        out.stride(0),
        scale,
        softcap or 1.0,
        window or 0,
        NO_SCORE,
        GROUP=group,
        GROUP_P=group_p,
        D=d,
        D_P=d_p,
        BLOCK=block,
        TAIL=tail_length(block),
        STEP=step,
        SOFTCAP=softcap is not None,
        WINDOWED=window is not None,
    )
    return out


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tail_slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    block: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``split_attention``, as one opaque op where torch.compile traces it (inductor cannot see
    into a Triton launch made from Python; it fuses the kernels around it instead)."""
    if torch.compiler.is_compiling():
        return torch.ops.hetspec.split_attention(
            q, keys, values, tail_slots, positions, block, scale, softcap, window
        )
    return split_attention(
        q,
        keys,
        values,
        tail_slots,
        positions,
        block=block,
        scale=scale,
        softcap=softcap,
        window=window,
    )


@torch.library.custom_op("hetspec::split_attention", mutates_args=())
def _split_attention_op(  # noqa: PLR0917
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tail_slots: torch.Tensor,
    positions: torch.Tensor,
    block: int,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    return split_attention(
        q,
        keys,
        values,
        tail_slots,
        positions,
        block=block,
        scale=scale,
        softcap=softcap,
        window=window,
    )


@_split_attention_op.register_fake
def _(q, keys, values, tail_slots, positions, block, scale, softcap, window):  # noqa: PLR0917
    heads, n, d = q.shape
    return q.new_empty((n, heads, d))
