"""Tree verification: greedy follows the target exactly; sampling is lossless (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.verify.distributions import distribution
from hetspec.speculative.verify.samplers import KeyedSampler
from hetspec.speculative.verify.tree import depths, is_path
from hetspec.speculative.verify.verdicts import (
    RowsOnDemand,
    _walk,
    verify_greedy,
    verify_keyed,
    verify_sampled,
    verify_sampling,
)

# chi-square critical values at p = 0.001 (no scipy here): a correct sampler fails 1 in 1000
CHI2_CRITICAL_0001 = {4: 18.467, 24: 51.179}


@st.composite
def trees_with_logits(draw, vocab: int = 4):
    n = draw(st.integers(1, 12))
    parents = np.array([draw(st.integers(-1, i - 1)) for i in range(n)])
    tokens = np.array([draw(st.integers(0, vocab - 1)) for _ in range(n)])
    seed = draw(st.integers(0, 2**32 - 1))
    logits = np.random.default_rng(seed).normal(size=(n + 1, vocab))
    return tokens, parents, logits


@settings(max_examples=300, deadline=None)
@given(trees_with_logits())
def test_greedy_takes_exactly_the_targets_argmax_path(case) -> None:
    tokens, parents, logits = case
    verdict = verify_greedy(tokens, parents, logits)
    assert is_path(verdict.path, parents)
    row = 0
    for node in verdict.path:
        assert tokens[node] == logits[row].argmax()
        row = node + 1
    assert verdict.bonus == logits[row].argmax()
    end = verdict.path[-1] if verdict.path else -1
    assert not any(tokens[c] == verdict.bonus for c in np.flatnonzero(parents == end))
    # a verifier that sends each row's argmax alone gets the same verdict
    assert verify_greedy(tokens, parents, logits.argmax(-1)) == verdict


@settings(max_examples=200, deadline=None)
@given(trees_with_logits(vocab=5), st.integers(0, 2**63 - 1), st.integers(0, 10_000))
def test_keyed_verification_takes_the_targets_keyed_choice_at_each_position(
    case, seed: int, position: int
) -> None:
    """Each emitted token is the keyed choice of the target's row at that token's position,
    which is what the target alone, choosing one token at a time, would have emitted."""
    tokens, parents, logits = case
    rows = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    verdict = verify_keyed(tokens, parents, rows, KeyedSampler(seed), position)
    alone = KeyedSampler(seed)  # a fresh one: the choices depend on (seed, position) only
    node_depths = depths(np.asarray(parents))
    assert is_path(verdict.path, parents)
    row = 0
    for depth, node in enumerate(verdict.path):
        assert node_depths[node] == depth
        assert tokens[node] == alone.choose(rows[row], position + depth)[0]
        row = node + 1
    assert verdict.bonus == alone.choose(rows[row], position + len(verdict.path))[0]


def _normalized(rng: np.random.Generator, shape) -> np.ndarray:
    raw = rng.random(shape) ** 2 + 0.02
    return raw / raw.sum(-1, keepdims=True)


@pytest.mark.parametrize("branches", [1, 3])
def test_sampled_tokens_follow_the_target_distribution(branches: int) -> None:
    """Two emitted tokens, drafted from a very different distribution, in ``branches``
    independent branches of depth 2: their joint law must be the target's."""
    vocab, trials = 5, 20000
    rng = np.random.default_rng(1234 + branches)
    p_first, p_second = _normalized(rng, vocab), _normalized(rng, (vocab, vocab))
    q_first, q_second = _normalized(rng, vocab), _normalized(rng, (vocab, vocab))
    p_third = np.full(vocab, 1 / vocab)
    counts = np.zeros((vocab, vocab))
    for _ in range(trials):
        firsts = rng.choice(vocab, size=branches, p=q_first)
        seconds = [rng.choice(vocab, p=q_second[x]) for x in firsts]
        tokens = np.array([*firsts, *seconds])
        parents = np.array([-1] * branches + list(range(branches)))
        draft = np.array([q_first] * branches + [q_second[x] for x in firsts])
        target = np.array([p_first, *(p_second[x] for x in firsts), *[p_third] * branches])
        emitted = verify_sampling(tokens, parents, draft, target, rng).tokens(tokens)
        if len(emitted) == 1:  # the next round would draw the second token from the target
            emitted.append(rng.choice(vocab, p=p_second[emitted[0]]))
        counts[emitted[0], emitted[1]] += 1
    expected = trials * p_first[:, None] * p_second
    joint = ((counts - expected) ** 2 / expected).sum()
    first = counts.sum(1)
    marginal = ((first - trials * p_first) ** 2 / (trials * p_first)).sum()
    assert marginal < CHI2_CRITICAL_0001[4], marginal
    assert joint < CHI2_CRITICAL_0001[24], joint


