"""Dovetail's draft head: the runtime, the verifiers' features, the choice of head, the daemon."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hetspec.daemon.config import DaemonConfig, ModelPaths
from hetspec.daemon.load.head_choice import BUNDLED_HEAD, HeadChoiceError, draft_head_for, mismatch
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime
from hetspec.workers.runtimes.torch_runtime import ModelConfig, ModelLoadError, TorchRuntime
from hetspec.workers.runtimes.torch_runtime.draft_head import DraftHead, HeadConfig
from hetspec.workers.runtimes.torch_runtime.head_runtime import HeadRuntime
from hetspec.workers.runtimes.torch_runtime.model import rope_tables
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET = MODELS / "target"
PROMPT = "def read_config(path):\n    with open(path) as file:\n        return json.load(file)\n"
SHAPES = [("dgf", 2), ("concat", 1), ("dgf", 0)]


def write_head(folder: Path, fusion: str, blocks: int, seed: int = 0) -> Path:
    """A randomly initialised head for the bundled target: the mechanics need no training."""
    target = ModelConfig.from_folder(TARGET)
    config = HeadConfig(
        feature_size=target.hidden_size,
        width=target.hidden_size,
        vocab_size=target.vocab_size,
        blocks=blocks,
        fusion=fusion,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        intermediate_size=target.intermediate_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope.theta,
        max_context=target.max_context,
        vocab_fingerprint=FolderTokenizer(TARGET, target.vocab_size).vocab_info().fingerprint,
    )
    torch.manual_seed(seed)
    head = DraftHead(config)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: p.detach().contiguous() for n, p in head.named_parameters()},
        str(folder / "model.safetensors"),
    )
    config.save(folder)
    return folder


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[tuple[str, int], Path]:
    root = tmp_path_factory.mktemp("heads")
    return {shape: write_head(root / f"{shape[0]}-{shape[1]}", *shape) for shape in SHAPES}


@pytest.fixture(scope="module")
def target() -> TorchRuntime:
    return TorchRuntime(TARGET, dtype="float32", threads=1)


def prompt_features(target: TorchRuntime, tokens: list[int]) -> np.ndarray:
    target.rollback(0)  # a prefill reports only what it evaluates: no reused prefix
    with target.features_captured() as sink:
        target.prefill(tokens)
    return np.concatenate(sink)


def head_runtime(folder: Path) -> HeadRuntime:
    return HeadRuntime(folder, target=TARGET, dtype="float32", threads=1)


# ------------------------------------------------------------------ the head's runtime


@pytest.mark.parametrize("shape", SHAPES)
def test_the_runtime_evaluates_a_prompt_as_training_does(heads, target, shape) -> None:
    """Prefilled with the target's features, every position's draft logits are the
    training forward's (whole sequences, features shifted by one, zeros before the first)."""
    runtime = head_runtime(heads[shape])
    tokens = runtime.tokenize(PROMPT)
    features = prompt_features(target, tokens)
    runtime.prefill(tokens[:1], features=features, start=0)
    chain = runtime.evaluate_tree(tokens[1:], list(range(-1, len(tokens) - 2)))
    runtime.prefill(tokens, features=features, start=0)
    head, pieces = runtime.model, runtime.pieces
    inputs = torch.nn.functional.pad(torch.from_numpy(features)[None, :-1], (0, 0, 1, 0))
    cos, sin = rope_tables(runtime.config, len(tokens), torch.device("cpu"))
    with torch.no_grad():
        out = head.sequences(inputs, pieces.embed(torch.tensor([tokens])), cos, sin)
        reference = pieces.logits(pieces.feature(out))[0].numpy()
    np.testing.assert_allclose(runtime.last_logits(), reference[-1], atol=1e-4)
    # drafted nodes read their parent's prediction, not the target's feature
    assert np.abs(chain[1:] - reference[2:]).max() > 1e-2


