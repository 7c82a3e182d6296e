"""The llama.cpp runtime on real GGUF files: trees, branches, commit/rollback, errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tiny_models import write_tiny_gguf_llama
from tokenizers import Tokenizer

from hetspec.speculative.drafting.branching import uncertainty_branches
from hetspec.speculative.drafting.dynamic_tree import within_leaves
from hetspec.speculative.drafting.vocab_match import incompatibilities
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.tree import chain_parents, path_to
from hetspec.workers.runtimes.llama_cpp_runtime import (
    LlamaCppError,
    LlamaCppRuntime,
    RuntimeUsageError,
)
from hetspec.workers.runtimes.llama_cpp_runtime.ggml import local_gpu_present
from hetspec.workers.runtimes.torch_runtime import TorchRuntime

TEXT = 'def load(path):\n    """Read the file."""\n    with open(path) as f:\n'
TOLERANCE = 1e-3  # llama.cpp against itself: a tree node vs its path evaluated alone
# The CPU flash-attention kernel and an f16 cache round to half precision (~1e-2 on logits);
# with both off llama.cpp computes in f32 and can be held to transformers' logits.
EXACT = {"kv_type": "f32", "flash_attention": "off"}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["exact", "default"])
def settings(request) -> dict:
    """Every behaviour is checked both in f32 and with the production defaults."""
    return EXACT if request.param == "exact" else {}


@pytest.fixture(scope="module")
def runtime(gguf, settings):
    return LlamaCppRuntime(gguf, n_ctx=256, n_batch=64, **settings)


@pytest.fixture(scope="module")
def prompt(runtime):
    return runtime.tokenize(TEXT)


def logits_after(runtime: LlamaCppRuntime, tokens: list[int]) -> np.ndarray:
    """Next-token logits after ``tokens``, evaluated as a plain sequence."""
    runtime.prefill(tokens)
    return runtime.last_logits().copy()


# llama-cpp-python's high-level Llama loads on every device registered with ggml in its
# process, and test_rpc registers rpc-servers that are gone once it ends: the reference runs
# in an interpreter of its own, so it holds whatever order the tests run in.
_GREEDY_REFERENCE = """
import json, sys
import llama_cpp
path, prompt, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
plain = llama_cpp.Llama(path, n_ctx=256, n_threads=1, verbose=False)
generated = []
for token in plain.generate(prompt, temp=0.0, reset=True):
    generated.append(token)
    if len(generated) == count:
        break
print(json.dumps(generated))
"""


@functools.cache
def _llama_cpp_greedy(path: str, prompt: tuple[int, ...], count: int) -> tuple[int, ...]:
    done = subprocess.run(
        [sys.executable, "-c", _GREEDY_REFERENCE, path, json.dumps(prompt), str(count)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return tuple(json.loads(done.stdout.splitlines()[-1]))


def llama_cpp_greedy(gguf, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt`` from llama-cpp-python's own generation loop."""
    return list(_llama_cpp_greedy(str(gguf), tuple(prompt), count))


def assert_close(ours: np.ndarray, theirs: np.ndarray, tolerance: float = TOLERANCE) -> None:
    difference = np.abs(ours - theirs).max()
    assert difference <= tolerance, f"max abs logit difference {difference:.2e} > {tolerance}"


def test_tokenizer_and_vocabulary_match_the_hugging_face_folder(runtime, gguf, prompt) -> None:
    hf = Tokenizer.from_file(str(gguf.parent / "tokenizer.json"))
    assert prompt == hf.encode(TEXT).ids
    assert prompt[0] == hf.token_to_id("<|endoftext|>")
    info = runtime.vocab_info()
    assert (info.kind, info.size, info.bos, info.eos, info.add_bos) == ("bpe", 320, 0, 0, True)
    assert b"".join(runtime.token_bytes(t) for t in prompt[1:]).decode() == TEXT


def test_logits_match_transformers_on_the_exported_model(gguf, prompt) -> None:
    reference = transformers.LlamaForCausalLM.from_pretrained(gguf.parent).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].numpy()
    runtime = LlamaCppRuntime(gguf, n_ctx=256, **EXACT)
    runtime.append(prompt[:1])
    ours = runtime.forward_tree(prompt[1:], chain_parents(len(prompt) - 1))
    assert_close(ours, expected[1:], tolerance=1e-4)


@pytest.mark.process
def test_greedy_draft_of_64_equals_llama_cpps_own_generation(runtime, gguf, prompt) -> None:
    runtime.prefill(prompt)
    drafted = runtime.draft(64, SamplingParams(), DrawnSampler(0)).tokens[0].tolist()

    assert drafted == llama_cpp_greedy(gguf, prompt, 64)