def test_drafts_from_the_target_itself_are_always_accepted() -> None:
    rng = np.random.default_rng(0)
    p = _normalized(rng, (4, 6))
    tokens, parents = np.array([2, 3, 1]), np.array([-1, 0, 1])
    verdict = verify_sampling(tokens, parents, p[:3], p, rng)
    assert verdict.path == [0, 1, 2]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=10), st.lists(st.integers(0, 3), min_size=11, max_size=11)
)
def test_a_chain_against_choices_is_the_tree_walks_verdict(tokens, choices) -> None:
    """The one-branch shortcut (plain Python) agrees with the general walk, from lists and
    from arrays."""
    parents = list(range(-1, len(tokens) - 1))
    rows = np.array(choices[: len(tokens) + 1])
    walked = _walk(tokens, parents, rows, lambda row: int(rows[row]))
    assert verify_greedy(tokens, parents, rows) == walked
    assert verify_greedy(np.array(tokens, int), np.array(parents, int), rows) == walked
    assert all(isinstance(node, int) for node in walked.path)


def test_mismatched_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="2 nodes need 3 target rows"):
        verify_greedy([1, 2], [-1, 0], np.zeros((2, 4)))
    with pytest.raises(ValueError, match="2 nodes need 3 target rows"):
        verify_greedy([1, 2], [-1, 0], np.zeros(2, int))  # choices: the chain's shortcut
    with pytest.raises(ValueError, match="2 nodes need 2 draft rows"):
        verify_sampling(
            [1, 2], [-1, 0], np.zeros((1, 4)), np.zeros((3, 4)), np.random.default_rng()
        )


class CountedRows:
    """Logit rows that note which were read (a verifier's rows, brought to the CPU one by one)."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits, self.shape, self.read = logits, logits.shape, []

    def __getitem__(self, row: int) -> np.ndarray:
        self.read.append(row)
        return self.logits[row]


@settings(max_examples=200, deadline=None)
@given(trees_with_logits(vocab=6), st.booleans(), st.integers(0, 2**32 - 1))
def test_a_sampled_verdict_from_rows_read_on_demand_is_the_one_from_all_rows(
    case, keyed: bool, seed: int
) -> None:
    """What a verifier walking in its own process decides (rows read as the walk reaches
    them, the draft's rows in place through ``RowsOnDemand``) is the daemon's verdict over every
    row: the same path, the same bonus, and no row read that the walk did not reach."""
    tokens, parents, logits = case
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.95)
    rng = np.random.default_rng(seed)
    drafted = distribution(rng.normal(size=(2 * len(tokens), logits.shape[1])), params)
    where = rng.permutation(len(drafted))[: len(tokens)]
    options = {"keyed": KeyedSampler(seed)} if keyed else {}
    whole = verify_sampled(
        tokens,
        parents,
        logits,
        params,
        position=40,
        rng=np.random.default_rng(seed),
        draft=drafted[where],
        **options,
    )
    rows = CountedRows(logits)
    in_place = RowsOnDemand.at(drafted, list(where))
    walked = verify_sampled(
        tokens,
        parents,
        rows,
        params,
        position=40,
        rng=np.random.default_rng(seed),
        draft=in_place,
        **options,
    )
    assert (walked.path, walked.bonus) == (whole.path, whole.bonus)
    assert sorted(set(rows.read)) == sorted({0, *(node + 1 for node in walked.path)})


def test_a_drawn_verdict_needs_its_draft_and_generator() -> None:
    logits = np.zeros((2, 4))
    with pytest.raises(ValueError, match="generator and the draft"):
        verify_sampled([1], [-1], logits, SamplingParams(temperature=1.0), position=3)
