"""Token trees and sampling distributions: the pure pieces both runtimes rely on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetspec.speculative.drafting.branching import branch_length, uncertainty_branches
from hetspec.speculative.drafting.vocab_match import incompatibilities, vocab_info
from hetspec.speculative.verify.distributions import (
    SamplingError,
    SamplingParams,
    distribution,
    keep_nucleus,
    kth_largest,
    softmax,
    top_tokens,
)
from hetspec.speculative.verify.samplers import DrawnSampler, pick
from hetspec.speculative.verify.tree import (
    TreeError,
    ancestor_mask,
    chain_parents,
    depths,
    is_path,
    path_to,
    validate_parents,
)


@st.composite
def trees(draw, max_nodes: int = 24) -> np.ndarray:
    n = draw(st.integers(1, max_nodes))
    return np.array([draw(st.integers(-1, i - 1)) for i in range(n)], dtype=np.int64)


@given(trees())
def test_mask_depth_and_paths_agree(parents: np.ndarray) -> None:
    mask = ancestor_mask(validate_parents(parents))
    node_depths = depths(parents)
    for node in range(len(parents)):
        path = path_to(node, parents)
        assert path[-1] == node
        assert is_path(path, parents)
        assert node_depths[node] == len(path) - 1
        assert np.flatnonzero(mask[node]).tolist() == sorted(path)


@given(trees(), st.integers(0, 24))
def test_extending_a_tree_equals_building_it_whole(parents: np.ndarray, cut: int) -> None:
    cut = min(cut, len(parents))
    old, new = parents[:cut], parents[cut:]
    old_mask = ancestor_mask(old)
    extended = ancestor_mask(validate_parents(new, existing=cut), old_mask)
    np.testing.assert_array_equal(extended, ancestor_mask(parents)[cut:])
    np.testing.assert_array_equal(depths(new, depths(old)), depths(parents)[cut:])


def test_chains_and_branches_are_trees() -> None:
    assert chain_parents(4).tolist() == [-1, 0, 1, 2]
    assert chain_parents(3, existing=5, below=2).tolist() == [2, 5, 6]
    assert chain_parents(0).tolist() == []
    branches = np.array([-1, -1, -1])
    assert ancestor_mask(branches).tolist() == np.eye(3, dtype=bool).tolist()
    assert not is_path([0, 1], branches)
    assert is_path([], branches)


@pytest.mark.parametrize("parents", [[0], [-2], [-1, 1], [-1, 0, 3]])
def test_bad_parents_are_rejected(parents: list[int]) -> None:
    with pytest.raises(TreeError, match="a parent must be -1"):
        validate_parents(parents)


logit_rows = st.lists(
    st.floats(-30, 30, allow_nan=False, allow_subnormal=False), min_size=2, max_size=40
).map(lambda row: np.array(row, dtype=np.float32))


@given(
    logit_rows,
    st.floats(0.05, 3),
    st.integers(0, 50),
    st.floats(0.01, 1.0),
)
def test_warped_rows_are_distributions_respecting_top_k_and_top_p(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = distribution(logits, params)
    assert probs.dtype == np.float32
    assert abs(probs.sum() - 1) < 1e-5
    plain = distribution(logits, SamplingParams(temperature=temperature, top_k=top_k))
    assert probs[plain.argmax()] > 0  # the most likely token always survives top-p
    kept = probs > 0
    if 0 < top_k < len(logits):
        threshold = np.sort(logits)[-top_k]
        assert not kept[logits < threshold].any()
    # top-p keeps the smallest set of the most likely tokens reaching mass top_p
    order = np.argsort(-plain, kind="stable")
    mass_before = np.cumsum(plain[order]) - plain[order]
    assert kept[order[mass_before < top_p - 1e-6]].all()


def nucleus_by_full_sort(row: np.ndarray, top_p: float) -> np.ndarray:
    """keep_nucleus's contract, by a stable sort of the whole row."""
    order = np.argsort(-row, kind="stable")
    before = np.concatenate(([0.0], np.cumsum(row[order], dtype=np.float64)[:-1]))
    out = np.zeros_like(row)
    out[order[before < top_p]] = row[order[before < top_p]]
    return out / out.sum()


