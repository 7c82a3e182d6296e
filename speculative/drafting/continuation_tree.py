"""The continuation tree: what followed the recent occurrences of the text's ending, as a tree.

SuffixDecoding's idea over one request: the longest ending of the text, ``min_order``..
``max_order`` tokens, that occurred before is matched, and the continuations of its latest
``occurrences`` occurrences are merged into a tree by their common prefixes: the subtree below
that ending in a suffix tree of the request's tokens, restricted to recent occurrences. It is
built from ``OccurrenceIndex`` when asked, and only as far as the ranking reaches, so its cost
is bounded by the occurrences read and the nodes emitted, never by the length of the text.

Every path of the tree followed an occurrence of the matched ending in the text itself (no
periodic copy here: a continuation ends where the text does). A node's conditional
probability is the share of the occurrences reaching its parent (whose continuation is known
there) that went on with its token, over their count plus ``prior``; siblings are ranked by
that share, the one seen latest first on ties. ``propose`` follows the likeliest child from
the root down.
"""

from __future__ import annotations

from hetspec.speculative.drafting.model_free import Child, TreeProposal, ranked_tree
from hetspec.speculative.drafting.occurrences import OccurrenceDrafter


class ContinuationTree(OccurrenceDrafter):
    """A ``ModelFreeDrafter`` proposing the merged continuations of the recent occurrences of
    the text's longest matching ending."""

    def __init__(self, *, min_order: int = 1, **settings) -> None:
        super().__init__(min_order=min_order, **settings)

    def propose(self, max_tokens: int) -> list[int]:
        chain: list[int] = []
        positions = self._matched()
        length = min(max_tokens, self.max_depth)
        while positions and len(chain) < length:
            if len(positions) == 1:  # one continuation left: the rest of the path is a copy
                chain += self.index.tokens[positions[0] : positions[0] + length - len(chain)]
                break
            best = self._children(positions)[:1]
            if not best:
                break
            token, _, positions = best[0]
            chain.append(token)
        return chain

    def propose_tree(self, max_nodes: int, max_children: int | None = None) -> TreeProposal:
        return ranked_tree(self._matched(), self._children, max_nodes, self.max_depth, max_children)

    def _matched(self) -> list[int]:
        """Positions after the latest occurrences of the longest matching ending."""
        order, latest = self.index.longest_match(self.min_order)
        return self.index.earlier(order, latest, self.occurrences) if order else []

    def _children(self, positions: list[int]) -> list[Child]:
        """The tokens at ``positions`` (continuations that reached this node), grouped: each
        with its share and the positions after it, most shared first."""
        history, end = self.index.tokens, len(self.index.tokens)
        if len(positions) == 1:  # deep in a tree most nodes hold one continuation: no grouping
            position = positions[0]
            return (
                [(history[position], 1 / (1 + self.prior), [position + 1])]
                if position < end
                else []
            )
        after: dict[int, list[int]] = {}  # insertion order: positions are newest first
        known = self.prior
        for position in positions:
            if position < end:
                after.setdefault(history[position], []).append(position + 1)
                known += 1
        ranked = sorted(after.items(), key=lambda item: -len(item[1]))  # stable: ties newest first
        return [(token, len(nexts) / known, nexts) for token, nexts in ranked]
