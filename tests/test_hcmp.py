"""HCMP, the split verifier: the log-sum-exp merge, the split forward against the unsplit
torch runtime (greedy tokens identical, logits within float rounding), the work it records,
bad settings, and on CUDA the GPU side beside the CPU side."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import build_reference, save_reference

from hetspec.protocol.config_shape import ConfigShape
from hetspec.speculative.control.hcmp_work import forward_work
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.tree import path_to
from hetspec.workers.runtimes.torch_runtime import TorchRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_attention import merge, partial_attention
from hetspec.workers.runtimes.torch_runtime.hcmp_runtime import HcmpRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_sides import HcmpSettings, HcmpSettingsError, Side

TARGET = Path(__file__).resolve().parents[1] / "models" / "target"
# one thread a side: on a busy 2-core box two spinning threads a forward cost 100x
TWO_CPU_HALVES = {"gpu": Side("cpu", threads=1), "cpu": Side("cpu", threads=1)}
# float32 rounding through 4 layers: the split linears' sums are cut differently by the BLAS
# (observed <= 1e-5 on logits of magnitude ~17)
LOGIT_TOLERANCE = 2e-5
PROMPT = "def read_config(path):\n    with open(path) as handle:\n"
TREE = ([11, 12, 13, 14, 12, 15, 16, 17, 18], [-1, -1, 0, 0, 1, 2, 4, 6, 3])


def cpu_runtime(ratio: float, shift: int = 0, folder: Path = TARGET) -> HcmpRuntime:
    settings = HcmpSettings(ratio, shift=shift, **TWO_CPU_HALVES)
    return HcmpRuntime(folder, settings, dtype="float32", max_context=256)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Torch's thread count is the process's: set for this module, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def unsplit() -> TorchRuntime:
    return TorchRuntime(TARGET, device="cpu", dtype="float32", max_context=256, threads=1)


@pytest.fixture(scope="module")
def loaded() -> HcmpRuntime:
    """One split runtime for the module; each test sets its split (``at``)."""
    return cpu_runtime(0.5)


def at(runtime: HcmpRuntime, ratio: float, shift: int = 0) -> HcmpRuntime:
    runtime.set_split(HcmpSettings(ratio, shift=shift, **TWO_CPU_HALVES))
    return runtime


def prefilled(runtime: TorchRuntime) -> TorchRuntime:
    runtime.rollback(0)
    runtime.prefill(runtime.tokenize(PROMPT))
    return runtime


# ------------------------------------------------------------ the merge


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_two_partials_merge_into_the_softmax_over_all_keys(softcap) -> None:
    torch.manual_seed(0)
    q, keys, values = torch.randn(8, 5, 16), torch.randn(2, 30, 16), torch.randn(2, 30, 16)
    mask = torch.rand(5, 30) > 0.4
    mask[:, 0] = True
    mask[:, 20:] = False  # the second part: rows 0-2 see nothing there
    mask[3:, 25] = True
    whole = partial_attention(q, keys, values, mask, scale=0.25, softcap=softcap)
    for boundary in (0, 7, 20, 30):
        parts = [
            partial_attention(q, keys[:, s], values[:, s], mask[:, s], scale=0.25, softcap=softcap)
            for s in (slice(0, boundary), slice(boundary, 30))
        ]
        torch.testing.assert_close(merge(*parts), whole.out, atol=1e-6, rtol=1e-5)
    if softcap is None:  # and the whole is what SDPA computes
        sdpa = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=0.25, enable_gqa=True
        )[0]
        torch.testing.assert_close(whole.out, sdpa, atol=1e-6, rtol=1e-5)


def test_a_part_with_no_keys_has_no_weight() -> None:
    q = torch.randn(2, 3, 4)
    empty = partial_attention(q, torch.empty(1, 0, 4), torch.empty(1, 0, 4), None, scale=1.0)
    assert (empty.out == 0).all()
    assert torch.isneginf(empty.lse).all()
    other = partial_attention(q, torch.randn(1, 6, 4), torch.randn(1, 6, 4), None, scale=1.0)
    torch.testing.assert_close(merge(empty, other), other.out)


# ------------------------------------------------------------ the split forward


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_the_split_verifier_gives_the_unsplit_tokens_and_logits(
    unsplit, loaded, ratio, shape
) -> None:
    tokens, parents = TREE if shape == "tree" else ([11, 12, 13, 14, 15], [-1, 0, 1, 2, 3])
    expected = prefilled(unsplit).forward_tree(tokens, parents).logits.numpy()
    split = prefilled(at(loaded, ratio))
    assert split.splits == (0 < ratio < 1)
    logits = split.forward_tree(tokens, parents).logits.numpy()
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
    if split.splits:
        np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE, rtol=0)
    else:  # one side holds everything: the unsplit runtime itself
        np.testing.assert_array_equal(logits, expected)


@pytest.mark.parametrize("shift", [-4, 3, 1000])
def test_any_attention_boundary_gives_the_same_logits(unsplit, loaded, shift) -> None:
    expected = prefilled(unsplit).forward_tree(*TREE).logits.numpy()
    logits = prefilled(at(loaded, 0.5, shift)).forward_tree(*TREE).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE, rtol=0)


def test_greedy_decoding_and_tree_rounds_follow_the_unsplit_runtime(unsplit, loaded) -> None:
    split = prefilled(at(loaded, 0.3))
    prefilled(unsplit)
    greedy = SamplingParams()
    assert split.decode(12, greedy, DrawnSampler(0)) == unsplit.decode(12, greedy, DrawnSampler(0))
    for runtime in (split, unsplit):  # a tree verified, a side branch kept, more tokens
        runtime.forward_tree(*TREE)
        runtime.commit(path_to(7, np.array(TREE[1])))
    assert split.tokens == unsplit.tokens
    np.testing.assert_allclose(split.last_logits(), unsplit.last_logits(), atol=LOGIT_TOLERANCE)
    assert split.decode(6, greedy, DrawnSampler(0)) == unsplit.decode(6, greedy, DrawnSampler(0))


@pytest.mark.parametrize("name", ["gemma2", "mistral-window", "llama-linear-bias-tied", "qwen3"])
def test_other_families_split_too(tmp_path, name) -> None:
    """Soft caps, sandwich norms, sliding windows, biases, tied heads, q/k norms."""
    folder = save_reference(build_reference(name), tmp_path / name)
    unsplit = TorchRuntime(folder, device="cpu", dtype="float32", max_context=64, threads=1)
    split = cpu_runtime(0.4, folder=folder)
    prompt = list(range(1, 13))
    for runtime in (unsplit, split):
        runtime.prefill(prompt)
    tokens, parents = [5, 6, 7, 8, 9, 10], [-1, -1, 0, 1, 3, 4]
    expected = unsplit.forward_tree(tokens, parents).logits.numpy()
    logits = split.forward_tree(tokens, parents).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_the_forward_records_the_work_its_model_predicts(loaded, ratio) -> None:
    split = prefilled(at(loaded, ratio, shift=2))
    record: list = []
    split.record_work(record)
    split.forward_tree(*TREE)
    split.record_work(None)
    shape = ConfigShape.from_config(json.loads((TARGET / "config.json").read_text()))
    predicted = forward_work(
        shape, width=len(TREE[0]), committed=split.committed, ratio=ratio, shift=2
    )
    assert sorted(map(dataclasses.astuple, record)) == sorted(map(dataclasses.astuple, predicted))
    assert {w.side for w in record if w.kind == "linear"} == {"gpu", "cpu"}


# ------------------------------------------------------------ bad settings


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_a_ratio_outside_zero_to_one_is_one_clear_error(ratio) -> None:
    with pytest.raises(HcmpSettingsError, match=r"split ratio .* is outside \[0, 1\]") as error:
        cpu_runtime(ratio)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this box has CUDA: the share can run")
def test_a_gpu_share_without_cuda_is_one_clear_error() -> None:
    with pytest.raises(HcmpSettingsError, match=r"GPU share of 0\.5 .* no CUDA device$"):
        HcmpRuntime(TARGET, HcmpSettings(0.5), dtype="float32")
    # no GPU share: the CPU side alone, the unsplit CPU runtime
    alone = HcmpRuntime(TARGET, HcmpSettings(0.0), dtype="float32", max_context=64)
    assert alone.device.type == "cpu"
    assert not alone.splits


def test_the_cpu_side_must_be_the_cpu() -> None:
    with pytest.raises(HcmpSettingsError, match="cpu side must be the CPU"):
        HcmpRuntime(TARGET, HcmpSettings(0.5, gpu=Side("cpu"), cpu=Side("meta")))


# ------------------------------------------------------------ on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5])
def test_on_cuda_the_gpu_side_and_the_host_share_the_forward(ratio) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    unsplit = prefilled(TorchRuntime(TARGET, device="cuda", dtype="float32", max_context=256))
    split = HcmpRuntime(
        TARGET,
        HcmpSettings(ratio, gpu=Side("cuda"), cpu=Side("cpu")),
        dtype="float32",
        max_context=256,
    )
    prefilled(split)
    assert split.splits
    assert split.hcmp.crosses
    expected = unsplit.forward_tree(*TREE).logits.cpu().numpy()
    logits = split.forward_tree(*TREE).logits.cpu().numpy()
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    greedy = SamplingParams()
    assert split.decode(8, greedy, DrawnSampler(0)) == unsplit.decode(8, greedy, DrawnSampler(0))
