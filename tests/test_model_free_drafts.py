"""Drafters that need no draft model (prompt lookup, the continuation tree, the n-gram table):
what they propose is what the text itself followed, their trees are ranked trees, they are
incremental and stay bounded (no model, no process)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetspec.speculative.drafting.continuation_tree import ContinuationTree
from hetspec.speculative.drafting.model_free import Fallback, ModelFreeDrafter, TreeProposal
from hetspec.speculative.drafting.ngram_table import Followers, NgramTable
from hetspec.speculative.drafting.prompt_lookup import PromptLookup
from hetspec.speculative.verify.tree import ROOT, path_to, validate_parents

DRAFTERS: dict[str, Callable[[], ModelFreeDrafter]] = {
    "prompt_lookup": lambda: PromptLookup(max_order=3, min_order=1, max_depth=12, occurrences=4),
    "continuation_tree": lambda: ContinuationTree(max_order=3, max_depth=12, occurrences=4),
    "ngram_table": lambda: NgramTable(max_order=3, max_depth=12, followers=3),
    "fallback": lambda: Fallback(PromptLookup(max_order=3, max_depth=12), NgramTable(max_depth=12)),
}
each_drafter = pytest.mark.parametrize("make", DRAFTERS.values(), ids=DRAFTERS.keys())

# few distinct tokens: the text repeats itself often, as the drafters need
texts = st.lists(st.integers(0, 3), max_size=80)


def fed(make: Callable[[], ModelFreeDrafter], tokens: list[int]) -> ModelFreeDrafter:
    drafter = make()
    drafter.extend(tokens)
    return drafter


def paths(tree: TreeProposal) -> list[list[int]]:
    """Every node's tokens from the root down to it."""
    parents = validate_parents(tree.parents)
    return [
        [tree.tokens[node] for node in path_to(index, parents)] for index in range(len(parents))
    ]


def followed(text: list[int], ending: list[int], continuation: list[int]) -> bool:
    """Whether ``continuation`` follows an occurrence of ``ending`` in ``text`` (reading on
    into ``continuation`` itself where it runs past the end, as a periodic copy does)."""
    extended = text + continuation
    return any(
        text[start - len(ending) : start] == ending
        and extended[start : start + len(continuation)] == continuation
        for start in range(len(ending), len(text))
    )


def check_ranked_tree(tree: TreeProposal, max_nodes: int, max_depth: int) -> None:
    parents = validate_parents(tree.parents)  # every parent an earlier node: prefixes are trees
    assert len(tree.tokens) == len(tree.acceptance) == len(parents) <= max(max_nodes, 0)
    assert all(0 < estimate < 1 for estimate in tree.acceptance)
    assert tree.acceptance == sorted(tree.acceptance, reverse=True)  # ranked best first
    siblings = list(zip(tree.parents, tree.tokens, strict=True))
    assert len(set(siblings)) == len(siblings), "two children of one node carry the same token"
    for index, parent in enumerate(tree.parents):
        if parent != ROOT:
            assert tree.acceptance[index] <= tree.acceptance[parent]
        assert len(path_to(index, parents)) <= max_depth


@each_drafter
@settings(max_examples=150, deadline=None)
@given(text=texts, budget=st.integers(0, 20), width=st.sampled_from([None, 1, 2]))
def test_trees_are_ranked_trees_with_estimates_in_0_1(
    make: Callable[[], ModelFreeDrafter], text: list[int], budget: int, width: int | None
) -> None:
    tree = fed(make, text).propose_tree(budget, max_children=width)
    check_ranked_tree(tree, budget, 12)
    if width is not None:
        assert max(Counter(tree.parents).values(), default=0) <= width


@each_drafter
@settings(max_examples=150, deadline=None)
@given(text=texts, budget=st.integers(0, 14))
def test_a_chain_grows_by_its_budget_and_is_the_one_child_tree(
    make: Callable[[], ModelFreeDrafter], text: list[int], budget: int
) -> None:
    drafter = fed(make, text)
    chain = drafter.propose(budget)
    assert len(chain) <= min(budget, 12)
    assert drafter.propose(budget + 1)[:budget] == chain
    assert drafter.propose_tree(budget, max_children=1).tokens == chain


