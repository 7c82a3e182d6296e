"""Split attention (workers/runtimes/torch_runtime/split_attention.py): the arithmetic against plain
softmax attention, the tails a tree's rows gather, and the runtime's way out for rows too
deep for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import build_reference, save_reference, write_tiny_gguf_llama

from hetspec.workers.runtimes.torch_runtime import ModelLoadError, TorchRuntime, static_forward
from hetspec.workers.runtimes.torch_runtime.split_attention import (
    path_tails,
    split_attention,
    split_bias,
    split_mask,
    split_point,
)


def test_split_points_and_masks() -> None:
    positions = np.array([0, 7, 8, 15, 16, 40])
    assert split_point(positions, 4).tolist() == [0, 0, 0, 4, 8, 32]
    mask = split_mask(torch.tensor([15, 2]), 16, 4, None)  # 16 slots, then a 12-key tail
    assert mask[0].tolist() == [True] * 4 + [False] * 12 + [True] * 12  # 0..3, then 4..15
    assert mask[1].tolist() == [False] * 16 + [True] * 3 + [False] * 9  # positions 0..2
    mask = split_mask(torch.tensor([15]), 16, 4, 6)  # keys 10..15 only
    assert mask[0].tolist() == [False] * 16 + [False] * 6 + [True] * 6


@pytest.mark.parametrize(("heads", "softcap", "window"), [(4, None, None), (8, 30.0, 5)])
def test_the_two_parts_merge_into_one_softmax(heads, softcap, window) -> None:
    """Every row's output is softmax attention over the keys of its path: here the cache in
    position order (tail slots = positions), against SDPA (or soft-capped scores) over it."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, d, span, block = 2, 8, 32, 4
    keys = torch.randn(kv_heads, 40, d, generator=generator)
    values = torch.randn(kv_heads, 40, d, generator=generator)
    positions = torch.tensor([3, 9, 17, 30])
    q = torch.randn(heads, len(positions), d, generator=generator)
    start = split_point(positions, block)
    tails = (start[:, None] + torch.arange(3 * block)).clamp(max=39)
    bias = split_bias(positions, span, block, window)
    assert torch.equal(bias == 0, split_mask(positions, span, block, window))
    ours = split_attention(q, keys, values, tails, bias, scale=d**-0.5, softcap=softcap)
    seen = torch.arange(span)[None] <= positions[:, None]
    if window is not None:
        seen &= torch.arange(span)[None] > positions[:, None] - window
    group = heads // kv_heads
    k = keys[:, :span].repeat_interleave(group, 0)
    v = values[:, :span].repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) * d**-0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    expected = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v
    if softcap is None:
        assert torch.allclose(
            expected, F.scaled_dot_product_attention(q, k, v, attn_mask=seen), atol=1e-6
        )
    assert torch.allclose(ours, expected, atol=2e-6)


def test_tails_follow_each_rows_path() -> None:
    committed, block = 20, 4
    # a chain of 3 in the cache's order, then a sibling of its second node and its child
    parents = np.array([-1, 0, 1, 0, 3])
    depths = np.array([0, 1, 2, 1, 2])
    tails = path_tails(committed, parents, depths, np.arange(5), block)
    assert tails[2].tolist() == [*range(12, 23), 0]  # positions 12..22 in their own slots
    assert tails[4].tolist() == [*range(12, 21), 23, 24, 0]  # its path: slots 20, 23, 24
    # a chain below a second child of the first node, where its path leaves the cache's
    # order (1 deep): a row at most 2 blocks deeper is always served; 14 + 10 is past it
    committed = 14
    for depth, served in ((9, True), (10, False)):
        parents = np.array([-1, 0, 0, *range(2, depth + 1)])
        depths = np.array([0, 1, 1, *range(2, depth + 1)])
        tails = path_tails(committed, parents, depths, np.array([len(parents) - 1]), block)
        assert (tails is not None) == served, depth
        assert served == (split_point(committed + depth, block) <= committed + 1)


def test_rows_too_deep_for_it_take_the_gathered_forwards(tmp_path, monkeypatch) -> None:
    """A chain hanging below a second sibling, deeper than split attention serves, is
    evaluated (counted) through the gathered forwards: logits of the same path alone."""
    monkeypatch.setattr(static_forward, "MIN_SPAN", 16)
    monkeypatch.setattr(static_forward, "TAIL_BLOCK", 2)  # 4 deep at most
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    split = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4, attention="split")
    gathered = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4)
    prompt = [1, 17, 42, 5, 88, 23, 9, 61, 2, 70, 33, 14]
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    parents = [-1, -1, 1, 2, 3, 4, 5, 6]  # the second root child's chain, 7 deep
    outputs = []
    for runtime in (split, gathered):
        runtime.prefill(prompt)
        outputs.append(runtime.forward_tree(tokens, parents).logits)
    assert split.deep_rows == len(tokens)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-4)
    split.discard_pending()
    split.forward_tree(tokens[:5], [-1, -1, 1, 2, 3])  # 4 deep: served
    assert split.deep_rows == len(tokens)


