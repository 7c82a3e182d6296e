"""What one pipeline stage keeps of FlowSpec's tree: its cache slots, as segments and commits
arrive (the coordinator's side is flow_tree.py).

A stage's cache holds the committed context in slots 0..committed-1 and then the tree nodes it
has computed and not yet dropped ("pending"), in arrival order. Segments reach a stage through
the stages before it, commits straight from the coordinator, so either may come first:

- A segment made after commit e (``epoch`` > commits applied here) waits until commit e is
  applied: its nodes may attend to nodes that commit e moves into the committed context.
- A segment made before the latest commit applied here is filtered: a node is live iff its
  parent is a pending node here, or it is the current root (whose ancestors are all
  committed). Everything else was pruned meanwhile and is neither computed nor passed on.
- A commit moves the accepted nodes' slots, in order, to the end of the committed context,
  keeps the pending nodes below the new root after them, and drops the rest.

Pure bookkeeping: it says which slots move and what each new node may attend to; the stage's
runtime does the moving and computing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Admission:
    """The live part of a segment, to compute now."""

    keep: list[int]  # indices into the segment of its live nodes, in order
    start: int  # the cache slot of the first live node (the rest follow it)
    # (live nodes, pending before + live nodes) bool: which pending slots each live node
    # attends to beyond the whole committed context (its ancestors and itself)
    visible: np.ndarray


@dataclass(frozen=True)
class Compaction:
    """Slots to gather, in this order, into slots ``first``, ``first`` + 1, ...: the accepted
    nodes (now committed), then the pending nodes kept."""

    first: int
    sources: list[int]


class StageBook:
    def __init__(self, committed: int, root: int) -> None:
        """A stage whose cache holds ``committed`` slots of context, awaiting node ``root``."""
        self.committed = committed
        self.root = root
        self.epoch = 0  # commits applied
        self.pending: list[int] = []  # node ids, in slot order after the committed context
        self.parent: dict[int, int | None] = {}  # of pending nodes

    def ready(self, epoch: int) -> bool:
        """Whether a segment made after ``epoch`` commits can be computed now."""
        return epoch <= self.epoch

    def admit(self, ids: list[int], parents: list[int | None], epoch: int) -> Admission:
        """Take a segment's live nodes as pending (parents precede children in a segment)."""
        if not self.ready(epoch):
            raise ValueError(f"segment of epoch {epoch} before commit {epoch} was applied")
        slot_of = {node: i for i, node in enumerate(self.pending)}
        before = len(self.pending)
        keep: list[int] = []
        for index, (node, parent) in enumerate(zip(ids, parents, strict=True)):
            if node in slot_of:
                raise ValueError(f"node {node} arrived twice")
            if (parent is not None and parent in slot_of) or node == self.root:
                slot_of[node] = len(self.pending)
                self.pending.append(node)
                self.parent[node] = parent if parent in slot_of else None
                keep.append(index)
        visible = np.zeros((len(keep), len(self.pending)), bool)
        for row, index in enumerate(keep):
            node: int | None = ids[index]
            while node is not None:
                visible[row, slot_of[node]] = True
                node = self.parent[node]
        return Admission(keep, self.committed + before, visible)

    def commit(self, accepted: list[int], root: int) -> Compaction:
        """Apply the coordinator's commit: ``accepted`` (all computed here, in order) join the
        committed context; the nodes below ``root`` stay pending; the rest are dropped."""
        slot_of = {node: i for i, node in enumerate(self.pending)}
        missing = [node for node in accepted if node not in slot_of]
        if missing:
            raise ValueError(f"accepted nodes {missing} were never computed here")
        children: dict[int, list[int]] = {}
        for node in self.pending:
            if (parent := self.parent[node]) is not None:
                children.setdefault(parent, []).append(node)
        below: set[int] = set()
        stack = [root] if root in slot_of else []
        while stack:
            node = stack.pop()
            below.add(node)
            stack.extend(children.get(node, ()))
        kept = [node for node in self.pending if node in below]
        sources = [self.committed + slot_of[node] for node in accepted + kept]
        first = self.committed
        self.committed += len(accepted)
        self.pending = kept
        self.parent = {node: self.parent[node] for node in kept}
        if root in self.parent:
            self.parent[root] = None  # its ancestors are all committed now
        self.root = root
        self.epoch += 1
        return Compaction(first, sources)
