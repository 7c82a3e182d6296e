"""Where sampled tokens' randomness comes from: draws in order, or noise keyed by position."""

from __future__ import annotations

import numpy as np
import pytest

from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import (
    DrawnSampler,
    KeyedSampler,
    PhiloxNoise,
    sampler_for,
)

PROBS = np.array([0.1, 0.0, 0.5, 0.3, 0.1])
CHI2_CRITICAL_0001_DF3 = 16.266  # 4 possible tokens: P(chi2 > this) = 0.001 under the law


def fits_the_law(draws: np.ndarray) -> bool:
    counts = np.bincount(draws, minlength=len(PROBS))
    expected = PROBS * len(draws)
    support = PROBS > 0
    chi2 = (((counts - expected)[support]) ** 2 / expected[support]).sum()
    return counts[~support].sum() == 0 and chi2 < CHI2_CRITICAL_0001_DF3


def test_keyed_noise_depends_on_the_seed_and_position_alone() -> None:
    first = PhiloxNoise(7)(12, 4096)
    assert np.array_equal(first, PhiloxNoise(7)(12, 4096))  # any process, any call
    assert not np.array_equal(first, PhiloxNoise(7)(13, 4096))
    assert not np.array_equal(first, PhiloxNoise(8)(12, 4096))
    assert np.array_equal(PhiloxNoise(7)(12, 4001), first[:4001])  # a drafter's shorter table
    assert (first > 0).all()  # exponential: never 0, which would make a score infinite
    # positions own disjoint counter ranges: a long row does not run into the next position
    assert not np.isin(PhiloxNoise(7)(13, 8), PhiloxNoise(7)(12, 100_000)).any()
    # a sampler's cache returns what a fresh derivation gives, in any order of positions
    sampler = KeyedSampler(7)
    for position in [5, 12, 5, 300, 12]:
        assert np.array_equal(sampler.noise(position, 4096), PhiloxNoise(7)(position, 4096))


def test_a_keyed_choice_is_the_same_whatever_was_chosen_before() -> None:
    rows = np.tile(PROBS, (3, 1))
    one, other = KeyedSampler(3), KeyedSampler(3)
    other.choose(rows, 40)  # draws elsewhere leave position 41 alone
    other.candidates(PROBS, 2, 3)
    assert one.choose(rows, 41).tolist() == other.choose(rows, 41).tolist()
    assert len(set(one.choose(rows, 41).tolist())) == 1  # same row, same position: same token


def test_keyed_choices_follow_the_distribution_over_positions() -> None:
    """Gumbel-max: over positions (independent noise), the choices are exact samples."""
    sampler = KeyedSampler(11)
    draws = np.array([sampler.choose(PROBS[None], t)[0] for t in range(20_000)])
    assert fits_the_law(draws)  # and a token of probability 0 is never chosen


def test_keyed_candidates_are_the_choice_then_the_runners_up() -> None:
    sampler = KeyedSampler(5)
    for position in range(50):
        candidates = sampler.candidates(PROBS, position, 3)
        assert candidates[0] == sampler.choose(PROBS[None], position)[0]
        assert len(set(candidates.tolist())) == 3
        assert 1 not in candidates  # probability 0: never proposed while others remain
        scores = sampler.scores(PROBS, position)[0]
        assert list(scores[candidates]) == sorted(scores[candidates], reverse=True)


def test_drawn_candidates_are_independent_draws() -> None:
    sampler = DrawnSampler(0)
    draws = np.concatenate([sampler.candidates(PROBS, 0, 4) for _ in range(5000)])
    assert fits_the_law(draws)
    assert any(len(set(sampler.candidates(PROBS, 0, 4).tolist())) < 4 for _ in range(50))


def test_a_seed_keys_by_position_and_no_seed_draws_in_order() -> None:
    assert isinstance(sampler_for(None), DrawnSampler)
    keyed = sampler_for(2**63 - 1)
    assert isinstance(keyed, KeyedSampler)
    with pytest.raises(ValueError, match="seed"):
        KeyedSampler(-1)


def test_a_tokens_logprob_is_the_log_softmax_with_the_top_in_order() -> None:
    """The model's own distribution (no temperature or truncation), to 1e-6 even for logits
    far from 0; alternatives most likely first, ties by id, at most the vocabulary."""
    logits = np.array([1000.0, 1002.0, 1002.0, 999.5], dtype=np.float32)
    shifted = logits.astype(np.float64) - 1002.0
    expected = shifted - np.log(np.exp(shifted).sum())
    entry = token_logprob(logits, 0, top=3)
    assert entry.token == 0
    assert entry.logprob == pytest.approx(expected[0], abs=1e-6)
    assert [token for token, _ in entry.top] == [1, 2, 0]
    assert [value for _, value in entry.top] == pytest.approx(expected[[1, 2, 0]], abs=1e-6)
    assert np.exp([value for _, value in token_logprob(logits, 3, top=9).top]).sum() == (
        pytest.approx(1.0)
    )
    assert token_logprob(logits, 3).top == []