def test_tree_nodes_match_their_paths_evaluated_alone(runtime, prompt) -> None:
    tokens = [40, 41, 42, 43, 41, 44, 45, 46, 47, 48]
    parents = [-1, -1, 0, 0, 1, 2, 4, 6, 3, 3]
    runtime.prefill(prompt)
    tree_logits = runtime.forward_tree(tokens, parents).copy()
    for node in range(len(tokens)):
        path = [tokens[i] for i in path_to(node, np.array(parents))]
        assert_close(tree_logits[node], logits_after(runtime, prompt + path))


def test_a_tree_grown_over_several_calls_forks_below_inner_nodes(runtime, prompt) -> None:
    runtime.prefill(prompt)
    calls = [([50, 51], [-1, 0]), ([52, 53], [1, 0]), ([54, 55, 56], [-1, 2, 1])]
    parents_so_far: list[int] = []
    tokens_so_far: list[int] = []
    outputs = []
    for tokens, parents in calls:
        outputs.append(runtime.forward_tree(tokens, parents, extend=True).copy())
        tokens_so_far += tokens
        parents_so_far += parents
    all_logits = np.concatenate(outputs)
    for node in range(len(tokens_so_far)):
        path = [tokens_so_far[i] for i in path_to(node, np.array(parents_so_far))]
        assert_close(all_logits[node], logits_after(runtime, prompt + path))


def test_commit_then_continue_matches_a_fresh_run(runtime, gguf, settings, prompt) -> None:
    runtime.prefill(prompt)
    runtime.forward_tree([60, 61, 62, 63, 64], [-1, -1, 1, 2, 0])
    runtime.commit([1, 2, 3])
    assert runtime.tokens == [*prompt, 61, 62, 63]
    continued = runtime.draft(12, SamplingParams(), DrawnSampler(0)).tokens[0]

    fresh = LlamaCppRuntime(gguf, n_ctx=256, n_batch=64, **settings)
    fresh.prefill([*prompt, 61, 62, 63])
    assert_close(runtime.last_logits(), fresh.last_logits())
    assert (
        continued.tolist() == fresh.draft(12, SamplingParams(), DrawnSampler(0)).tokens[0].tolist()
    )

    runtime.rollback(len(prompt) - 3)
    fresh.prefill(prompt[:-3])
    assert_close(runtime.last_logits(), fresh.last_logits())


def test_branches_draft_greedily_and_the_chosen_one_is_kept(runtime, prompt) -> None:
    runtime.prefill(prompt)
    result = runtime.draft(5, SamplingParams(), DrawnSampler(0), branches=4)
    tokens, probs = result.tokens.copy(), result.probs.copy()
    assert tokens[:, 0].tolist() == np.argsort(-probs[0, 0], kind="stable")[:4].tolist()
    np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
    for branch in range(4):
        for step in range(1, 5):
            expected = logits_after(runtime, prompt + tokens[branch, :step].tolist())
            assert tokens[branch, step] == expected.argmax()

    runtime.prefill(prompt)
    runtime.draft(5, SamplingParams(), DrawnSampler(0), branches=4)
    accepted = [*tokens[2, :4].tolist(), 7]  # four drafted tokens of branch 2, then a bonus
    runtime.append(accepted)
    assert runtime.tokens == prompt + accepted
    assert_close(runtime.last_logits(), logits_after(runtime, prompt + accepted))