@pytest.mark.parametrize("vocab", [50, 4096, 151_936])
@pytest.mark.parametrize("spread", [0.3, 3.0, 12.0])
def test_the_nucleus_from_few_candidates_is_the_full_sorts(vocab: int, spread: float) -> None:
    """Peaked and flat rows (a nucleus of one token, or of most of the vocabulary), ties
    included: the candidates' shortcut keeps exactly what a sort of the whole row keeps."""
    rng = np.random.default_rng(vocab + int(spread))
    logits = (rng.standard_normal((3, vocab)) * spread).astype(np.float32)
    logits[:, ::7] = logits[:, :1]  # ties with each row's first entry
    for top_p in (0.01, 0.5, 0.9, 0.95, 0.999, 1 - 1e-9):
        rows = softmax(logits)
        for row in rows:
            expected = nucleus_by_full_sort(row.copy(), top_p)
            keep_nucleus(row, top_p)
            np.testing.assert_array_equal(row, expected)


@pytest.mark.parametrize("vocab", [50, 151_936])
@pytest.mark.parametrize("spread", [0.01, 1.0, 30.0])
def test_the_kth_largest_from_the_top_entries_is_the_partitions(vocab: int, spread: float) -> None:
    """Rows whose top k lie within every gap tried, or beyond them, with ties and -inf."""
    rng = np.random.default_rng(vocab + int(spread * 100))
    rows = (rng.standard_normal((4, vocab)) * spread).astype(np.float32)
    rows[:, ::5] = rows[:, :1]  # ties
    rows[1, ::3] = -np.inf
    for row in rows:
        for k in (1, 2, 40, vocab // 2, vocab - 1):
            assert kth_largest(row, k) == np.partition(row, vocab - k)[vocab - k]


def test_greedy_gives_the_plain_softmax_and_the_argmax() -> None:
    logits = np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]], np.float32)
    probs = distribution(logits, SamplingParams())
    expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, expected, rtol=1e-6)
    assert pick(probs, SamplingParams(), DrawnSampler(), 0).tolist() == [1, 2]


def test_draws_follow_the_distribution() -> None:
    probs = np.array([0.1, 0.0, 0.6, 0.3], np.float32)
    params = SamplingParams(temperature=1.0)
    draws = pick(np.tile(probs, (20000, 1)), params, DrawnSampler(3), 0)
    frequencies = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(frequencies, probs, atol=0.015)
    assert frequencies[1] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_out_of_range_sampling_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def _texts(n: int) -> list[bytes]:
    return [f"tok{i}".encode() for i in range(n)]


def test_vocabularies_ignore_padding_and_renamed_specials() -> None:
    base = vocab_info("bpe", _texts(300), bos=1, eos=2, add_bos=True)
    padded = vocab_info(
        "bpe", _texts(300) + [f"[PAD{i}]".encode() for i in range(300, 320)], 1, 2, True
    )
    renamed = _texts(300)
    renamed[3] = b"<unk>"
    assert (padded.size, padded.real_size) == (320, 300)
    assert incompatibilities(padded, base) == []
    assert incompatibilities(vocab_info("bpe", renamed, 1, 2, True), base) == []


def test_every_vocabulary_difference_is_named() -> None:
    target = vocab_info("bpe", _texts(300), bos=1, eos=2, add_bos=True)
    changed = _texts(300)
    changed[42] = b"other"
    draft = vocab_info("spm", changed + _texts(200), bos=1, eos=3, add_bos=False)
    problems = incompatibilities(draft, target)
    assert problems[:4] == [
        "tokenizer kinds differ (spm vs bpe)",
        "BOS/EOS ids differ (1/3 vs 1/2)",
        "add-BOS differs (False vs True)",
        "vocabulary sizes differ by more than 128 (500 vs 300)",
    ]
    assert problems[4].startswith("token texts differ (500 tokens, fingerprint ")
    assert len(problems) == 5


def test_uncertainty_branches_follow_duodecodings_threshold() -> None:
    sure = np.array([0.9, 0.05, 0.03, 0.02])
    assert uncertainty_branches(sure, 0.9, cap=4) == 1  # theta 0.81: only the top token
    unsure = np.array([0.35, 0.3, 0.2, 0.15])
    assert uncertainty_branches(unsure, 0.5, cap=4) == 3  # theta 0.175: three candidates
    assert uncertainty_branches(unsure, 0.5, cap=2) == 2
    assert uncertainty_branches(unsure, 0.5, cap=4, scale=0.0) == 4
    assert uncertainty_branches(unsure, 0.5, cap=4, scale=10.0) == 1  # never below one
    assert [branch_length(8, k) for k in (1, 2, 3, 4, 9)] == [8, 4, 2, 2, 1]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.data())
def test_top_tokens_is_the_stable_descending_order(values, data):
    """Ties included (few distinct values), the prefix of a stable descending argsort."""
    row = np.array(values, np.float32)
    count = data.draw(st.integers(1, len(values)))
    expected = np.argsort(-row, kind="stable")[:count]
    assert top_tokens(row, count).tolist() == expected.tolist()
