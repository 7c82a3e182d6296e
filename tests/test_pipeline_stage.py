"""The bundled target split into torch pipeline stages
(workers/runtimes/torch_runtime/stage_runtime.py), driven by FlowSpec's tree and stage books in
one process: the split model computes what the whole model computes, and pipelined greedy
verification returns the target's greedy text."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import build_reference, save_reference

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.speculative.flow.flow_tree import FlowTree
from hetspec.speculative.flow.stage_cache import StageBook
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.torch_runtime import TorchRuntime
from hetspec.workers.runtimes.torch_runtime.config import ModelLoadError
from hetspec.workers.runtimes.torch_runtime.stage_runtime import StageRuntime

TARGET = BUNDLED_MODELS / "target"
PROMPT = "def read_lines(path):\n    with open(path) as"
# in layers; 1.5: after layer 1's attention (the middle stage of "halves" holds one MLP)
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)], "halves": [(0, 1.5), (1.5, 2), (2, 4)]}


@pytest.fixture(scope="module")
def whole():
    runtime = TorchRuntime(TARGET, device="cpu", dtype="float32", max_context=512)
    tokens = runtime.tokenize(PROMPT)
    runtime.prefill(tokens)
    greedy = runtime.draft(40, SamplingParams(), DrawnSampler(0)).tokens[0].tolist()
    return tokens, runtime.last_logits().copy(), greedy


class Pipeline:
    """Stages run one after another in this process, each with its own book."""

    def __init__(self, splits, prompt: list[int]) -> None:
        self.stages = [StageRuntime(TARGET, a, b, max_context=512) for a, b in splits]
        data = np.asarray(prompt, np.int64)
        for stage in self.stages:
            data = stage.prefill(data)
        self.prefill_logits = data[-1]
        self.books: list[StageBook] = []

    def start(self, root: int) -> None:
        self.books = [StageBook(stage.filled, root) for stage in self.stages]

    def run(self, segment) -> tuple[list[int], np.ndarray]:
        ids, data = segment.ids, np.asarray(segment.tokens, np.int64)
        parents, positions = segment.parents, np.asarray(segment.positions, np.int64)
        for stage, book in zip(self.stages, self.books, strict=True):
            admission = book.admit(ids, parents, segment.epoch)
            keep = admission.keep
            ids = [ids[i] for i in keep]
            parents = [parents[i] for i in keep]
            data, positions = data[keep], positions[keep]
            if not ids:
                return [], np.zeros((0,))
            committed = book.committed
            data = stage.admit(admission, data, positions, committed)
        return ids, data

    def commit(self, accepted: list[int], root: int) -> None:
        for stage, book in zip(self.stages, self.books, strict=True):
            stage.compact(book.commit(accepted, root))


def test_a_stage_refuses_a_layer_range_the_model_does_not_have() -> None:
    with pytest.raises(ModelLoadError, match="not a range"):
        StageRuntime(TARGET, 2, 9)
    with pytest.raises(ModelLoadError, match="half layer"):
        StageRuntime(TARGET, 0, 1.25)


def test_a_stage_loads_only_its_own_layers() -> None:
    middle = StageRuntime(TARGET, 1, 3)
    loaded = {n for n, p in middle.model.named_parameters() if not p.is_meta}
    assert loaded
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in loaded)


def test_a_stage_ending_on_a_half_layer_loads_and_caches_only_its_halves() -> None:
    """1.5:3.5 is layer 1's MLP, layer 2, and layer 3's attention: two layers' KV cache."""
    stage = StageRuntime(TARGET, 1.5, 3.5, max_context=64)
    loaded = {n for n, p in stage.model.named_parameters() if not p.is_meta}
    parts = {".".join(n.split(".")[2:4]) for n in loaded}
    assert parts == {
        "1.post_attention_layernorm",
        "1.mlp",
        "2.input_layernorm",
        "2.self_attn",
        "2.post_attention_layernorm",
        "2.mlp",
        "3.input_layernorm",
        "3.self_attn",
    }
    assert stage._keys.shape[0] == 2
    assert not stage.first
    assert not stage.last


@pytest.mark.parametrize("stages", [2, 3, "halves"])
def test_split_stages_prefill_as_the_whole_model_does(whole, stages) -> None:
    prompt, logits, _ = whole
    pipeline = Pipeline(SPLITS[stages], prompt)
    np.testing.assert_allclose(pipeline.prefill_logits, logits, atol=1e-4)


@pytest.mark.parametrize("stages", [2, 3, "halves"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pipelined_tree_verification_returns_the_targets_greedy_text(whole, stages, seed):
    """Segments of a drafted tree (right about 60% of the time, with wrong siblings) are
    verified through the stages, several in flight before their outputs are used."""
    prompt, _, greedy = whole
    rng = random.Random(seed)
    pipeline = Pipeline(SPLITS[stages], prompt)
    first = int(np.argmax(pipeline.prefill_logits))
    tree = FlowTree(first, len(prompt))
    pipeline.start(tree.root)
    final, flight = [first], []
    while len(final) < len(greedy):
        for leaf in [i for i, n in tree.nodes.items() if not n.children][:2]:
            path = final[: len(final) - 1] + tree.path_to(leaf)
            right = greedy[len(path)] if len(path) < len(greedy) else 0
            guess = right if rng.random() < 0.6 else int(rng.randrange(4096))
            tree.add(leaf, guess, rng.random())
            tree.add(leaf, (guess + 1) % 4096, 0.01)
        if (segment := tree.segment(3)) is not None:
            flight.append(pipeline.run(segment))
        if len(flight) >= len(SPLITS[stages]) or segment is None:
            ids, logits = flight.pop(0)
            choices = {i: int(np.argmax(row)) for i, row in zip(ids, logits, strict=True)}
            if (advance := tree.deliver(choices)) is not None:
                pipeline.commit(advance.accepted, advance.root)
                final += advance.final_tokens
    assert final[: len(greedy)] == greedy


def test_gemma_stages_split_the_sandwich_norms_with_their_halves(tmp_path) -> None:
    """A Gemma layer's post_attention_layernorm closes its attention half (a Llama layer's
    opens its MLP half); split on half layers, the stages still compute the whole model."""
    folder = save_reference(build_reference("gemma3"), tmp_path / "gemma3")
    prompt = np.asarray([1, 17, 42, 5, 88, 23, 9, 61, 2, 70, 33, 14], np.int64)
    whole = TorchRuntime(folder, device="cpu", dtype="float32", max_context=64)
    expected = whole.forward_tree(prompt.tolist(), chain_parents(len(prompt))).logits.numpy()
    stages = [StageRuntime(folder, a, b, max_context=64) for a, b in [(0, 1.5), (1.5, 3)]]
    first = {
        ".".join(n.split(".")[2:4])
        for n, p in stages[0].model.named_parameters()
        if not p.is_meta and n.startswith("model.layers.1.")
    }
    assert first == {"1.input_layernorm", "1.self_attn", "1.post_attention_layernorm"}
    data = prompt
    for stage in stages:
        data = stage.prefill(data)
    np.testing.assert_allclose(data, expected, atol=1e-4)
