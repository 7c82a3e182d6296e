"""Prompt lookup: propose what followed the latest earlier occurrence of the text's ending.

The longest ending of the text, ``min_order``..``max_order`` tokens, that occurred before is
matched; the chain proposed is what followed its latest earlier occurrence (vLLM's and
llama.cpp's ``ngram-simple`` prompt lookup; matching the latest occurrence keeps the copy
local to what is being written now). Where that continuation reaches the end of the text, it
goes on with itself, as an LZ77 copy does: the match says the text repeats with period
(end - occurrence) there, so a run of one token proposes the full budget of that token. So a
chain is ``(tokens + chain)[p:p + len(chain)]`` for a position p after an occurrence of the
matched ending, and ``propose(k)`` is a prefix of ``propose(k + 1)``.

Its tree is that chain, priced: the estimate of its depth-d node multiplies, for d' <= d, the
share of the ``occurrences`` latest occurrences of the matched ending that continued as the
chain does through d', among those that agreed before it, over their count plus ``prior``
(reading the text followed by the chain, as the copy does).

Cost: ``extend`` O(max_order) a token; ``propose`` max_order lookups and a slice;
``propose_tree`` at most ``occurrences`` x depth comparisons.
"""

from __future__ import annotations

from hetspec.speculative.drafting.model_free import TreeProposal, empty_tree
from hetspec.speculative.drafting.occurrences import OccurrenceDrafter
from hetspec.speculative.verify.tree import ROOT


class PromptLookup(OccurrenceDrafter):
    """A ``ModelFreeDrafter`` that copies what followed the latest earlier occurrence of the
    text's longest matching ending (``min_order``..``max_order`` tokens)."""

    def __init__(self, *, min_order: int = 2, **settings) -> None:
        super().__init__(min_order=min_order, **settings)

    def propose(self, max_tokens: int) -> list[int]:
        return self._chain(max_tokens)[0]

    def propose_tree(self, max_nodes: int, max_children: int | None = None) -> TreeProposal:
        """The chain of ``propose(max_nodes)`` with its estimates (a chain has one child a
        node: ``max_children`` matters only at 0)."""
        chain, order, start = self._chain(max_nodes)
        if not chain or (max_children is not None and max_children < 1):
            return empty_tree()
        history, end = self.index.tokens, len(self.index.tokens)
        agreeing = self.index.earlier(order, start, self.occurrences)
        estimate, acceptance = 1.0, []
        for depth, token in enumerate(chain):
            seen = len(agreeing)
            # an occurrence older than ``start`` reads no further than the chain itself does
            agreeing = [
                p
                for p in agreeing
                if (history[p + depth] if p + depth < end else chain[p + depth - end]) == token
            ]
            estimate *= len(agreeing) / (seen + self.prior)
            acceptance.append(estimate)
        return TreeProposal(chain, [ROOT, *range(len(chain) - 1)], acceptance)

    def _chain(self, max_tokens: int) -> tuple[list[int], int, int]:
        """(chain, matched order, position after the occurrence copied); ([], 0, -1) if none."""
        length = min(max_tokens, self.max_depth)
        if length <= 0:
            return [], 0, -1
        order, start = self.index.longest_match(self.min_order)
        if order == 0:
            return [], 0, -1
        copied = self.index.tokens[start : start + length]
        while len(copied) < length:  # ran into the end: the text repeats with this period
            copied += copied[: length - len(copied)]
        return copied, order, start
