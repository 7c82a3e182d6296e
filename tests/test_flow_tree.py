"""FlowSpec's continuously verified tree (speculative/flow/flow_tree.py), against a simulated
pipeline: segments in flight for several steps, outputs arriving late, drafts right and wrong."""

from __future__ import annotations

import random
from collections import deque

import pytest

from hetspec.speculative.flow.flow_tree import FlowTree


def target_choice(prefix: list[int], vocab: int = 7) -> int:
    """A deterministic 'greedy target': the next token is a function of the whole prefix."""
    return (sum((i + 1) * t for i, t in enumerate(prefix)) * 2654435761 >> 7) % vocab


def greedy_reference(context: list[int], count: int) -> list[int]:
    out = list(context)
    for _ in range(count):
        out.append(target_choice(out))
    return out[len(context) :]


def run_pipeline(seed: int, stages: int, segment_size: int, accuracy: float, tokens: int):
    """Drive a FlowTree like a coordinator: keep ``stages`` segments in flight, draft below
    the best leaves (right with probability ``accuracy``), deliver outputs in order."""
    rng = random.Random(seed)
    context = [1, 2, 3]
    first = target_choice(context)
    tree = FlowTree(first, len(context))
    final = [first]
    accepted = 0  # the first `accepted` final tokens are committed at the stages
    flight: deque[tuple[list[int], list[int]]] = deque()
    steps = 0
    while len(final) < tokens:
        steps += 1
        assert steps < 10_000
        committed = context + final[:accepted]
        # draft: extend the three best leaves by one or two children each
        leaves = sorted(
            (i for i, n in tree.nodes.items() if not n.children), key=lambda i: -tree.nodes[i].score
        )[:3]
        for leaf in leaves:
            prefix = committed + tree.path_to(leaf)
            right = target_choice(prefix)
            guess = right if rng.random() < accuracy else (right + 1) % 7
            score = tree.nodes[leaf].score
            score = (0.9 if score == float("inf") else score) * 0.8
            tree.add(leaf, guess, score)
            if rng.random() < 0.5:
                tree.add(leaf, (guess + 3) % 7, score * 0.3)
        segment = tree.segment(segment_size)
        if segment is not None:
            # the stages compute each node's output from its full prefix
            outputs = [target_choice(committed + tree.path_to(i)) for i in segment.ids]
            flight.append((segment.ids, outputs))
        if len(flight) >= stages or segment is None:
            ids, outputs = flight.popleft()
            advance = tree.deliver(dict(zip(ids, outputs, strict=True)))
            if advance is not None:
                accepted += len(advance.accepted)
                final += advance.final_tokens
                assert tree.root == advance.root
                assert tree.nodes[tree.root].parent is None
                assert not set(advance.pruned) & set(tree.nodes)
    return context, final, steps


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("stages", "segment_size", "accuracy"), [(1, 4, 0.9), (3, 2, 0.8), (3, 6, 0.5), (4, 3, 0.0)]
)
def test_the_final_tokens_are_the_targets_greedy_tokens(seed, stages, segment_size, accuracy):
    context, final, _ = run_pipeline(seed, stages, segment_size, accuracy, 60)
    assert final == greedy_reference(context, len(final))


def test_a_good_draft_finalizes_several_tokens_per_delivery() -> None:
    _, good, good_steps = run_pipeline(0, 3, 6, 0.95, 80)
    _, bad, bad_steps = run_pipeline(0, 3, 6, 0.0, 80)
    assert good_steps / len(good) < 0.6 * bad_steps / len(bad)


def test_segments_send_parents_first_and_best_scores_first() -> None:
    tree = FlowTree(5, 10)
    a = tree.add(tree.root, 1, 0.2)
    b = tree.add(tree.root, 2, 0.6)
    deep = tree.add(a, 3, 0.9)  # better than its parent: still after it
    segment = tree.segment(8)
    assert segment.ids == [tree.root, b, a, deep]
    assert segment.parents == [None, tree.root, tree.root, a]
    assert segment.positions == [10, 11, 11, 12]
    assert tree.segment(8) is None
    assert tree.add(tree.root, 2, 0.1) == b  # the same token below the same parent: one node


def test_a_miss_makes_a_fresh_root_and_prunes_the_rest() -> None:
    tree = FlowTree(5, 10)
    a = tree.add(tree.root, 1, 0.5)
    tree.add(a, 2, 0.4)
    old_root = tree.root
    tree.segment(8)
    advance = tree.deliver({old_root: 4})  # the target wanted 4: nothing drafted matches
    assert advance.accepted == [old_root]
    assert advance.final_tokens == [4]
    assert advance.drafted == 0
    assert sorted(tree.nodes) == [advance.root]
    assert len(advance.pruned) == 2
    assert tree.nodes[advance.root].token == 4
    assert tree.nodes[advance.root].position == 11
    assert tree.deliver({a: 2}) is None  # a late output of a pruned node changes nothing
    with pytest.raises(KeyError, match="not in the tree"):
        tree.add(a, 3, 0.1)
    assert tree.segment(4).ids == [advance.root]


def test_a_hit_keeps_the_subtree_in_flight() -> None:
    tree = FlowTree(5, 10)
    a = tree.add(tree.root, 1, 0.5)
    other = tree.add(tree.root, 9, 0.4)
    below = tree.add(a, 2, 0.3)
    old_root = tree.root
    tree.segment(8)
    advance = tree.deliver({old_root: 1})
    assert advance.accepted == [old_root]
    assert advance.root == a
    assert advance.pruned == [other]
    in_flight = [i for i, n in tree.nodes.items() if n.sent and n.choice is None]
    assert in_flight == [a, below]  # still on their way through the stages
    advance = tree.deliver({below: 6, a: 2})  # both outputs: two tokens at once
    assert advance.accepted == [a, below]
    assert advance.final_tokens == [2, 6]
    assert advance.drafted == 1  # 6 came from the target alone: nothing below `below` had it
