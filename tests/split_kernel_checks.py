"""Split attention's Triton kernel in Triton's interpreter, run by tests/test_split_attention.py
in a process of its own with TRITON_INTERPRET=1 set before anything imports Triton.

    TRITON_INTERPRET=1 python tests/split_kernel_checks.py kernel|runtime|compiled
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tiny_models import build_reference, save_reference

from hetspec.workers.runtimes.torch_runtime import TorchRuntime, split_kernel, static_forward
from hetspec.workers.runtimes.torch_runtime.split_attention import (
    split_attention,
    split_bias,
    split_point,
)


def exact(q, keys, values, positions, *, scale, softcap, window) -> torch.Tensor:
    """Softmax attention of each row over positions 0..p (within ``window``) of the cache,
    in float64: (heads, n, d)."""
    group = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)
    v = values.double().repeat_interleave(group, 0)
    scores = q.double() @ k.transpose(1, 2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    at = torch.arange(keys.shape[1])[None]
    seen = at <= positions[:, None]
    if window is not None:
        seen &= at > positions[:, None] - window
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def kernel() -> None:
    cases = (
        (4, 2, 8, None, None),
        (6, 2, 12, 30.0, 7),
        (8, 2, 16, None, 20),
        (8, 1, 200, None, None),  # 16 keys a step (a group of 8 x 256 wide)
        (4, 4, 8, None, 9),  # no groups: a KV head per head
    )
    for heads, kv_heads, d, softcap, window in cases:
        generator = torch.Generator().manual_seed(1)
        block, span = 4, 64
        keys = torch.randn(kv_heads, 80, d, generator=generator)
        values = torch.randn(kv_heads, 80, d, generator=generator)
        positions = torch.tensor([0, 3, 9, 17, 30, 47, 60])
        q = torch.randn(heads, len(positions), d, generator=generator)
        tails = (split_point(positions, block)[:, None] + torch.arange(3 * block)).clamp(max=79)
        bias = split_bias(positions, span, block, window)
        expected = split_attention(q, keys, values, tails, bias, scale=0.3, softcap=softcap)
        ours = split_kernel.split_attention(
            q,
            keys,
            values,
            tails,
            positions,
            block=block,
            scale=0.3,
            softcap=softcap,
            window=window,
        )
        assert ours.shape == (len(positions), heads, d)
        truth = exact(q, keys, values, positions, scale=0.3, softcap=softcap, window=window)
        # both against float64: torch's CPU tanh took another path in some processes (its
        # soft-capped outputs 4e-5 apart between them); the kernel's is within 3.4e-6
        assert torch.allclose(ours.transpose(0, 1).double(), truth, atol=1e-5), (heads, d)
        assert torch.allclose(expected.double(), truth, atol=1e-4), (heads, d)
        for row in range(len(positions)):
            one = slice(row, row + 1)
            alone = split_kernel.split_attention(
                q[:, one],
                keys,
                values,
                tails[one],
                positions[one],
                block=block,
                scale=0.3,
                softcap=softcap,
                window=window,
            )
            assert torch.equal(alone[0], ours[row]), (heads, d, row)


def runtime(compile: bool = False) -> None:
    """``compile``: through torch.compile, the kernel one op a layer in the compiled forward."""
    static_forward.MIN_SPAN = 16
    static_forward.TAIL_BLOCK = 4
    folder = save_reference(build_reference("gemma2"), Path(tempfile.mkdtemp()) / "m")
    split = TorchRuntime(
        folder, device="cpu", dtype="float32", fixed_width=4, attention="split", compile=compile
    )
    gathered = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4)
    assert split.split_kernel, split.split_kernel_refused
    prompt = [1, 17, 42, 5, 88, 23, 9, 61, 2, 70, 33, 14, 8, 3]
    for each in (split, gathered):
        each.prefill(prompt)
    assert np.allclose(split.last_logits(), gathered.last_logits(), atol=1e-4)
    if compile:  # the compiled forward still calls the kernel, once a layer
        calls, kernel = [], split_kernel.split_attention
        split_kernel.split_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)
        split.forward_tree([3], [-1])
        split.discard_pending()
        split_kernel.split_attention = kernel
        assert len(calls) == split.config.num_layers, calls
    chain, alone = [], []
    for _ in range(6):
        chain.append(int(split.last_logits().argmax()))
        alone.append(split.forward_tree([chain[-1]], [-1]).logits[0].clone())
        split.commit([0])
    split.rollback(len(prompt))
    tokens = [t for token in chain for t in (token, (token + 1) % 96)]
    parents = [-1 if i < 2 else 2 * (i // 2 - 1) for i in range(len(tokens))]
    logits = split.forward_tree(tokens, parents).logits
    for i in range(len(chain)):
        assert torch.equal(logits[2 * i], alone[i]), i
    split.discard_pending()
    output = split.forward_tree([7, 8, 9, 10, 11, chain[0], chain[1]], [-1] * 6 + [5])
    assert torch.equal(output.logits[5], alone[0])
    assert torch.equal(output.logits[6], alone[1])
    assert split.deep_rows == 0


if __name__ == "__main__":
    checks = {"kernel": kernel, "runtime": runtime, "compiled": lambda: runtime(compile=True)}
    checks[sys.argv[1]]()
    print(f"{sys.argv[1]}: passed")