def test_appending_with_features_equals_prefilling_them(heads, target) -> None:
    runtime = head_runtime(heads[("dgf", 2)])
    tokens = runtime.tokenize(PROMPT)
    features = prompt_features(target, tokens)
    runtime.prefill(tokens, features=features, start=0)
    whole = runtime.last_logits().copy()
    runtime.rollback(0)
    runtime.prefill(tokens[:10], features=features[:10], start=0)
    runtime.draft(3, SamplingParams(), DrawnSampler(0))  # pending nodes, dropped by the append
    runtime.append_after_features(tokens[10:], features[9:-1])
    np.testing.assert_allclose(runtime.last_logits(), whole, atol=1e-5)


def test_without_features_the_head_reads_its_own_predictions(heads) -> None:
    runtime = head_runtime(heads[("dgf", 2)])
    tokens = runtime.tokenize(PROMPT)[:12]
    runtime.prefill(tokens)
    batched = runtime.last_logits().copy()
    runtime.rollback(0)
    runtime.prefill(tokens[:1])
    for token in tokens[1:]:
        runtime.append([token])
    np.testing.assert_allclose(runtime.last_logits(), batched, atol=1e-5)


def test_a_tree_node_drafts_as_its_path_alone(heads, target) -> None:
    runtime = head_runtime(heads[("dgf", 2)])
    tokens = runtime.tokenize(PROMPT)
    runtime.prefill(tokens[:20], features=prompt_features(target, tokens[:20]), start=0)
    a, b, c = tokens[20:23]
    tree = runtime.evaluate_tree([a, b, c, c], [-1, 0, 0, 2])
    path = runtime.evaluate_tree([a, c, c], [-1, 0, 1])
    np.testing.assert_allclose(tree[[0, 2, 3]], path, atol=1e-4)


def test_drafting_runs_ahead_below_a_pending_node(heads, target) -> None:
    runtime = head_runtime(heads[("dgf", 2)])
    tokens = runtime.tokenize(PROMPT)
    runtime.prefill(tokens, features=prompt_features(target, tokens), start=0)
    first = runtime.draft(3, SamplingParams(), DrawnSampler(0))
    ahead = runtime.draft(
        2,
        SamplingParams(),
        DrawnSampler(0),
        after=(int(first.nodes[0, 1]), int(first.tokens[0, 2])),
    )
    assert ahead.tokens.shape == (1, 2)
    assert runtime.pending == 3 + 1


def test_a_head_for_another_target_is_refused(heads, tmp_path) -> None:
    wider = ModelConfig.from_folder(TARGET)
    folder = tmp_path / "wide-target"
    folder.mkdir()
    raw = json.loads((TARGET / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "hidden_size": 512}))
    problem = mismatch(heads[("dgf", 2)], folder)
    assert problem is not None
    assert "256-wide features" in problem
    assert "512" in problem
    assert mismatch(heads[("dgf", 2)], TARGET) is None
    assert "not a draft head" in mismatch(TARGET, TARGET)
    with pytest.raises(ModelLoadError, match="not a directory"):
        HeadRuntime(heads[("dgf", 2)], target=tmp_path / "absent")
    config = json.loads((heads[("dgf", 2)] / "head_config.json").read_text())
    other = tmp_path / "other-vocab"
    other.mkdir()
    for name in ("model.safetensors",):
        (other / name).write_bytes((heads[("dgf", 2)] / name).read_bytes())
    (other / "head_config.json").write_text(json.dumps({**config, "vocab_fingerprint": "x"}))
    with pytest.raises(ModelLoadError, match="another vocabulary"):
        head_runtime(other)
    assert wider.hidden_size == 256


# ------------------------------------------------------------------ which head drafts


def config_with(**changes) -> DaemonConfig:
    base = msgspec.structs.replace(DaemonConfig(), placement="draft-gpu")
    return msgspec.structs.replace(base, **changes)


