"""The torch runtime on CUDA: fixed shapes replayed as CUDA graphs, and bit-identical logits
whatever a token is verified with (skipped, with the reason, where CUDA is absent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_reference, save_reference

from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler
from hetspec.speculative.verify.tree import chain_parents
from hetspec.speculative.verify.verdicts import verify_sampled
from hetspec.workers.runtimes.torch_runtime import TorchRuntime, static_forward
from hetspec.workers.runtimes.tree_runtime import TreeRuntime

pytestmark = pytest.mark.gpu
PROMPT = [1, 17, 42, 5, 88, 23, 9, 61, 2, 70, 33, 14]
# the tiny models hold 256 positions: span buckets from 16 here (16, 32 .. 256), so that the
# 40 tokens after the prompt cross two of them
LONG_PROMPT = [(7 * i + 3) % 90 for i in range(20)]  # tiny vocabulary: 96


@pytest.fixture(autouse=True)
def small_spans(monkeypatch):
    monkeypatch.setattr(static_forward, "MIN_SPAN", 16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_reference(build_reference("qwen3"), tmp_path_factory.mktemp("qwen3"))


def greedy_alone(runtime: TorchRuntime, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Decode greedily one forward a token; the tokens and each forward's logits."""
    tokens, rows = [], []
    logits = torch.from_numpy(runtime.last_logits())
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        output = runtime.forward_tree([token], [-1])
        logits = output.logits[0].cpu()
        rows.append(logits)
        runtime.commit([0])
    return tokens, rows


def test_forwards_replay_graphs_and_match_eager_shapes(folder) -> None:
    graphs = TorchRuntime(folder, device="cuda", dtype="float32")
    eager = TorchRuntime(folder, device="cuda", dtype="float32", cuda_graphs=False)
    assert graphs.graphs == 7 * 5  # widths 1..64, spans 16, 32 .. 256
    assert eager.graphs == 0
    for runtime in (graphs, eager):
        runtime.prefill(PROMPT)
    tree = ([3, 4, 5, 6], [-1, 0, 0, 2])
    assert torch.equal(graphs.forward_tree(*tree).logits, eager.forward_tree(*tree).logits)
    assert (
        graphs.draft(8, SamplingParams(), DrawnSampler(0)).tokens.tolist()
        == eager.draft(8, SamplingParams(), DrawnSampler(0)).tokens.tolist()
    )


def test_buckets_track_float32_in_bfloat16(folder) -> None:
    exact = TorchRuntime(folder, device="cuda", dtype="float32")
    half = TorchRuntime(folder, device="cuda", dtype="bfloat16")
    for runtime in (exact, half):
        runtime.prefill(PROMPT)
    tokens = list(range(20, 40))
    expected = exact.forward_tree(tokens, chain_parents(len(tokens))).logits
    ours = half.forward_tree(tokens, chain_parents(len(tokens))).logits
    assert (ours - expected).abs().max().item() < 0.2


@pytest.mark.parametrize(
    ("dtype", "compile", "attention"),
    [
        ("bfloat16", False, "gathered"),
        ("float32", False, "gathered"),
        ("bfloat16", True, "gathered"),
        ("bfloat16", False, "split"),
        ("float32", False, "split"),
        ("bfloat16", True, "split"),
    ],
    ids=["bf16", "f32", "bf16-compiled", "bf16-split", "f32-split", "bf16-compiled-split"],
)
def test_a_verifier_gives_the_same_bits_alone_and_in_any_tree(
    folder, dtype, compile, attention
) -> None:
    check_the_same_bits(
        TorchRuntime(
            folder, device="cuda", dtype=dtype, verifies=True, compile=compile, attention=attention
        )
    )


@pytest.mark.parametrize("weights", ["dtype", "int8"])
def test_a_compiled_verifier_through_the_triton_matmul_gives_the_same_bits(folder, weights):
    """torch.compile around the Triton matmul (one op a layer), bf16 or int8 weights."""
    pytest.importorskip("triton", reason="Triton is not installed")
    check_the_same_bits(
        TorchRuntime(
            folder,
            device="cuda",
            dtype="bfloat16",
            verifies=True,
            compile=True,
            matmul="triton",
            weights=weights,
        )
    )