def test_the_worker_loads_it_from_its_settings_and_says_so(tmp_path) -> None:
    from hetspec.protocol import worker_messages as m  # noqa: PLC0415
    from hetspec.workers.process import load_runtime  # noqa: PLC0415

    folder = str(write_tiny_gguf_llama(tmp_path / "m", seed=0, layers=1).parent)  # tokenizer too
    settings = m.TorchSettings(device="cpu", dtype="float32", fixed_width=4, attention="split")
    runtime, device = load_runtime("torch", folder, settings)
    assert runtime.attention == "split"
    assert device == "cpu (split attention, torch)"  # the Triton kernel: a GPU's
    eager = m.TorchSettings(device="cpu", attention="split")  # no fixed width: nothing to split
    assert load_runtime("torch", folder, eager)[0].attention == "gathered"
    with pytest.raises(ModelLoadError, match='attention must be "gathered" or "split"'):
        TorchRuntime(folder, device="cpu", attention="flash")


def in_the_interpreter(check: str) -> None:
    """Run tests/split_kernel_checks.py's ``check`` with Triton's interpreter on from its
    start: triton.language's own jitted helpers (tl.sum, tl.max) interpret only if it was
    on when Triton was imported, which this process may have done already."""
    pytest.importorskip("triton", reason="Triton is not installed (the test extra has it)")
    script = Path(__file__).with_name("split_kernel_checks.py")
    done = subprocess.run(
        [sys.executable, str(script), check],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{check}: passed" in done.stdout


@pytest.mark.process
def test_the_kernel_computes_it_alike_and_each_row_alone() -> None:
    """The Triton kernel and the torch arithmetic against float64 (GQA groups of 2, 3, 4
    and 8 heads, head sizes that are no power of two, soft caps, windows shorter than a
    row's keys, 16 and 64 keys a step), and every row's bits the same in a call of one
    row."""
    in_the_interpreter("kernel")


@pytest.mark.process
def test_a_verifier_through_the_kernel_gives_the_same_bits_alone_and_in_trees() -> None:
    """A fixed-width runtime picks the kernel where Triton runs (here its interpreter): its
    logits track the gathered verifier's, and a token's are bit-identical alone, in a chain
    beside wrong siblings and in a tree of six branches (Gemma 2: windows, soft caps)."""
    in_the_interpreter("runtime")


@pytest.mark.process
@pytest.mark.slow
def test_compiled_the_kernel_stays_one_op_a_layer_and_keeps_the_bits() -> None:
    """torch.compile around the kernel (a custom op inductor fuses around): the same checks
    as above, and the compiled forward still calls the kernel once a layer."""
    in_the_interpreter("compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_kernel_tracks_the_torch_arithmetic_row_by_row(dtype) -> None:
    """heavy-1b's attention shape (128 heads of 32 over 64 KV heads) at 500 keys: the kernel
    against the torch arithmetic, and each row's bits the same in a call of one row."""
    from hetspec.workers.runtimes.torch_runtime import split_kernel  # noqa: PLC0415

    generator = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(64, 600, 32, device="cuda", generator=generator).to(dtype)
    values = torch.randn(64, 600, 32, device="cuda", generator=generator).to(dtype)
    positions = torch.arange(484, 500, device="cuda")
    q = torch.randn(128, 16, 32, device="cuda", generator=generator).to(dtype)
    tails = split_point(positions, 16)[:, None] + torch.arange(48, device="cuda")
    bias = split_bias(positions, 512, 16, None)
    expected = split_attention(q, keys, values, tails, bias, scale=32**-0.5)
    ours = split_kernel.split_attention(q, keys, values, tails, positions, block=16, scale=32**-0.5)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: an output's last bit
    assert torch.allclose(
        ours.transpose(0, 1).float(), expected.float(), atol=tolerance, rtol=tolerance
    )
    for row in (0, 7, 15):
        one = slice(row, row + 1)
        alone = split_kernel.split_attention(
            q[:, one], keys, values, tails[one], positions[one], block=16, scale=32**-0.5
        )
        assert torch.equal(alone[0], ours[row])


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_a_kernel_that_fails_or_strays_is_refused_for_the_torch_arithmetic(
    tmp_path, monkeypatch, broken
) -> None:
    """Where Triton would run, the kernel is checked at load against the torch arithmetic:
    one that fails (as a GPU that cannot build it would) or computes something else (here
    a stand-in for a miscompiled kernel) is refused, and the worker's device line says so."""
    from hetspec.protocol import worker_messages as m  # noqa: PLC0415
    from hetspec.workers.process import load_runtime  # noqa: PLC0415
    from hetspec.workers.runtimes.torch_runtime import skinny_matmul, split_kernel  # noqa: PLC0415

    def kernel(q, *args, **kwargs):
        if broken == "raises":
            raise RuntimeError("no kernel image is available for this device\nmore")
        return torch.zeros(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype)

    monkeypatch.setattr(skinny_matmul, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(split_kernel, "split_attention", kernel)
    folder = str(write_tiny_gguf_llama(tmp_path / "m", seed=0, layers=1).parent)
    settings = m.TorchSettings(device="cpu", dtype="float32", fixed_width=4, attention="split")
    runtime, device = load_runtime("torch", folder, settings)
    assert not runtime.split_kernel
    reason = {
        "raises": "RuntimeError: no kernel image is available for this device",
        "wrong": "its logits differ from the torch arithmetic's",
    }[broken]
    assert runtime.split_kernel_refused.startswith(reason)
    assert device.startswith(f"cpu (split attention, torch; its kernel refused: {reason}")
    runtime.prefill([1, 5, 9])  # and it serves, in the torch arithmetic
    plain = TorchRuntime(folder, device="cpu", dtype="float32")
    plain.prefill([1, 5, 9])
    assert np.allclose(runtime.last_logits(), plain.last_logits(), atol=1e-4)