@pytest.mark.skipif(not (BUNDLED_HEAD / "head_config.json").exists(), reason="no bundled head")
def test_the_bundled_head_drafts_for_the_bundled_target_by_default(tmp_path) -> None:
    assert draft_head_for(config_with()) == BUNDLED_HEAD
    assert draft_head_for(config_with(draft_head="none")) is None
    assert draft_head_for(config_with(placement="draft-cpu")) is None
    assert draft_head_for(config_with(gpu_runtime="llama.cpp")) is None  # no head runs there
    folder = tmp_path / "target"
    folder.mkdir()
    raw = json.loads((TARGET / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "hidden_size": 512}))
    other = ModelPaths(folder=str(folder), gguf=str(TARGET / "target-q8_0.gguf"))
    assert draft_head_for(config_with(target=other)) is None  # auto: the draft model
    with pytest.raises(HeadChoiceError, match=r"draft_head: .*512"):
        draft_head_for(config_with(target=other, draft_head=str(BUNDLED_HEAD)))


# ------------------------------------------------------------------ the verifiers' features


def test_the_torch_verifier_reports_the_features_entering_its_lm_head(target) -> None:
    tokens = target.tokenize(PROMPT)[:16]
    target.prefill(tokens[:8])
    with target.features_captured() as sink:
        logits = target.evaluate_tree(tokens[8:], list(range(-1, 7)))
    features = np.concatenate(sink)
    lm_head = target.model.head_weight().detach().numpy()
    np.testing.assert_allclose(features @ lm_head.T, logits, atol=1e-4)


def test_llama_cpp_reports_the_same_features_and_logits_with_them() -> None:
    """Features from llama.cpp's per-token embeddings output are the torch target's (f16
    weights: within 1e-2), a tree's are its paths', and asking for them leaves a tree's
    logits exactly as they are without."""
    runtime = LlamaCppRuntime(
        TARGET / "target-f16.gguf", flash_attention="off", v_type="f32", threads=1
    )
    reference = TorchRuntime(TARGET, dtype="float32", threads=1)
    tokens = runtime.tokenize(PROMPT)[:24]
    runtime.prefill(tokens[:16])
    plain_first = runtime.last_logits().copy()
    plain = runtime.evaluate_tree([tokens[16], tokens[17], tokens[17]], [-1, 0, -1])
    runtime.rollback(0)
    with runtime.features_captured() as sink:
        runtime.prefill(tokens[:16])
        tree = runtime.evaluate_tree([tokens[16], tokens[17], tokens[17]], [-1, 0, -1])
    prefill_rows, tree_rows = sink[0], np.concatenate(sink[1:])
    assert prefill_rows.shape == (16, 256)
    assert tree_rows.shape == (3, 256)
    wanted = prompt_features(reference, tokens[:18])
    np.testing.assert_allclose(prefill_rows, wanted[:16], atol=1e-2)
    np.testing.assert_allclose(tree_rows[:2], wanted[16:18], atol=1e-2)
    np.testing.assert_array_equal(tree, plain)
    # a prefill's last row comes out of an LM head over every row instead of one: llama.cpp
    # rounds it a little differently (4e-6 here), far less than a tree's rows differ from
    # one token at a time
    np.testing.assert_allclose(runtime.last_logits(), plain_first, atol=1e-4)
    assert runtime.last_logits().argmax() == plain_first.argmax()
    runtime.close()


# ------------------------------------------------------------------ the daemon


