"""The torch runtime against transformers: prefill, decode, trees, commit/rollback, drafting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TINY_CONFIGS, build_reference, compiled_beside_eager, save_reference

from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.tree import chain_parents, path_to
from hetspec.workers.runtimes.torch_runtime import (
    ModelLoadError,
    RuntimeUsageError,
    TorchRuntime,
    static_forward,
)
from hetspec.workers.runtimes.torch_runtime.static_forward import Shapes

TOLERANCE = 1e-4  # max abs logit difference allowed against transformers in fp32
PROMPT = [1, 17, 42, 5, 88, 23, 9, 61, 2, 70, 33, 14]


# (config, fixed_width, attention): width 0 runs each call in its own shape (the CPU's
# default); 4 runs every call as forwards of exactly 4 rows through static_forward.py, the
# shapes CUDA graphs replay, with each row's path gathered or with split attention (its
# split points 4 apart here, so the prompt's rows read keys both in place and gathered)
@pytest.fixture(
    scope="module",
    params=[
        (c, w, a)
        for c in sorted(TINY_CONFIGS)
        for w, a in ((0, "gathered"), (4, "gathered"), (4, "split"))
    ],
    ids=lambda p: f"{p[0]}-w{p[1]}" + "-split" * (p[2] == "split"),
)
def pair(request, tmp_path_factory):
    """(transformers reference, our runtime over the same saved checkpoint)."""
    name, fixed_width, attention = request.param
    reference = build_reference(name)
    folder = save_reference(reference, tmp_path_factory.mktemp(name))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_forward, "TAIL_BLOCK", 4)
        runtime = TorchRuntime(
            folder, device="cpu", dtype="float32", fixed_width=fixed_width, attention=attention
        )
    assert runtime.attention == attention
    return reference, runtime


def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor | np.ndarray, theirs: torch.Tensor) -> None:
    difference = (torch.as_tensor(ours).cpu() - theirs).abs().max().item()
    assert difference <= TOLERANCE, f"max abs logit difference {difference:.2e} > {TOLERANCE}"


def test_prefill_logits_match_transformers(pair) -> None:
    reference, runtime = pair
    runtime.rollback(0)
    output = runtime.forward_tree(PROMPT, chain_parents(len(PROMPT)))
    assert output.logits.shape == (len(PROMPT), runtime.config.vocab_size)
    assert output.hidden.shape == (len(PROMPT), runtime.config.hidden_size)
    assert_close(output.logits, reference_logits(reference, PROMPT))


def test_chunked_prefill_then_single_token_decode(pair) -> None:
    reference, runtime = pair
    runtime.rollback(0)
    runtime.prefill(PROMPT, chunk_size=5)  # chunks of 5, 5, 2
    assert runtime.tokens == PROMPT
    assert_close(runtime.last_logits(), reference_logits(reference, PROMPT)[-1])
    for token in (7, 3, 90):
        output = runtime.forward_tree([token], [-1])
        runtime.commit([0])
        assert_close(output.logits[0], reference_logits(reference, runtime.tokens)[-1])


def test_tree_nodes_match_their_paths_evaluated_alone(pair) -> None:
    reference, runtime = pair
    runtime.prefill(PROMPT)
    # Two subtrees below the prefix, uneven depths, siblings sharing tokens.
    tokens = [11, 12, 13, 14, 12, 15, 16, 17, 18]
    parents = [-1, -1, 0, 0, 1, 2, 4, 6, 3]
    output = runtime.forward_tree(tokens, parents)
    for node in range(len(tokens)):
        path = [tokens[i] for i in path_to(node, np.array(parents))]
        assert_close(output.logits[node], reference_logits(reference, PROMPT + path)[-1])


def test_commit_compacts_an_off_chain_path_and_rollback_rewinds(pair) -> None:
    reference, runtime = pair
    runtime.prefill(PROMPT)
    tokens, parents = [11, 12, 13, 14, 15], [-1, -1, 1, 0, 2]
    runtime.forward_tree(tokens, parents)
    runtime.commit([1, 2, 4])  # 12 -> 13 -> 15, stored in slots that were not contiguous
    assert runtime.tokens == [*PROMPT, 12, 13, 15]
    assert runtime.pending == 0
    assert_close(runtime.last_logits(), reference_logits(reference, runtime.tokens)[-1])
    output = runtime.forward_tree([40, 41], [-1, 0])
    assert_close(output.logits, reference_logits(reference, [*runtime.tokens, 40, 41])[-2:])

    runtime.rollback(5)
    assert runtime.tokens == PROMPT[:5]
    assert_close(runtime.last_logits(), reference_logits(reference, PROMPT[:5])[-1])
    output = runtime.forward_tree([77], [-1])
    assert_close(output.logits[0], reference_logits(reference, [*PROMPT[:5], 77])[-1])


def test_greedy_with_cache_equals_greedy_recomputing_the_prefix(pair) -> None:
    reference, runtime = pair
    runtime.prefill(PROMPT)
    drafted = runtime.draft(24, SamplingParams(), DrawnSampler(0)).tokens[0]

    recomputed = list(PROMPT)
    for _ in range(24):
        runtime.rollback(0)
        output = runtime.forward_tree(recomputed, chain_parents(len(recomputed)))
        recomputed.append(int(output.logits[-1].argmax()))
    assert drafted.tolist() == recomputed[len(PROMPT) :]
    expected = reference_logits(reference, recomputed[:-1])[len(PROMPT) - 1 :].argmax(-1)
    assert drafted.tolist() == expected.tolist()


def test_multi_branch_draft_then_append_reuses_the_chosen_branch(pair) -> None:
    reference, runtime = pair
    runtime.prefill(PROMPT)
    result = runtime.draft(4, SamplingParams(), DrawnSampler(0), branches=3)
    first_row = result.probs[0, 0]
    assert result.tokens[:, 0].tolist() == np.argsort(-first_row, kind="stable")[:3].tolist()
    np.testing.assert_allclose(result.probs.sum(-1), 1, atol=1e-5)
    for branch in range(3):  # each branch continues greedily from its first token
        path = [*PROMPT, *result.tokens[branch].tolist()]
        logits = reference_logits(reference, path[:-1])[len(PROMPT) :]
        assert result.tokens[branch, 1:].tolist() == logits.argmax(-1).tolist()
        np.testing.assert_allclose(result.probs[branch, 1:], logits.softmax(-1).numpy(), atol=1e-5)
    assert (result.nodes[:, -1] == -1).all()

    chosen = [*result.tokens[1, :3].tolist(), 5]  # 3 drafted tokens accepted, then a bonus
    runtime.append(chosen)
    assert runtime.tokens == [*PROMPT, *chosen]
    assert_close(runtime.last_logits(), reference_logits(reference, runtime.tokens)[-1])


def test_sampled_draft_is_reproducible_and_draws_from_its_rows(pair) -> None:
    _, runtime = pair
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    runtime.prefill(PROMPT)
    first = runtime.draft(6, params, DrawnSampler(7), branches=2)
    tokens, probs = first.tokens.copy(), first.probs.copy()
    again = runtime.draft(6, params, DrawnSampler(7), branches=2)
    assert (again.tokens == tokens).all()
    np.testing.assert_array_equal(again.probs, probs)
    chosen = np.take_along_axis(probs, tokens[..., None], axis=-1)
    assert (chosen > 0).all()
    assert ((probs > 0).sum(-1) <= 20).all()  # top-k left at most 20 candidates


def test_draft_writes_into_a_caller_buffer(pair) -> None:
    _, runtime = pair
    runtime.prefill(PROMPT)
    buffer = np.zeros((2, 3, runtime.config.vocab_size), np.float32)
    result = runtime.draft(3, SamplingParams(), DrawnSampler(0), branches=2, out=buffer)
    assert result.probs is buffer
    np.testing.assert_allclose(buffer.sum(-1), 1, atol=1e-5)
    with pytest.raises(RuntimeUsageError, match="C-contiguous float32"):
        runtime.draft(3, SamplingParams(), DrawnSampler(0), out=buffer)


def test_bad_calls_are_clear_errors(pair) -> None:
    _, runtime = pair
    runtime.prefill(PROMPT)
    with pytest.raises(RuntimeUsageError, match="outside the vocabulary"):
        runtime.forward_tree([runtime.config.vocab_size], [-1])
    with pytest.raises(ValueError, match="parent must be -1"):
        runtime.forward_tree([1, 2], [-1, 1])
    runtime.forward_tree([1, 2, 3], [-1, -1, 0])
    with pytest.raises(RuntimeUsageError, match="not a path"):
        runtime.commit([1, 2])
    with pytest.raises(RuntimeUsageError, match="roll back"):
        runtime.rollback(len(PROMPT) + 1)
    runtime.rollback(0)
    with pytest.raises(RuntimeUsageError, match="prefill a prompt first"):
        runtime.last_logits()


def test_context_limits(tmp_path) -> None:
    folder = save_reference(build_reference("qwen2"), tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"outside what the model allows \(1\.\.256\)"):
        TorchRuntime(folder, device="cpu", max_context=257)
    runtime = TorchRuntime(folder, device="cpu", max_context=16)
    runtime.prefill(list(range(1, 15)))
    with pytest.raises(RuntimeUsageError, match="context full"):
        runtime.forward_tree([1, 2, 3], [-1, 0, 1])
    runtime.forward_tree([1, 2], [-1, 0])  # exactly fills the cache


def test_sharded_checkpoint_loads(tmp_path) -> None:
    reference = build_reference("llama3-rope")
    folder = save_reference(reference, tmp_path / "sharded", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists()
    runtime = TorchRuntime(folder, device="cpu")
    output = runtime.forward_tree(PROMPT, chain_parents(len(PROMPT)))
    assert_close(output.logits, reference_logits(reference, PROMPT))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = save_reference(build_reference("llama3-rope"), tmp_path_factory.mktemp("base"))
    return (
        folder,
        load_file(folder / "model.safetensors"),
        json.loads((folder / "config.json").read_text()),
    )


def write_variant(tmp_path, checkpoint, tensors=None, config=None):
    _, base_tensors, base_config = checkpoint
    folder = tmp_path / "variant"
    folder.mkdir()
    save_file(base_tensors if tensors is None else tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(base_config if config is None else config))
    return folder


def test_missing_tensor_is_named(tmp_path, checkpoint) -> None:
    tensors = dict(checkpoint[1])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    folder = write_variant(tmp_path, checkpoint, tensors=tensors)
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        TorchRuntime(folder, device="cpu")


def test_wrong_shape_and_unknown_tensor_are_named(tmp_path, checkpoint) -> None:
    tensors = dict(checkpoint[1])
    tensors["model.norm.weight"] = torch.ones(65)
    folder = write_variant(tmp_path, checkpoint, tensors=tensors)
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \(65,\)"):
        TorchRuntime(folder, device="cpu")
    tensors = {**checkpoint[1], "model.layers.0.self_attn.extra.weight": torch.ones(2)}
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"does not use: model\.layers\.0\.self_attn\.extra"):
        TorchRuntime(folder, device="cpu")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"vocab_size": None}, "lacks 'vocab_size'|malformed"),
    ],
)
def test_unsupported_configs_are_clear_errors(tmp_path, checkpoint, change, message) -> None:
    config = {k: v for k, v in checkpoint[2].items() if change.get(k, 0) is not None}
    config.update({k: v for k, v in change.items() if v is not None})
    folder = write_variant(tmp_path, checkpoint, config=config)
    with pytest.raises(ModelLoadError, match=message) as error:
        TorchRuntime(folder, device="cpu")
    assert str(folder) in str(error.value)


def test_folder_problems_are_clear_errors(tmp_path, checkpoint) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        TorchRuntime(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        TorchRuntime(tmp_path / "empty")
    folder = write_variant(tmp_path, checkpoint)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are not loaded"):
        TorchRuntime(folder, device="cpu")
    (folder / "pytorch_model.bin").unlink()
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        TorchRuntime(folder, device="cpu")


@pytest.mark.process  # torch.compile runs a compiler
@pytest.mark.slow
def test_compiled_model_gives_the_eager_logits(tmp_path) -> None:
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    eager = TorchRuntime(folder, device="cpu")
    compiled = TorchRuntime(folder, device="cpu", compile=True)
    for runtime in (eager, compiled):
        runtime.prefill(PROMPT)
    tree = ([3, 4, 5], [-1, 0, 0])
    assert_close(compiled.forward_tree(*tree).logits, eager.forward_tree(*tree).logits)


@pytest.mark.process  # torch.compile runs a compiler
@pytest.mark.slow
def test_a_compiled_verifier_compiles_a_forward_once_for_every_span(tmp_path, monkeypatch):
    """The span reaches a compiled forward as a dynamic dimension: a chain walking through
    three span buckets compiles each kind of forward (trees, chains gathered, chains in
    place) once, not once a bucket, and tracks eager forwards all the way."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 (dynamo's own statistics)

    monkeypatch.setattr(static_forward, "MIN_SPAN", 16)
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    options = {"device": "cpu", "dtype": "float32", "fixed_width": 4, "max_context": 64}
    before = counters["stats"]["unique_graphs"]
    compiled, eager = compiled_beside_eager(folder, PROMPT, **options)
    assert len(compiled._static.shapes.spans) == 3  # 16, 32, 64
    for step in range(11):  # to position 56, through every bucket: chains, then a tree
        tree = ([3, 4, 5, 6], [-1, 0, 1, 2] if step % 2 else [-1, 0, 0, 2])
        ours, theirs = (runtime.forward_tree(*tree).logits for runtime in (compiled, eager))
        assert_close(ours, theirs)
        for runtime in (compiled, eager):
            runtime.commit([0, 1])
    assert counters["stats"]["unique_graphs"] - before <= 3 + 1  # and the prompt's, eager shapes