@settings(max_examples=200, deadline=None)
@given(text=texts, budget=st.integers(1, 12), min_order=st.integers(1, 3))
def test_prompt_lookup_copies_what_followed_the_latest_occurrence(
    text: list[int], budget: int, min_order: int
) -> None:
    drafter = fed(lambda: PromptLookup(max_order=3, min_order=min_order, max_depth=12), text)
    order, start = drafter.index.longest_match(min_order)
    chain = drafter.propose(budget)
    if order == 0:
        assert chain == []
        return
    ending = text[len(text) - order :]
    assert text[start - order : start] == ending
    assert not any(  # the latest earlier occurrence: none after it
        text[later - order : later] == ending for later in range(start + 1, len(text))
    )
    assert followed(text, ending, chain)
    assert (text + chain)[start : start + len(chain)] == chain
    for path in paths(drafter.propose_tree(budget)):
        assert followed(text, ending, path)


@settings(max_examples=200, deadline=None)
@given(text=texts, budget=st.integers(1, 16))
def test_every_branch_of_the_continuation_tree_followed_the_ending_in_the_text(
    text: list[int], budget: int
) -> None:
    drafter = fed(lambda: ContinuationTree(max_order=3, max_depth=12, occurrences=4), text)
    order, _ = drafter.index.longest_match(1)
    tree = drafter.propose_tree(budget)
    assert bool(tree.tokens) == (order > 0)
    ending = text[len(text) - order :]
    for path in paths(tree):  # in the text itself: no periodic copy
        assert any(
            text[start - order : start] == ending and text[start : start + len(path)] == path
            for start in range(order, len(text))
        )


@settings(max_examples=200, deadline=None)
@given(text=texts, budget=st.integers(1, 16))
def test_each_step_of_the_ngram_table_followed_its_token_in_the_text(
    text: list[int], budget: int
) -> None:
    tree = fed(lambda: NgramTable(max_order=3, max_depth=12), text).propose_tree(budget)
    pairs = set(itertools.pairwise(text))
    for path in paths(tree):
        before = (text + path)[len(text) + len(path) - 2]
        assert (before, path[-1]) in pairs


@each_drafter
@settings(max_examples=150, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 80), max_size=5), budget=st.integers(0, 10))
def test_extending_in_rounds_after_proposals_equals_feeding_everything_at_once(
    make: Callable[[], ModelFreeDrafter], text: list[int], cuts: list[int], budget: int
) -> None:
    rounds, whole = make(), fed(make, text)
    start = 0
    for cut in [*sorted(cuts), len(text)]:
        rounds.propose(budget)  # reading changes nothing
        rounds.propose_tree(budget)
        rounds.extend(iter(text[start : max(cut, start)]))  # any iterable, an iterator too
        start = max(cut, start)
    assert len(rounds) == len(whole) == len(text)
    assert rounds.propose(budget) == whole.propose(budget)
    assert rounds.propose_tree(budget) == whole.propose_tree(budget)


@each_drafter
def test_short_texts_and_empty_budgets_are_served_with_nothing(
    make: Callable[[], ModelFreeDrafter],
) -> None:
    drafter = make()
    for tokens in ([], [5]):  # an empty prompt, then a single token: nothing has occurred twice
        drafter.extend(tokens)
        assert drafter.propose(8) == []
        assert drafter.propose_tree(8) == ([], [], [])
    drafter.extend([5, 5])  # now 5 followed 5
    chain = drafter.propose(3)
    assert chain
    assert set(chain) == {5}
    for budget in (0, -1):  # a context full to its last slot leaves no budget
        assert drafter.propose(budget) == []
        assert drafter.propose_tree(budget) == ([], [], [])
        assert drafter.propose_tree(4, max_children=budget) == ([], [], [])


def test_ten_thousand_repeats_keep_the_tables_small_and_the_proposals_full() -> None:
    run = [7] * 10_000
    lookup, tree, table = PromptLookup(), ContinuationTree(), NgramTable()
    for drafter in (lookup, tree, table):
        for start in range(0, len(run), 1000):  # the prompt, then rounds
            drafter.extend(run[start : start + 1000])
    assert lookup.index.contexts == tree.index.contexts == 4  # one context per order
    assert table.contexts == 3
    assert table.counted == 3
    assert lookup.propose(1000) == [7] * lookup.max_depth  # the copy goes on with itself
    assert len(tree.propose(1000)) == tree.occurrences  # the 16 latest occurrences, in the text
    assert table.propose(1000) == [7] * table.max_depth
    for drafter in (lookup, tree, table):
        proposal = drafter.propose_tree(10_000)  # a huge budget: still bounded by max_depth
        assert len(proposal.tokens) <= 32
        check_ranked_tree(proposal, 10_000, 32)
        assert proposal.acceptance[0] > 0.9  # thousands of agreeing occurrences