def test_dynamic_draft_branches_by_the_drafters_uncertainty(runtime, prompt) -> None:
    greedy, rng = SamplingParams(), DrawnSampler(0)
    runtime.prefill(prompt)
    single = runtime.draft(6, greedy, rng)
    chain, chain_probs = single.tokens.copy(), single.probs.copy()
    # a threshold far above p(top-1): no candidate reaches it, one sequence of the whole budget
    runtime.prefill(prompt)
    sure = runtime.draft(6, greedy, rng, branches=3, dynamic=1e9)
    assert sure.tokens.tolist() == chain.tolist()
    np.testing.assert_allclose(sure.probs, chain_probs, atol=1e-5)
    # a threshold of 0: every candidate reaches it, the cap's 3 sequences of 6 // 3 tokens
    runtime.prefill(prompt)
    unsure = runtime.draft(7, greedy, rng, branches=3, dynamic=0.0)
    tokens, probs = unsure.tokens.copy(), unsure.probs.copy()
    assert tokens.shape == (3, 2)
    assert tokens[:, 0].tolist() == np.argsort(-probs[0, 0], kind="stable")[:3].tolist()
    np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
    for branch in range(3):
        expected = logits_after(runtime, prompt + tokens[branch, :1].tolist())
        assert tokens[branch, 1] == expected.argmax()
    # DuoDecoding's own threshold: k is what the rule says for these distributions
    runtime.prefill(prompt)
    rule = runtime.draft(6, greedy, rng, branches=4, dynamic=1.0)
    k = uncertainty_branches(chain_probs[0, 0], float(chain_probs[0, 1].max()), 4)
    assert rule.tokens.shape == (k, 6 // k)
    # an accepted sequence is reused from the pending tree, as with fixed branches
    runtime.prefill(prompt)
    runtime.draft(7, greedy, rng, branches=3, dynamic=0.0)
    accepted = [*tokens[1].tolist(), 9]
    runtime.append(accepted)
    assert runtime.tokens == prompt + accepted
    assert_close(runtime.last_logits(), logits_after(runtime, prompt + accepted))


def _paths_expanded_by_hand(runtime, prompt, depth: int, top_k: int) -> dict[tuple, float]:
    """EAGLE-2's expansion done the slow way, every evaluated path as a plain sequence: each
    drafted path and its probability under the softmax of the draft's logits."""
    drafted: dict[tuple, float] = {}
    layer = [((), 1.0)]
    for _ in range(depth):
        grown = []
        for path, probability in sorted(layer, key=lambda item: -item[1])[:top_k]:
            logits = logits_after(runtime, prompt + list(path)).astype(np.float64)
            row = np.exp(logits - logits.max())
            row /= row.sum()
            for token in np.argsort(-row, kind="stable")[:top_k].tolist():
                grown.append(((*path, token), probability * row[token]))
        drafted.update(grown)
        layer = grown
    return drafted


def test_a_dynamic_tree_drafts_eagle2s_likeliest_nodes(runtime, prompt) -> None:
    depth, top_k, size = 3, 3, 8
    runtime.prefill(prompt)
    tree = runtime.draft_tree(depth, top_k, size, SamplingParams(), DrawnSampler(0))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert len(tokens) == size
    assert all(parent < index for index, parent in enumerate(parents))
    assert np.all(np.diff(tree.acceptance) <= 1e-12)  # ranked best first
    paths = [tuple(tokens[node] for node in path_to(index, tree.parents)) for index in range(size)]
    by_hand = _paths_expanded_by_hand(runtime, prompt, depth, top_k)
    best = sorted(by_hand.values(), reverse=True)[:size]
    for path, probability in zip(paths, tree.acceptance.tolist(), strict=True):
        assert by_hand[path] == pytest.approx(probability, rel=1e-3)
    np.testing.assert_allclose(tree.acceptance, best, rtol=1e-3)
    # ranked by a first-choice acceptance near 1, the best `depth` nodes are the greedy chain
    runtime.prefill(prompt)
    chain = runtime.draft(depth, SamplingParams(), DrawnSampler(0)).tokens[0].tolist()
    runtime.prefill(prompt)
    sure = runtime.draft_tree(
        depth, top_k, size, SamplingParams(), DrawnSampler(0), first_accept=0.95
    )
    assert sure.tokens[:depth].tolist() == chain
    assert sure.parents[:depth].tolist() == list(range(-1, depth - 1))
    # an accepted path of evaluated nodes is reused, not recomputed
    runtime.prefill(prompt)
    tree = runtime.draft_tree(depth, top_k, size, SamplingParams(), DrawnSampler(0))
    deepest = max(range(size), key=lambda node: len(path_to(node, tree.parents)))
    accepted = [int(tree.tokens[node]) for node in path_to(deepest, tree.parents)] + [5]
    runtime.append(accepted)
    assert runtime.tokens == prompt + accepted
    assert_close(runtime.last_logits(), logits_after(runtime, prompt + accepted))


def test_a_dynamic_tree_expands_only_what_the_runtimes_leaves_hold(gguf, prompt) -> None:
    narrow = LlamaCppRuntime(gguf, n_ctx=256, n_batch=64, n_seq_max=3)  # 2 leaves
    narrow.prefill(prompt)
    tree = narrow.draft_tree(5, 3, 20, SamplingParams(), DrawnSampler(0))
    pending = narrow._pending_parents.tolist()
    assert within_leaves(pending, 2) == len(pending)  # never more leaves than it holds
    assert len(pending) >= 5  # two below the root, then one more a layer at least
    assert max(len(path_to(node, tree.parents)) for node in range(len(tree.tokens))) == 5
    narrow.close()


def test_a_dynamic_tree_refuses_an_empty_shape(runtime, prompt) -> None:
    runtime.prefill(prompt)
    with pytest.raises(RuntimeUsageError, match="cannot draft a tree"):
        runtime.draft_tree(0, 2, 4, SamplingParams(), DrawnSampler(0))


@pytest.mark.skipif(
    not local_gpu_present(), reason="this llama.cpp build cannot offload layers to a GPU"
)
def test_partial_offload_verifies_as_the_cpu_does(gguf, prompt) -> None:
    """Dovetail's partial offload (draft-gpu: cpu_worker.gpu_layers): some of the verifier's
    layers on the GPU give the logits the CPU gives, within half precision."""
    cpu = LlamaCppRuntime(gguf, n_ctx=256, n_batch=64)
    cpu.prefill(prompt)
    expected = cpu.last_logits().copy()
    cpu.close()
    split = LlamaCppRuntime(gguf, n_ctx=256, n_batch=64, gpu_layers=1)
    assert split.offloaded
    split.prefill(prompt)
    assert_close(split.last_logits(), expected, 2e-2)


def test_sampled_branches_are_reproducible_and_drawn_from_their_rows(runtime, prompt) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    runtime.prefill(prompt)
    first = runtime.draft(6, params, DrawnSampler(11), branches=3)
    tokens, probs = first.tokens.copy(), first.probs.copy()
    runtime.prefill(prompt)
    again = runtime.draft(6, params, DrawnSampler(11), branches=3)
    assert (again.tokens == tokens).all()
    np.testing.assert_allclose(again.probs, probs, atol=1e-6)
    assert (np.take_along_axis(probs, tokens[..., None], axis=-1) > 0).all()
    assert ((probs > 0).sum(-1) <= 40).all()


def test_trees_and_prompts_longer_than_n_batch_are_split(gguf, prompt) -> None:
    small = LlamaCppRuntime(gguf, n_ctx=256, n_batch=8, **EXACT)
    big = LlamaCppRuntime(gguf, n_ctx=256, n_batch=256, **EXACT)
    tokens = list(range(30, 55))
    parents = [-1] + [i // 2 for i in range(len(tokens) - 1)]  # a binary tree of 25 nodes
    for runtime in (small, big):
        runtime.prefill(prompt)  # 23 tokens: three n_batch chunks for the small one
    assert_close(small.last_logits(), big.last_logits())
    assert_close(small.forward_tree(tokens, parents), big.forward_tree(tokens, parents))


def test_too_many_leaves_is_a_clear_error(gguf, prompt) -> None:
    runtime = LlamaCppRuntime(gguf, n_ctx=256, n_seq_max=4)
    runtime.prefill(prompt)
    runtime.forward_tree([1, 2, 3], [-1, -1, -1])
    runtime.forward_tree([4], [0], extend=True)  # continues leaf 0: no new sequence
    with pytest.raises(RuntimeUsageError, match="more than 3 leaves"):
        runtime.forward_tree([5], [-1], extend=True)


def test_context_full_is_a_clear_error(gguf) -> None:
    runtime = LlamaCppRuntime(gguf, n_ctx=256)
    runtime.prefill(list(range(1, 250)))
    with pytest.raises(RuntimeUsageError, match="context full"):
        runtime.forward_tree(list(range(8)), chain_parents(8))


def test_loading_problems_are_clear_errors(tmp_path, gguf) -> None:
    with pytest.raises(LlamaCppError, match="no such file"):
        LlamaCppRuntime(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(LlamaCppError, match="not a GGUF file"):
        LlamaCppRuntime(junk)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(LlamaCppError, match=r"could not load this model; llama\.cpp said: "):
        LlamaCppRuntime(truncated)
    with pytest.raises(LlamaCppError, match=r"outside what the model allows \(1\.\.256\)"):
        LlamaCppRuntime(gguf, n_ctx=512)
    owned = len(os.sched_getaffinity(0))
    with pytest.raises(LlamaCppError, match=f"this process owns {owned} cores"):
        LlamaCppRuntime(gguf, threads=owned + 1)
    with pytest.raises(LlamaCppError, match="v_type must be one of f32, f16, q8_0, not 'f8'"):
        LlamaCppRuntime(gguf, v_type="f8")


def test_quantizing_in_the_same_process_leaves_the_log_hook_to_the_runtime(tmp_path, gguf) -> None:
    """llama.cpp's log hook is one per process: making a K-quant file (llama.cpp's quantizer,
    with a hook of its own while it runs) must hand it back, or a later load failure loses
    llama.cpp's reason."""
    from hetspec.models.llama_quantize import quantize_gguf  # noqa: PLC0415

    LlamaCppRuntime(gguf)  # installs the runtime's hook
    bundled = Path(__file__).resolve().parents[1] / "models" / "target" / "target-f16.gguf"
    quantize_gguf(bundled, tmp_path / "target-q4_k_m.gguf", "q4_k_m", threads=1)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(LlamaCppError, match=r"could not load this model; llama\.cpp said: "):
        LlamaCppRuntime(truncated)


def test_draft_and_target_vocabularies_are_compared(tmp_path, gguf, runtime) -> None:
    same_tokenizer = LlamaCppRuntime(write_tiny_gguf_llama(tmp_path / "other", seed=1, layers=1))
    assert incompatibilities(same_tokenizer.vocab_info(), runtime.vocab_info()) == []
    other_vocab = LlamaCppRuntime(write_tiny_gguf_llama(tmp_path / "v", vocab_size=300))
    problems = incompatibilities(other_vocab.vocab_info(), runtime.vocab_info())
    assert problems == [
        f"token texts differ (300 tokens, fingerprint {other_vocab.vocab_info().fingerprint[:12]} "
        f"vs 320 tokens, {runtime.vocab_info().fingerprint[:12]})"
    ]


def test_the_torch_runtime_reports_the_same_vocabulary_from_the_folder(runtime, gguf) -> None:
    """Both engines must agree on ids, texts and bytes, or the daemon could not pair them."""
    folder_runtime = TorchRuntime(gguf.parent, max_context=64)
    assert folder_runtime.vocab_info() == runtime.vocab_info()
    text = 'def f(x):\n    """héllo 😀 wörld"""\n    return x<|im_end|>'
    assert folder_runtime.tokenize(text) == runtime.tokenize(text)
    assert folder_runtime.tokenize(text, add_special=False) == runtime.tokenize(
        text, add_special=False
    )
    for token in range(runtime.vocab_size):
        assert folder_runtime.token_bytes(token) == runtime.token_bytes(token), token


@pytest.mark.parametrize("engine", ["llama.cpp", "torch"])
def test_a_draft_continues_after_a_pending_one(runtime, gguf, prompt, engine) -> None:
    """Running ahead: continuing a pending draft equals drafting the whole length at once."""
    drafter = runtime if engine == "llama.cpp" else TorchRuntime(gguf.parent, max_context=128)
    greedy, rng = SamplingParams(), DrawnSampler(0)
    drafter.prefill(prompt)
    whole = drafter.draft(7, greedy, rng).tokens[0].tolist()
    drafter.prefill(prompt)
    head = drafter.draft(4, greedy, rng)
    tail = drafter.draft(3, greedy, rng, after=(int(head.nodes[0, 2]), int(head.tokens[0, 3])))
    assert head.tokens[0].tolist() + tail.tokens[0].tolist() == whole
    assert tail.root == drafter.pending - 3  # below the evaluated 4th token
    drafter.append(whole)  # the whole chain is pending and is reused
    assert drafter.tokens == [*prompt, *whole]


@pytest.mark.process
@pytest.mark.parametrize("engine", ["llama.cpp", "torch"])
def test_decoding_alone_commits_as_it_draws_and_equals_llama_cpps_generation(
    runtime, gguf, prompt, engine
) -> None:
    """The target alone (``decode``): the greedy tokens of plain generation, every one but the
    last committed; sampled draws reproducible from the generator, committed likewise."""
    decoder = runtime if engine == "llama.cpp" else TorchRuntime(gguf.parent, max_context=128)
    decoder.prefill(prompt)
    first = decoder.decode(5, SamplingParams(), DrawnSampler(0))
    decoder.append(first[-1:])
    rest = decoder.decode(11, SamplingParams(), DrawnSampler(0))
    assert decoder.pending == 0
    assert decoder.tokens == [*prompt, *first, *rest[:-1]]

    generated = llama_cpp_greedy(gguf, prompt, 16)
    if engine == "llama.cpp":
        assert first + rest == generated
    else:  # torch in f32 vs llama.cpp's kernels: near-ties may differ
        assert np.mean(np.array(first + rest) == np.array(generated)) >= 0.8

    sampled = SamplingParams(temperature=0.8)
    decoder.prefill(prompt)
    once = decoder.decode(8, sampled, DrawnSampler(7))
    decoder.prefill(prompt)
    assert decoder.decode(8, sampled, DrawnSampler(7)) == once
    assert decoder.tokens == [*prompt, *once[:-1]]
    with pytest.raises(RuntimeUsageError, match="cannot decode 0"):
        decoder.decode(0, sampled, DrawnSampler(7))
