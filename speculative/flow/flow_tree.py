"""FlowSpec's continuously verified draft tree: what a pipelined verifier's coordinator keeps.

The target's layers are split into stages; segments of the tree flow through them one after
another, so verification never waits for a whole round. The tree always hangs below one
*root*: a node whose token is final (the target chose it) but whose own output (the target's
next-token choice after it) is still awaited. Verification advances as outputs arrive:

- When the root's output says the next token is t, the root is *accepted* (its keys and values
  become part of the committed context everywhere) and its child with token t, if drafted,
  becomes the root: its token is final now, whether or not its own output is back yet. If no
  child has token t, a new root node with token t is made and every other node is pruned
  (FlowSpec's "a round ends"). Every node not below the new root is pruned too.
- Nodes go out in segments, best score first, always after their parents (a parent's score
  is at least its children's in FlowSpec; here the order is enforced, whatever the scores).

Choosing t from an output is the caller's business (greedy, or keyed sampling), so this class
is exact for any rule under which a drafted token is accepted iff it equals the target's choice.
Pure bookkeeping: no model, no process, no clock.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field


@dataclass
class FlowNode:
    token: int
    parent: int | None  # None: the root made from the committed context's own output
    position: int  # the token's position in the sequence
    score: float
    children: dict[int, int] = field(default_factory=dict)  # token -> node id
    sent: bool = False
    choice: int | None = None  # the target's next token after this node, once verified


@dataclass(frozen=True)
class Segment:
    """Nodes to push through the stages, parents before children. ``parents`` holds node ids;
    a parent that is not in this segment was sent before (or is accepted by now)."""

    ids: list[int]
    tokens: list[int]
    parents: list[int | None]
    positions: list[int]
    epoch: int  # advances made before it: a stage computes it after applying that many


@dataclass(frozen=True)
class Advance:
    """What one delivery of outputs decided."""

    accepted: list[int]  # node ids whose keys/values join the committed context, in order
    final_tokens: list[int]  # tokens now final (the new roots' tokens), in order
    root: int  # the node whose output is awaited next
    pruned: list[int]  # node ids dropped from the tree
    drafted: int  # how many of final_tokens had been drafted (the rest: the target's own)


class FlowTree:
    """The live tree below the current root; node ids are never reused."""

    def __init__(self, root_token: int, root_position: int) -> None:
        """Start from the token the target chose after the committed context, at
        ``root_position`` (the context's length)."""
        self.nodes: dict[int, FlowNode] = {}
        self._next_id = 0
        self.epoch = 0  # advances so far
        self.root = self._make(root_token, None, root_position, math.inf)

    def _make(self, token: int, parent: int | None, position: int, score: float) -> int:
        node_id = self._next_id
        self._next_id += 1
        self.nodes[node_id] = FlowNode(token, parent, position, score)
        if parent is not None:
            self.nodes[parent].children[token] = node_id
        return node_id

    # ------------------------------------------------------------ drafting

    def add(self, parent: int, token: int, score: float) -> int:
        """Draft ``token`` below live node ``parent``; an existing child with that token is
        returned instead (its score raised to ``score`` if higher)."""
        node = self.nodes.get(parent)
        if node is None:
            raise KeyError(f"node {parent} is not in the tree (pruned or never made)")
        if (child := node.children.get(token)) is not None:
            self.nodes[child].score = max(self.nodes[child].score, score)
            return child
        return self._make(token, parent, node.position + 1, score)

    def path_to(self, node_id: int) -> list[int]:
        """Tokens from the root (included) down to ``node_id``."""
        tokens = []
        current: int | None = node_id
        while current is not None and current in self.nodes:
            tokens.append(self.nodes[current].token)
            current = self.nodes[current].parent
        return tokens[::-1]

    def unsent(self) -> int:
        return sum(not node.sent for node in self.nodes.values())

    def segment(self, limit: int) -> Segment | None:
        """Up to ``limit`` unsent nodes, best score first among those whose parent is sent
        or already taken; None when nothing can go."""
        if limit < 1:
            raise ValueError(f"a segment holds at least one node, not {limit}")
        ready = [
            (-n.score, i)
            for i, n in self.nodes.items()
            if not n.sent and (n.parent is None or self.nodes[n.parent].sent)
        ]
        heapq.heapify(ready)
        taken: list[int] = []
        while ready and len(taken) < limit:
            _, node_id = heapq.heappop(ready)
            node = self.nodes[node_id]
            node.sent = True
            taken.append(node_id)
            for child in node.children.values():
                heapq.heappush(ready, (-self.nodes[child].score, child))
        if not taken:
            return None
        return Segment(
            ids=taken,
            tokens=[self.nodes[i].token for i in taken],
            parents=[self.nodes[i].parent for i in taken],
            positions=[self.nodes[i].position for i in taken],
            epoch=self.epoch,
        )

    # ------------------------------------------------------------ verification

    def deliver(self, choices: dict[int, int]) -> Advance | None:
        """Record the target's next-token choice after each node in ``choices`` (outputs of
        pruned nodes are ignored) and advance the root as far as they allow; None if it did
        not move."""
        for node_id, choice in choices.items():
            if node_id in self.nodes:
                self.nodes[node_id].choice = choice
        accepted: list[int] = []
        final: list[int] = []
        drafted = 0
        while (choice := self.nodes[self.root].choice) is not None:
            accepted.append(self.root)
            old_root = self.nodes[self.root]
            child = old_root.children.get(choice)
            drafted += child is not None
            if child is None:  # the draft missed: a fresh root, the rest of the tree goes
                child = self._make(choice, self.root, old_root.position + 1, math.inf)
            self.root = child
            final.append(choice)
        if not accepted:
            return None
        pruned = self._prune_outside(self.root, set(accepted))
        for node_id in accepted:
            del self.nodes[node_id]
        root = self.nodes[self.root]
        root.parent = None
        root.score = math.inf
        self.epoch += 1
        return Advance(accepted, final, self.root, pruned, drafted)

    def _prune_outside(self, root: int, keep: set[int]) -> list[int]:
        """Drop every node that is neither below ``root`` nor in ``keep``."""
        below = {root}
        stack = [root]
        while stack:
            for child in self.nodes[stack.pop()].children.values():
                below.add(child)
                stack.append(child)
        pruned = [i for i in self.nodes if i not in below and i not in keep]
        for node_id in pruned:
            del self.nodes[node_id]
        return pruned