@pytest.mark.process
@pytest.mark.skipif(not (BUNDLED_HEAD / "head_config.json").exists(), reason="no bundled head")
def test_draft_gpu_drafts_with_the_bundled_head_by_default(tmp_path) -> None:
    """The daemon's default draft-gpu drafts with the head (its device says so), and its
    chains of 4 are accepted about as far as the draft model's on held-out code (2.9 of 4
    each, measured: greedy continuations of code are easy for both). A head fed misplaced
    features keeps under one."""
    from test_lossless import BundledDaemon  # noqa: PLC0415

    from hetspec.bench.compare import prompt_set  # noqa: PLC0415

    prompts = prompt_set(3)[:3]
    accepted = {}
    for name, extra in (("head", ()), ("model", ("--set", 'draft_head="none"'))):
        (tmp_path / name).mkdir()
        daemon = BundledDaemon(tmp_path / name, "draft-gpu", *extra)
        try:
            total = rounds = 0
            for prompt in prompts:
                body = daemon.generate(
                    prompt, max_tokens=48, ignore_eos=True, mode="sequential", gamma=4
                )
                total += body["timings"]["draft_n_accepted"]
                rounds += body["speculative"]["rounds"]
                assert ("draft head" in body["devices"]["draft"]) == (name == "head")
            accepted[name] = total / rounds
        finally:
            daemon.stop()
    assert accepted["head"] >= 2.0, accepted
    assert accepted["head"] >= 0.8 * accepted["model"], accepted


def test_the_acceptance_bound_walks_continuations_in_chain_rounds() -> None:
    """models/acceptance_bound.py: a round keeps drafted nodes up to the first the target
    disagrees with, and the next round starts after the bonus token; the agreement a chain
    needs inverts its ceiling, and no chain keeps more than gamma."""
    from hetspec.models.acceptance_bound import ceiling, chain_kept, needed_agreement  # noqa: PLC0415

    agrees = np.ones(10, bool)
    agrees[2] = False
    # round 1 at 0 keeps 2 (node 3 at position 2 disagrees), round 2 at 3 keeps 4; 8 + 4 > 10
    assert chain_kept([agrees], 0, 10, 4) == (6, 2)
    own_features = [agrees, agrees, np.zeros(10, bool), agrees]  # each chain's third is wrong
    assert chain_kept(own_features, 0, 10, 4) == (6, 3)  # rounds at 0, 3 and 6 keep 2 each
    assert needed_agreement(ceiling(0.9, 8), 8) == pytest.approx(0.9)
    assert needed_agreement(4.2, 4) is None


def test_the_best_plain_round_weighs_what_a_chain_keeps_against_its_drafting() -> None:
    from hetspec.models.acceptance_bound import best_plain_round  # noqa: PLC0415

    kept = {1: 0.9, 2: 1.7, 4: 3.0, 8: 4.0}
    # a costly verification pays for long chains; a cheap one for short ones
    assert best_plain_round(kept, verify_ms=10.0, draft_ms=0.1, other_ms=0.0)[0] == 8
    gamma, rate = best_plain_round(kept, verify_ms=0.2, draft_ms=0.5, other_ms=0.1)
    assert gamma == 1
    assert rate == pytest.approx(1000 * 1.9 / 0.8)


def test_a_round_stopped_below_a_confidence_drafts_until_the_draft_is_unsure() -> None:
    """models/acceptance_bound.py --stop-below: a round drafts its first node whatever the
    confidence, then nodes while the draft's top probability stays at or above the threshold,
    at most ``most``; a round stopped early paid the forward of the node it did not draft."""
    from hetspec.models.acceptance_bound import confident_walk  # noqa: PLC0415

    agrees = np.ones(12, bool)
    agrees[5] = False
    confidence = np.full(12, 0.9)
    confidence[3] = 0.05
    # round 1 at 0: nodes 0-2, stopped before 3 (4 forwards), keeps 3; round 2 at 4: nodes
    # 4-7 (at most 4: no extra forward), keeps 1 (5 disagrees); 6 + 4 <= 12: round 3 at 6
    # drafts 6-9 and keeps 4; 11 + 4 > 12 ends the walk
    assert confident_walk(agrees, confidence, 0, 12, most=4, below=0.1) == (8, 3, 12)
    # a threshold nothing falls below drafts every round at its most, as a fixed gamma
    assert confident_walk(agrees, confidence, 0, 12, most=4, below=0.0) == (8, 3, 4 * 3)
