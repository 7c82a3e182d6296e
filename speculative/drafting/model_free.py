"""Drafters that need no draft model: the contract they share, their ranked trees, and fallback.

A model-free drafter proposes from the request's own tokens (the prompt and the text so far):
``PromptLookup`` copies what followed the latest earlier occurrence of the text's last tokens,
``ContinuationTree`` offers, as a tree, what followed its recent occurrences, and ``NgramTable``
follows counts of which token followed each short context. Every one of them keeps to this:

- One object per request. ``extend(tokens)`` appends tokens: the prompt once, then each round's
  committed (verified) tokens; it costs O(len(tokens)) and never rebuilds an index. Its tables
  stay bounded: a run of one token repeated thousands of times adds no entry after the first
  few (each class says its bound).
- ``propose(max_tokens)``: a chain of at most ``max_tokens`` tokens (and at most the drafter's
  ``max_depth``) that would follow the last token seen, or [] when it has nothing to propose
  (no history, no earlier occurrence, a budget of 0: the context full to its last slot).
  ``propose(k)`` is a prefix of ``propose(k + 1)`` and equals
  ``propose_tree(k, max_children=1).tokens``.
- ``propose_tree(max_nodes, max_children)``: a ``TreeProposal`` of at most ``max_nodes`` nodes
  (at most ``max_children`` below any node, the root included), in the convention of
  ``hetspec.speculative.verify.tree`` and of EAGLE-2's ranked nodes
  (``drafting.dynamic_tree``): ``parents[i]`` is an earlier node or -1 (below the last
  committed token), nodes are ranked by descending ``acceptance`` (shallower first on ties),
  so every prefix of the lists is itself a tree and ``best_width`` can choose how many to
  verify. No two children of one node carry the same token.
- ``acceptance[i]``: the estimated probability that verification accepts node i, i.e. that the
  target's next tokens spell the path from the root to node i. It is a product, along the
  path, of counted frequencies: at each step, the share of the recorded occurrences of the
  context that continued with this token, ``count / (occurrences + prior)``, where ``prior``
  (a pseudo-count of occurrences that went some other way) keeps one sighting from reading
  as certainty. So every estimate lies in (0, 1) and never rises from a node to its children.
  It is a frequency, not a calibrated probability: the controller's ``Calibration`` learns
  how far the accepted tokens fall from the sum of the estimates.
- Reading (``propose``, ``propose_tree``) never changes the state; nothing is random.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, TypeVar

from hetspec.speculative.verify.tree import ROOT

State = TypeVar("State")

# One child of a node: its token, the probability that it follows given its parent was
# accepted (at most 1), and whatever the drafter needs to find the children below it.
Child = tuple[int, float, State]


class TreeProposal(NamedTuple):
    """Ranked draft nodes: ``tokens[i]`` below ``parents[i]`` (-1: the last committed token),
    with ``acceptance[i]``, the estimated probability that node i is accepted."""

    tokens: list[int]
    parents: list[int]
    acceptance: list[float]


def empty_tree() -> TreeProposal:
    return TreeProposal([], [], [])


class ModelFreeDrafter(Protocol):
    """What the engine holds of a model-free drafter, whichever kind (see the module's
    docstring for the contract)."""

    def __len__(self) -> int:
        """Tokens seen so far (the prompt and every committed token)."""
        ...

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, max_tokens: int) -> list[int]: ...

    def propose_tree(self, max_nodes: int, max_children: int | None = None) -> TreeProposal: ...


def ranked_tree(
    root: State,
    children: Callable[[State], Sequence[Child]],
    max_nodes: int,
    max_depth: int,
    max_children: int | None,
) -> TreeProposal:
    """The ``max_nodes`` likeliest nodes below ``root``, best first (EAGLE-2's order).

    ``children(state)`` lists a node's children best first, each with its conditional
    probability (at most 1). A node's estimate is the product along its path, so a child never
    ranks above its parent and best-first search emits parents first; only emitted nodes are
    expanded, which bounds the work by ``max_nodes`` expansions however large the table is.
    Ties rank the shallower node, then the one offered first.
    """
    tree = empty_tree()
    if max_nodes <= 0 or max_depth <= 0:
        return tree
    width = max_nodes if max_children is None else max(max_children, 0)
    frontier: list[tuple[float, int, int, int, int, State]] = []
    serial = itertools.count()  # unique, so the heap never compares two states

    def offer(parent: int, depth: int, estimate: float, state: State) -> None:
        for token, probability, below in children(state)[:width]:
            if probability > 0:
                entry = (-estimate * probability, depth, next(serial), parent, token, below)
                heapq.heappush(frontier, entry)

    offer(ROOT, 0, 1.0, root)
    while frontier and len(tree.tokens) < max_nodes:
        negative, depth, _, parent, token, below = heapq.heappop(frontier)
        node = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.acceptance.append(-negative)
        if depth + 1 < max_depth and node + 1 < max_nodes:
            offer(node, depth + 1, -negative, below)
    return tree


class Fallback:
    """Several drafters fed the same tokens: the first one's proposal, or where it proposes
    nothing, the next one's, and so on. E.g. ``Fallback(PromptLookup(), NgramTable())``: copy
    where the text repeats itself, follow counts where it does not."""

    def __init__(self, *drafters: ModelFreeDrafter) -> None:
        if not drafters:
            raise ValueError("Fallback needs at least one drafter")
        self.drafters = drafters

    def __len__(self) -> int:
        return len(self.drafters[0])

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)  # each drafter reads them: an iterator would feed the first alone
        for drafter in self.drafters:
            drafter.extend(tokens)

    def propose(self, max_tokens: int) -> list[int]:
        for drafter in self.drafters:
            if chain := drafter.propose(max_tokens):
                return chain
        return []

    def propose_tree(self, max_nodes: int, max_children: int | None = None) -> TreeProposal:
        for drafter in self.drafters:
            tree = drafter.propose_tree(max_nodes, max_children)
            if tree.tokens:
                return tree
        return empty_tree()