def test_the_context_cap_bounds_the_tables_and_lookups_still_serve() -> None:
    # (1,) and (1, 2) are seen first; a long stretch of other tokens fills the tables
    text = [1, 2] + [3 + (41 * position) % 101 for position in range(3000)] + [1, 2, 1]
    lookup = PromptLookup(min_order=2, max_contexts=50)
    table = NgramTable(max_contexts=50)
    for drafter in (lookup, table):
        drafter.extend(text)
    assert lookup.index.contexts == 50
    assert table.contexts == 50
    assert table.counted <= 50 * table.followers
    assert lookup.propose(4) == []  # (2, 1) was first seen past the cap: not indexed
    assert table.propose(1) == [2]  # (1,) was seen first: still counted


def test_prompt_lookup_copies_the_latest_occurrence_and_prices_it_by_agreement() -> None:
    #       0  1  2  3  4  5  6  7  8  9 10 11
    text = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 2, 3]  # (2, 3) before 3 and 8; latest: 8
    lookup = fed(lambda: PromptLookup(max_order=4, min_order=2), text)
    assert lookup.index.longest_match(2) == (2, 8)
    assert lookup.propose(3) == [5, 6, 2]
    tree = lookup.propose_tree(3)
    assert tree.parents == [ROOT, 0, 1]
    # 2 occurrences: at 8 (chosen) and 3 (goes on with 4, not 5): 1/2.5, then 1/1.5 twice
    assert tree.acceptance == pytest.approx([0.4, 0.4 / 1.5, 0.4 / 1.5 / 1.5])


def test_the_continuation_tree_merges_the_occurrences_and_ranks_by_share() -> None:
    text = [1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2]  # after (1, 2): 7, 8, 7 (newest last)
    tree = fed(lambda: ContinuationTree(max_order=2, occurrences=8), text).propose_tree(5)
    # 7 (2 of 3), then 1 and 2 (2 of 2 each); 8 (1 of 3); below 7 1 2, 8: of the two
    # continuations there, the newest ran into the end of the text, so 1 of 1 known
    assert tree.tokens == [7, 1, 2, 8, 8]
    assert tree.parents == [ROOT, 0, 1, ROOT, 2]
    seven, eight = 2 / 3.5, 1 / 3.5
    assert tree.acceptance == pytest.approx(
        [seven, seven * 0.8, seven * 0.8 * 0.8, eight, seven * 0.8 * 0.8 / 1.5]
    )


def test_the_ngram_table_backs_off_to_shorter_contexts_and_stitches_steps() -> None:
    # (5, 1) never occurred, but 1 -> 2 and (1, 2) -> 3 did: the chain stitches them
    table = fed(lambda: NgramTable(max_order=2), [1, 2, 3, 4, 1, 2, 3, 9, 5])
    assert table.propose(2) == []  # 5 was never followed
    table.extend([1])
    assert table.propose(3) == [2, 3, 4]  # 3 -> 4 and 3 -> 9 tie: the one counted first
    tree = table.propose_tree(4)
    assert tree.tokens == [2, 3, 4, 9]
    assert tree.parents == [ROOT, 0, 1, 1]
    assert tree.acceptance == pytest.approx([0.8, 0.64, 0.64 * 0.4, 0.64 * 0.4])


def test_misra_gries_keeps_a_frequent_follower_within_its_bound() -> None:
    seen = Followers()
    for token in [1, 2, 3, 1, 4, 1, 5, 1, 6, 1, 7, 1]:  # 1 follows half the time
        seen.add(token, most=2)
    assert seen.occurrences == 12
    assert len(seen.counts) <= 2
    assert 0 < seen.counts[1] <= 6  # kept, never overcounted


def test_the_fallback_proposes_from_the_next_drafter_when_the_first_has_nothing() -> None:
    both = Fallback(PromptLookup(min_order=2), NgramTable())
    both.extend([1, 2, 3, 1, 2, 3, 4, 2])  # (4, 2) never occurred; 2 -> 3 did
    assert both.drafters[0].propose(4) == []
    assert both.propose(2) == [3, 1]
    assert both.propose_tree(2).tokens == [3, 1]
    both.extend([3])  # now (2, 3) occurred before: lookup copies
    assert both.propose(3) == both.drafters[0].propose(3) == [4, 2, 3]
    with pytest.raises(ValueError, match="at least one"):
        Fallback()
