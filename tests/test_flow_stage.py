"""A pipeline stage's share of FlowSpec's tree (speculative/flow/stage_cache.py): whatever order
segments and commits reach it in, every node it computes attends to exactly its own prefix,
and its cache ends up holding exactly the committed text."""

from __future__ import annotations

import random
from collections import deque

import pytest
from test_flow_tree import greedy_reference, target_choice

from hetspec.speculative.flow.flow_tree import FlowTree
from hetspec.speculative.flow.stage_cache import StageBook


class SimulatedStage:
    """A StageBook plus what its cache slots would hold (token, position), moved as told."""

    def __init__(self, context: list[int], root: int) -> None:
        self.book = StageBook(len(context), root)
        self.slots: list[tuple[int, int]] = [(t, p) for p, t in enumerate(context)]
        self.segments: deque = deque()
        self.commits: deque = deque()
        self.computed = 0

    def step(self, rng: random.Random, check) -> tuple | None:
        """Handle one waiting message (a random one of the two queues' heads, a segment only
        once ready); returns the segment's live part to pass on, if it handled one."""
        can_segment = bool(self.segments) and self.book.ready(self.segments[0][-1])
        if self.commits and (not can_segment or rng.random() < 0.5):
            accepted, root = self.commits.popleft()
            move = self.book.commit(accepted, root)
            moved = [self.slots[s] for s in move.sources]
            self.slots[move.first :] = moved
            return None
        if not can_segment:
            return None
        ids, tokens, parents, positions, epoch = self.segments.popleft()
        admission = self.book.admit(ids, parents, epoch)
        assert admission.start == len(self.slots)
        live = [(ids[i], tokens[i], parents[i], positions[i]) for i in admission.keep]
        self.slots += [(token, position) for _, token, _, position in live]
        committed = self.slots[: self.book.committed]
        pending = self.slots[self.book.committed :]
        for row, (node, *_) in enumerate(live):
            seen = committed + [
                s for s, v in zip(pending, admission.visible[row], strict=True) if v
            ]
            check(node, [t for t, _ in seen], [p for _, p in seen])
            self.computed += 1
        if not live:
            return None
        return (*map(list, zip(*live, strict=True)), epoch)


def draft(tree: FlowTree, committed: list[int], rng: random.Random) -> None:
    """Draft below a few leaves, right about 70% of the time."""
    for leaf in [i for i, n in tree.nodes.items() if not n.children][:2]:
        right = target_choice(committed + tree.path_to(leaf))
        guess = right if rng.random() < 0.7 else (right + 2) % 7
        tree.add(leaf, guess, rng.random())


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_every_stage_computes_each_node_over_its_own_prefix(seed, stages) -> None:
    rng = random.Random(seed)
    context = [3, 1, 4, 1, 5]
    first = target_choice(context)
    tree = FlowTree(first, len(context))
    final, accepted = [first], 0
    prefixes: dict[int, list[int]] = {}  # node -> its true prefix (context + path), itself last

    def check(node, tokens, positions) -> None:
        assert tokens == prefixes[node]
        assert positions == list(range(len(tokens)))

    pipeline = [SimulatedStage(context, tree.root) for _ in range(stages)]
    results: deque = deque()  # (ids, outputs) out of the last stage
    for _ in range(400):
        committed = context + final[:accepted]
        if tree.unsent() < 4:
            draft(tree, committed, rng)
        if rng.random() < 0.5 and (segment := tree.segment(rng.randint(1, 4))):
            for node in segment.ids:
                prefixes[node] = committed + tree.path_to(node)
            pipeline[0].segments.append(
                (segment.ids, segment.tokens, segment.parents, segment.positions, segment.epoch)
            )
        for index in rng.sample(range(stages), stages):  # stages step in any order
            out = pipeline[index].step(rng, check)
            if out is None:
                continue
            if index + 1 < stages:
                pipeline[index + 1].segments.append(out)
            else:
                ids = out[0]
                results.append((ids, [target_choice(prefixes[i]) for i in ids]))
        if results and rng.random() < 0.6:
            ids, outputs = results.popleft()
            advance = tree.deliver(dict(zip(ids, outputs, strict=True)))
            if advance is not None:
                accepted += len(advance.accepted)
                final += advance.final_tokens
                for stage in pipeline:
                    stage.commits.append((advance.accepted, advance.root))
    assert accepted > 20
    assert final == greedy_reference(context, len(final))
    for stage in pipeline:
        assert_holds_the_committed_text(stage, context + final[:accepted], rng, check)


def assert_holds_the_committed_text(stage: SimulatedStage, text, rng, check) -> None:
    """Once its commits are applied, a stage's committed slots hold exactly ``text``."""
    while stage.commits:
        stage.step(rng, check)
    assert [t for t, _ in stage.slots[: stage.book.committed]] == text
    assert stage.computed > 0


def test_a_segment_from_a_later_epoch_waits_for_its_commit() -> None:
    book = StageBook(committed=4, root=0)
    book.admit([0, 1], [None, 0], epoch=0)
    assert not book.ready(1)
    with pytest.raises(ValueError, match="before commit 1"):
        book.admit([2], [1], epoch=1)
    move = book.commit([0], root=1)
    assert (move.first, move.sources, book.committed) == (4, [4, 5], 5)
    admission = book.admit([2], [1], epoch=1)
    assert admission.start == 6
    assert admission.visible.tolist() == [[True, True]]


def test_late_nodes_below_pruned_or_accepted_parents_are_dropped() -> None:
    book = StageBook(committed=2, root=0)
    book.admit([0, 1, 2], [None, 0, 0], epoch=0)
    book.commit([0], root=2)  # node 1 lost; node 2 is the root now
    admission = book.admit([3, 4, 5], [1, 2, 0], epoch=0)  # below 1: gone; below 2: live
    assert admission.keep == [1]
    assert book.pending == [2, 4]
    with pytest.raises(ValueError, match="never computed"):
        book.commit([7], root=8)