@pytest.mark.parametrize("attention", ["gathered", "split"])
@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_a_gemma_verifier_gives_the_same_bits_alone_and_in_any_tree(
    tmp_path, name, attention
) -> None:
    """Gemma's windowed layers (6 positions here: the chain runs far past them), its second
    rotary table and Gemma 2's soft-capped attention (unfused) in bf16 graphs."""
    folder = save_reference(build_reference(name), tmp_path / name)
    check_the_same_bits(
        TorchRuntime(folder, device="cuda", dtype="bfloat16", verifies=True, attention=attention)
    )


def check_the_same_bits(runtime: TorchRuntime) -> None:
    """Greedy tokens one forward each, then as chains of several widths with a wrong sibling
    beside every token, and in a tree of more paths than a forward gathers: every token's
    logits bit-identical to its own forward's. (Split attention serves rows at most 32 deep
    below where their path leaves the cache's order: its chains stop at 23.)"""
    assert runtime.fixed_width == 16
    runtime.prefill(LONG_PROMPT)
    chain, alone = greedy_alone(runtime, 40)
    split = runtime.attention == "split"
    for width in (1, 3, 9, 16, 23) if split else (1, 3, 9, 16, 23, 40):
        runtime.rollback(len(LONG_PROMPT))
        done = 0
        while done < len(chain):
            part = chain[done : done + width]
            # the chain's next tokens, each with a wrong sibling beside it
            tokens = [t for token in part for t in (token, (token + 1) % runtime.vocab_size)]
            parents = [-1 if i < 2 else 2 * (i // 2 - 1) for i in range(len(tokens))]
            logits = runtime.forward_tree(tokens, parents).logits.cpu()
            for i in range(len(part)):
                assert torch.equal(logits[2 * i], alone[done + i]), (width, done + i)
            runtime.commit([2 * i for i in range(len(part))])
            done += len(part)
    # six branches from the root (more paths than one forward gathers), the chain in the last
    runtime.rollback(len(LONG_PROMPT))
    tokens = [*(t + 7 for t in range(5)), chain[0], chain[1], chain[2]]
    output = runtime.forward_tree(tokens, [-1, -1, -1, -1, -1, -1, 5, 6])
    for i in range(3):
        assert torch.equal(output.logits[5 + i].cpu(), alone[i])
    assert runtime.deep_rows == 0


def test_a_compiled_verifier_tracks_the_eager_one(folder) -> None:
    eager = TorchRuntime(folder, device="cuda", dtype="float32", verifies=True)
    compiled = TorchRuntime(folder, device="cuda", dtype="float32", verifies=True, compile=True)
    for runtime in (eager, compiled):
        runtime.prefill(PROMPT)
    tree = ([3, 4, 5, 6], [-1, 0, 0, 2])
    expected = eager.forward_tree(*tree).logits
    assert (compiled.forward_tree(*tree).logits - expected).abs().max().item() < 1e-3


def test_graph_outputs_survive_later_forwards(folder) -> None:
    """A forward's logits are its own, not a view the next replay overwrites."""
    runtime = TorchRuntime(folder, device="cuda", verifies=True)
    runtime.prefill(PROMPT)
    first = runtime.forward_tree([3, 4], [-1, 0])
    kept = first.logits.clone()
    runtime.forward_tree([7], [1], extend=True)
    assert torch.equal(first.logits, kept)
    runtime.commit([0, 1])
    assert np.array_equal(runtime.last_logits(), kept[1].cpu().numpy())


def test_logits_go_straight_into_registered_host_memory(folder) -> None:
    runtime = TorchRuntime(folder, device="cuda", verifies=True)
    memory = np.zeros(1 << 20, np.uint8)
    assert runtime.pin_host_memory(memory)
    assert not runtime.pin_host_memory(memory)  # one region at a time
    out = memory[: 3 * runtime.vocab_size * 4].view(np.float32).reshape(3, -1)
    runtime.prefill(PROMPT)
    logits = runtime.evaluate_tree([3, 4, 5], [-1, 0, 0], out=out)
    assert logits is out
    assert torch.equal(
        torch.from_numpy(out), runtime.forward_tree([3, 4, 5], [-1, 0, 0]).logits.cpu()
    )
    runtime.close()


@pytest.mark.parametrize("seed", [None, 11])  # drawn, keyed
def test_a_sampled_walk_reads_the_same_rows_off_the_cuda_device(folder, seed) -> None:
    """A verifier's walk (``evaluate_rows``: a row leaves the GPU when the walk reaches it)
    reads the bits the whole tree's copy holds, and so takes the same verdict, in bf16 graphs
    of fixed width."""
    runtime = TorchRuntime(folder, device="cuda", dtype="bfloat16", verifies=True)
    runtime.prefill(PROMPT)
    tokens, parents = [3, 4, 5, 6, 7], [-1, 0, 1, 0, 3]
    whole = runtime.evaluate_tree(tokens, parents).copy()
    rows = runtime.evaluate_rows(tokens, parents)
    assert rows.shape == whole.shape
    assert all(np.array_equal(rows[row], whole[row]) for row in range(len(tokens)))
    params, draft = SamplingParams(temperature=0.8), np.full((4, whole.shape[1]), 1.0)
    draft /= draft.sum(-1, keepdims=True)
    options = {"keyed": KeyedSampler(seed)} if seed is not None else {"draft": draft}
    verdicts = [
        verify_sampled(
            tokens[1:],
            [-1, 0, -1, 2],
            rows_of,
            params,
            position=12,
            rng=np.random.default_rng(3),
            **options,
        )
        for rows_of in (whole, runtime.evaluate_rows(tokens, parents))
    ]
    assert verdicts[0] == verdicts[1]


@pytest.mark.parametrize("attention", ["gathered", "split"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_decoding_queues_its_forwards_with_the_same_bits(folder, dtype, attention) -> None:
    """A verifier decoding alone chooses each token on the GPU: the host loop's tokens and
    bits, across span buckets."""
    runtime = TorchRuntime(folder, device="cuda", dtype=dtype, verifies=True, attention=attention)
    results = []
    for decode in (TorchRuntime.decode, TreeRuntime.decode):
        runtime.rollback(0)
        runtime.prefill(LONG_PROMPT)
        logprobs: list = []
        tokens = decode(runtime, 40, SamplingParams(), DrawnSampler(0), logprobs=logprobs)
        results.append((tokens, logprobs, runtime.last_logits().copy()))
    (tokens, logprobs, after), (host_tokens, host_logprobs, host_after) = results
    assert tokens == host_tokens
    assert logprobs == host_logprobs
    assert np.array_equal(after, host_after)


@pytest.mark.parametrize("seed", [None, 11])  # drawn, keyed
def test_sampled_decoding_queues_its_forwards_with_the_host_loops_tokens(folder, seed) -> None:
    """Each choice on the GPU, guarded against the device's softmax rounding otherwise than
    numpy's: the host loop's tokens and the logits after, in bf16 graphs."""
    runtime = TorchRuntime(folder, device="cuda", dtype="bfloat16", verifies=True)
    results = []
    for decode in (TorchRuntime.decode, TreeRuntime.decode):
        runtime.rollback(0)
        runtime.prefill(LONG_PROMPT)
        sampler = DrawnSampler(5) if seed is None else KeyedSampler(seed)
        tokens = decode(runtime, 40, SamplingParams(temperature=0.8), sampler)
        results.append((tokens, runtime.last_logits().copy()))
    (tokens, after), (host_tokens, host_after) = results
    assert tokens == host_tokens
    assert np.array_equal(after, host_after)


def test_a_drafter_drafts_chains_on_the_gpu_as_step_by_step(folder) -> None:
    """Width buckets (a drafter's shapes): each chained forward is the shape the step-by-step
    loop runs, greedy and sampled."""
    chained = TorchRuntime(folder, device="cuda", dtype="float32")
    stepwise = TorchRuntime(folder, device="cuda", dtype="float32")
    stepwise._run_chain = None
    for params in (SamplingParams(), SamplingParams(temperature=0.8)):
        drafts = []
        for runtime in (chained, stepwise):
            runtime.rollback(0)
            runtime.prefill(LONG_PROMPT)
            draft = runtime.draft(12, params, DrawnSampler(3))
            drafts.append((draft.tokens.copy(), draft.probs.copy()))
        assert drafts[0][0].tolist() == drafts[1][0].tolist()
        np.testing.assert_allclose(drafts[0][1], drafts[1][1], rtol=0, atol=2e-6)
