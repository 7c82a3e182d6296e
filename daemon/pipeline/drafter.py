"""The drafter of FlowSpec's pipeline: a draft model in a worker process growing the
coordinator's tree (speculative/flow/flow_tree.py) while the stages verify it.

Below each new root it drafts an EAGLE-2 tree (depth, top-k, size). While the root waits for
its output, every drafted node is on its way and a stage could take more, ``expand`` (the
coordinator's ``Expander``) grows the tree: FlowSpec's score-aware expansion, a short chain
below the likeliest leaf, so the stages never run dry while the tree could still grow where
it is likeliest to be accepted. Scores are
path probabilities under the draft (the worker's acceptance estimates for tree nodes, times
the draft's probability of each chained token).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetspec.daemon.supervision.worker_client import WorkerClient
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.flow.flow_tree import FlowTree
from hetspec.speculative.verify.tree import ROOT  # the worker's committed end: the tree's root


@dataclass(frozen=True)
class TreeShape:
    depth: int = 4
    top_k: int = 2
    size: int = 8  # nodes drafted below each new root
    expand_steps: int = 2  # tokens per expansion chain (0: never expand)
    expansions: int = 6  # the most chains below one root (the worker's pending tree is bounded)
    min_score: float = 0.05  # leaves less likely than this are not worth the stages' time


class PipelineDrafter:
    """Call it with the coordinator's tree and the final tokens (``pipeline_decode``'s
    ``Drafter``); ``start`` after each prompt's prefill. Drafting is greedy: the nodes are
    chosen, and for any verification rule that accepts a token only where the target chose it,
    the tree's shape never changes the output."""

    def __init__(self, client: WorkerClient, arena: Arena, shape: TreeShape, slot: int = 0) -> None:
        """``slot``: the arena slot expansion chains' probability rows go to."""
        self.client, self.arena, self.shape, self.slot = client, arena, shape, slot
        self.seen = 0  # final tokens the worker has been told
        self.root: int | None = None  # the tree root it last drafted below
        self.pending: dict[int, int] = {}  # tree node -> the worker's pending node, evaluated
        self.expanded: set[int] = set()  # leaves already chained below (or refused)
        self.expansions = 0  # chains below the current root
        self.expanded_nodes = 0  # nodes added by expansion, all requests

    async def start(self, prompt: list[int]) -> None:
        await self.client.call(m.Prefill(request=self.client.next_request(), tokens=prompt))
        self.seen, self.root = 0, None

    async def __call__(self, tree: FlowTree, final: list[int]) -> None:
        if tree.root != self.root:
            await self._draft_tree(tree, final)

    async def _draft_tree(self, tree: FlowTree, final: list[int]) -> None:
        shape = self.shape
        drafted, _ = await self.client.call(
            m.Draft(
                request=self.client.next_request(),
                shape=m.DynamicTree(shape.depth, shape.top_k, shape.size),
                sampling=SamplingParams(),
                out=self.slot,
                append=final[self.seen :],
            )
        )
        self.seen, self.root = len(final), tree.root
        self.pending = {tree.root: ROOT}
        self.expanded.clear()
        self.expansions = 0
        ids: list[int] = []
        for token, parent, node, score in zip(
            drafted.tokens[0], drafted.parents, drafted.nodes[0], drafted.acceptance, strict=True
        ):
            ids.append(tree.add(tree.root if parent < 0 else ids[parent], token, score))
            if node >= 0:
                self.pending[ids[-1]] = node

    def _leaf_to_expand(self, tree: FlowTree) -> int | None:
        """The likeliest leaf whose parent the worker has evaluated (so the chain can start
        from the worker's pending tree), or None."""
        best, best_score = None, self.shape.min_score
        for node_id, node in tree.nodes.items():
            if (
                node.children
                or node_id in self.expanded
                or node.parent not in self.pending
                or node.score < best_score
            ):
                continue
            best, best_score = node_id, node.score
        return best

    async def expand(self, tree: FlowTree) -> bool:
        """One chain below the likeliest leaf; whether it added a node."""
        shape = self.shape
        if tree.root != self.root or shape.expand_steps < 1 or self.expansions >= shape.expansions:
            return False
        if (leaf := self._leaf_to_expand(tree)) is None:
            return False
        self.expanded.add(leaf)
        self.expansions += 1
        node = tree.nodes[leaf]
        drafted, _ = await self.client.call(
            m.Draft(
                request=self.client.next_request(),
                shape=m.RunAhead(self.pending[node.parent], node.token, shape.expand_steps),
                sampling=SamplingParams(),
                out=self.slot,
            )
        )
        self.pending[leaf] = drafted.root
        probs = self.arena.view(drafted.probs)[0]
        parent, score = leaf, node.score
        for step, (token, pending) in enumerate(
            zip(drafted.tokens[0], drafted.nodes[0], strict=True)
        ):
            score *= float(probs[step, token])
            parent = tree.add(parent, token, score)
            self.expanded_nodes += 1
            if pending >= 0:
                self.pending[parent] = pending
        return True