@pytest.mark.process  # torch.compile runs a compiler
@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gathered", "split"])
def test_compiled_fixed_shapes_track_eager_and_stay_width_invariant(tmp_path, attention) -> None:
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    eager = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4)
    compiled = TorchRuntime(
        folder, device="cpu", dtype="float32", fixed_width=4, compile=True, attention=attention
    )
    assert compiled.attention == attention
    for runtime in (eager, compiled):
        runtime.prefill(PROMPT)
    tree = ([3, 4, 5, 6], [-1, 0, 0, 2])
    assert_close(compiled.forward_tree(*tree).logits, eager.forward_tree(*tree).logits)
    compiled.discard_pending()
    alone = compiled.forward_tree([3], [-1]).logits[0].clone()
    compiled.discard_pending()
    assert torch.equal(compiled.forward_tree([3, 9, 11], [-1, -1, 0]).logits[0], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_tracks_fp32(tmp_path, dtype) -> None:
    reference = build_reference("qwen3")
    folder = save_reference(reference, tmp_path / "m")
    runtime = TorchRuntime(folder, device="cuda", dtype=dtype)
    output = runtime.forward_tree(PROMPT, chain_parents(len(PROMPT)))
    expected = reference_logits(reference, PROMPT)
    assert output.logits.device.type == "cuda"
    assert (output.logits.cpu().argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert (output.logits.cpu() - expected).abs().max().item() < 0.2


@pytest.mark.parametrize("attention", ["gathered", "split"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma2"])
def test_fixed_width_logits_do_not_depend_on_the_tree(
    tmp_path, monkeypatch, name, dtype, attention
) -> None:
    """With a fixed width a token's logits are bit-identical alone and inside any tree: the
    chain below with a wrong sibling beside every token (siblings between its ancestors in
    the cache), as several forwards, as a tree of more paths than a forward gathers, across
    attention span buckets (16, 32, 64 .. here); Gemma's windows of 6 positions too; in
    float32 and in the GPU's bfloat16; through gathered paths (the tokens alone attending to
    the cache in place) and through split attention (split points 8 apart here, so most
    rows read keys both in place and from their gathered tails)."""
    monkeypatch.setattr(static_forward, "MIN_SPAN", 16)
    monkeypatch.setattr(static_forward, "TAIL_BLOCK", 8)
    folder = save_reference(build_reference(name), tmp_path / "m")
    runtime = TorchRuntime(folder, device="cpu", dtype=dtype, fixed_width=4, attention=attention)
    assert runtime._static.shapes.spans == (16, 32, 64, 128, 256)
    watched = runtime._split if attention == "split" else runtime._in_place
    assert runtime.attention == attention
    assert attention == "split" or runtime.chains_in_place  # alone: the cache in place
    ran = []
    run = watched.run
    monkeypatch.setattr(watched, "run", lambda *a: ran.append(1) or run(*a))
    runtime.prefill(PROMPT)
    chain, alone = [], []
    for _ in range(30):  # greedy, one token a forward, each committed
        chain.append(int(runtime.last_logits().argmax()))
        alone.append(runtime.forward_tree([chain[-1]], [-1]).logits[0].clone())
        runtime.commit([0])
    assert len(ran) >= 30
    for width in (1, 3, 5, 11):
        runtime.rollback(len(PROMPT))
        for begin in range(0, len(chain), width):
            part = chain[begin : begin + width]
            tokens = [t for token in part for t in (token, (token + 1) % 96)]
            parents = [-1 if i < 2 else 2 * (i // 2 - 1) for i in range(len(tokens))]
            logits = runtime.forward_tree(tokens, parents).logits
            for i in range(len(part)):
                assert torch.equal(logits[2 * i], alone[begin + i]), (width, begin + i)
            runtime.commit([2 * i for i in range(len(part))])
    # six branches from the root, the chain's first three tokens in the last one
    runtime.rollback(len(PROMPT))
    tokens = [*(t + 7 for t in range(5)), chain[0], chain[1], chain[2]]
    output = runtime.forward_tree(tokens, [-1, -1, -1, -1, -1, -1, 5, 6])
    for i in range(3):
        assert torch.equal(output.logits[5 + i], alone[i])
    assert runtime.deep_rows == 0


def test_chains_in_the_caches_order_attend_in_place_only_with_the_same_bits(tmp_path) -> None:
    """A one-path forward whose path is the cache's order attends to the cache in place; the
    check at load compares that with the gathered path on random tokens and refuses a
    forward whose bits differ (here one over other weights)."""
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    runtime = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4, max_context=64)
    gathered = TorchRuntime(
        folder, device="cpu", dtype="float32", fixed_width=4, max_context=64, chain_in_place=False
    )
    assert runtime.chains_in_place
    assert not runtime.in_place_differed
    assert not gathered.chains_in_place
    assert not gathered.in_place_differed  # not refused: never asked for
    for each in (runtime, gathered):
        each.prefill(PROMPT)
    tokens = [5, 6, 7, 8, 9]
    assert torch.equal(
        runtime.forward_tree(tokens, chain_parents(5)).logits,
        gathered.forward_tree(tokens, chain_parents(5)).logits,
    )

    chains = runtime._chains
    assert static_forward.same_bits_in_place(chains, runtime._in_place)
    other = save_reference(build_reference("qwen3", seed=1), tmp_path / "other")
    elsewhere = TorchRuntime(other, device="cpu", dtype="float32", fixed_width=4, max_context=64)
    assert not static_forward.same_bits_in_place(chains, elsewhere._in_place)


def test_which_one_path_batches_are_in_the_caches_order(tmp_path, monkeypatch) -> None:
    folder = save_reference(build_reference("qwen3"), tmp_path / "m")
    runtime = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4, max_context=64)
    batches = []
    forward = runtime._forward_batch

    def kept(static, batch, *rest):
        batches.append(batch)
        return forward(static, batch, *rest)

    monkeypatch.setattr(runtime, "_forward_batch", kept)
    runtime.prefill(PROMPT)
    batches.clear()
    runtime.forward_tree([5, 6, 7, 8, 9], [-1, 0, 1, 2, 2])  # a chain, then a fork (width 4)
    assert [static_forward.in_cache_order(b) for b in batches] == [True, False]
    runtime.discard_pending()
    runtime.forward_tree([5, 6], [-1, -1])  # two siblings: two paths, not one
    batches.clear()
    runtime.forward_tree([7], [1], extend=True)  # below the second: its parent sits past a slot
    assert len(batches[0].gather) == 1
    assert not static_forward.in_cache_order(batches[0])


def test_chains_in_the_caches_order_go_in_place_without_a_gather(tmp_path, monkeypatch) -> None:
    """A chain that extends the committed tokens, or a pending chain from them, is run in
    place as the batches the gathering path would have flattened it to (the same rows, slots,
    span buckets and masks, a sliding window's too), without building their gathers; other
    trees take the gathering path."""
    monkeypatch.setattr(static_forward, "MIN_SPAN", 16)
    folder = save_reference(build_reference("gemma3"), tmp_path / "m")
    runtime = TorchRuntime(folder, device="cpu", dtype="float32", fixed_width=4, max_context=64)
    assert runtime.chains_in_place
    assert len(runtime._in_place.windows) == 2
    runtime.prefill(PROMPT)

    def gathered(positions, parents):  # what _forward_batch ran in place before
        batches = runtime._invariant_batches(runtime._static, positions, parents)
        return [(rows, batch) for rows, batch in batches if static_forward.in_cache_order(batch)]

    for existing, count in ((0, 9), (3, 6)):  # across the span bucket's end at 16
        runtime.discard_pending()
        if existing:
            runtime.forward_tree(list(range(5, 5 + existing)), chain_parents(existing))
        positions = len(PROMPT) + existing + np.arange(count)
        parents = np.arange(existing - 1, existing + count - 1)
        fast = list(runtime._in_place_batches(positions, parents))
        slow = gathered(positions, parents)
        assert len(fast) == len(slow) >= 2
        for (rows, batch), (slow_rows, slow_batch) in zip(fast, slow, strict=True):
            assert batch.gather is None
            assert batch.row_paths is None
            assert np.array_equal(rows, slow_rows)
            for field in ("positions", "slots"):
                assert np.array_equal(getattr(batch, field), getattr(slow_batch, field))
            assert batch.span == slow_batch.span
            for mask, slow_mask in zip(batch.masks, slow_batch.masks, strict=True):
                assert np.array_equal(mask, slow_mask[0])
    runtime.discard_pending()
    runtime.forward_tree([5, 6], [-1, -1])
    assert runtime._in_place_batches(len(PROMPT) + np.array([1]), np.array([0])) is None
    ran = []
    monkeypatch.setattr(runtime._static, "run", lambda *a: ran.append(1))
    runtime.discard_pending()
    assert runtime.evaluate_argmax([5, 6, 7], chain_parents(3))
    assert runtime.decode(3, SamplingParams(), DrawnSampler())
    assert ran == []  # neither ran a gathering forward


def test_shape_buckets() -> None:
    buckets = Shapes.for_context(1000, fixed_width=0, span_buckets=True)
    assert buckets.widths == (1, 2, 4, 8, 16, 32, 64)
    assert buckets.spans == (256, 512, 1000)
    assert (buckets.width_for(3), buckets.width_for(64), buckets.span_for(513)) == (4, 64, 1000)
    assert buckets.all()[0] == (64, 1000)
    assert buckets.all()[-1] == (1, 256)
    assert buckets.paths == 0  # widths vary: tokens attend in cache order
    fixed = Shapes.for_context(256, fixed_width=16, span_buckets=False)
    assert (fixed.widths, fixed.spans, fixed.width_for(1)) == ((16,), (256,), 16)
    assert fixed.paths == static_forward.INVARIANT_PATHS


def test_argmax_alone_is_the_logits_argmax(pair) -> None:
    """Greedy verification's call: each node's argmax, as numpy takes it from the logits."""
    _, runtime = pair
    runtime.prefill(PROMPT)
    tree = ([3, 4, 5, 6, 70], [-1, 0, 0, 2, -1])
    logits = runtime.evaluate_tree(*tree)
    assert runtime.evaluate_argmax(*tree) == logits.argmax(-1).tolist()
    assert runtime.pending == len(tree[0])  # the nodes stay pending as evaluate_tree's do


def test_a_committed_rows_logits_leave_the_device_only_when_asked(pair, monkeypatch) -> None:
    _, runtime = pair
    runtime.prefill(PROMPT)
    logits = runtime.forward_tree([3, 4, 5], [-1, 0, 0]).logits.clone()
    fetched = []
    node_logits = runtime._node_logits
    monkeypatch.setattr(runtime, "_node_logits", lambda *a: fetched.append(a) or node_logits(*a))
    runtime.commit([0, 2])
    assert fetched == []  # a greedy round goes on to its next tree without them
    runtime.forward_tree([9], [-1])  # later forwards leave the committed row's logits alone
    runtime.discard_pending()
    assert np.array_equal(runtime.last_logits(), logits[2].numpy())
    assert len(fetched) == 1
    runtime.last_logits()
    assert len(fetched) == 1
