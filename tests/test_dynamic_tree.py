"""EAGLE-2's ranking of drafted nodes and the choice of how many to verify (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetspec.speculative.drafting.dynamic_tree import (
    Calibration,
    FirstChoice,
    best_width,
    child_scores,
    first_choice_offers,
    rank_nodes,
    within_leaves,
)
from hetspec.speculative.verify.tree import path_to


def test_ranking_keeps_the_likeliest_nodes_as_a_tree() -> None:
    # root children 0 (p .6) and 1 (.3); 0's children 2 (.6 * .9) and 3 (.6 * .05); 1's child 4
    parents = [-1, -1, 0, 0, 1]
    probabilities = [0.6, 0.3, 0.54, 0.03, 0.3]  # 4 ties with its parent 1 (p = 1 below it)
    depths = [0, 0, 1, 1, 1]
    order, ranked = rank_nodes(parents, np.log(probabilities), depths, 4)
    assert order.tolist() == [0, 2, 1, 4]  # the tie: the parent (shallower) first
    assert ranked.tolist() == [-1, 0, -1, 2]
    for size in range(1, 6):  # every prefix is a tree
        order, ranked = rank_nodes(parents, np.log(probabilities), depths, size)
        assert all(parent < index for index, parent in enumerate(ranked.tolist()))
        for index in range(size):
            path = [order[node] for node in path_to(index, ranked)]
            assert path == path_to(int(order[index]), np.array(parents))


def test_ranking_refuses_scores_that_rise_below_a_parent() -> None:
    with pytest.raises(ValueError, match="ranks above its parent"):
        rank_nodes([-1, 0], [math.log(0.2), math.log(0.9)], [0, 1], 1)


def test_the_width_is_the_one_that_commits_most_per_second() -> None:
    probabilities = [0.9, 0.8, 0.5, 0.1, 0.05]
    flat = best_width(probabilities, 1.0, lambda width: 0.010)
    assert flat == 5  # a flat cost: every node adds expected tokens for nothing
    steep = best_width(probabilities, 1.0, lambda width: 0.010 * width)
    # (1 + .9) / .02 = 95, (1 + 1.7) / .03 = 90: one node
    assert steep == 1
    # a calibration of 2 (the scores understate acceptance) makes the second node pay
    assert best_width(probabilities, 2.0, lambda width: 0.010 * width) == 2
    unknown = best_width(probabilities, 1.0, lambda width: None if width > 3 else 0.01)
    assert unknown == 2
    assert best_width(probabilities, 1.0, lambda width: None) == len(probabilities)


def test_calibration_moves_from_its_prior_to_what_rounds_accept() -> None:
    calibration = Calibration(prior=1.0)
    assert calibration.factor == 1.0
    for _ in range(30):
        calibration.observe(expected=2.0, accepted=1)
    assert calibration.factor == pytest.approx(0.5, abs=0.01)


def test_a_prefix_keeps_within_the_verifiers_leaves() -> None:
    # 0 and 1 below the root (2 leaves), 2 below leaf 0 (still 2), 3 below inner 0 (3), 4 below 2
    parents = [-1, -1, 0, 0, 2]
    assert within_leaves(parents, None) == 5
    assert within_leaves(parents, 3) == 5
    assert within_leaves(parents, 2) == 3
    assert within_leaves(parents, 1) == 1


def test_children_score_by_the_draft_or_by_the_first_choices_acceptance() -> None:
    row = np.array([0.1, 0.6, 0.25, 0.05])
    chosen = [1, 2, 0]
    np.testing.assert_allclose(child_scores(row, chosen, None), np.log([0.6, 0.25, 0.1]))
    # first choices accepted 80% of the time: the rest, 20%, shared as the draft shares 0.4
    scores = child_scores(row, chosen, 0.8)
    np.testing.assert_allclose(np.exp(scores), [0.8, 0.2 * 0.25 / 0.4, 0.2 * 0.1 / 0.4])
    assert np.all(child_scores(np.array([0.0, 1.0]), [1, 0], 0.5) <= 0)  # never above 1


def test_first_choice_acceptance_is_learned_along_the_accepted_path() -> None:
    # root's children 0 (first) and 1; 0's children 2 (first) and 3; 2's child 4
    parents = [-1, -1, 0, 0, 2]
    learner = FirstChoice(prior=0.5, decay=1.0)
    for _ in range(10):
        learner.observe(
            first_choice_offers(parents, [0, 3])
        )  # first taken, then the second child: 1 of 2 offers
    assert learner.rate == pytest.approx(0.5)
    for _ in range(40):
        learner.observe(first_choice_offers(parents, [0, 2, 4]))  # three offers, all taken
    assert learner.rate == pytest.approx((10 + 120) / (20 + 120))
    learner.observe(
        first_choice_offers(parents, [])
    )  # the root's first child refused: one offer, not taken
    assert learner.rate < (10 + 120) / (20 + 120)
