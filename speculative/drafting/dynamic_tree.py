"""EAGLE-2's dynamic draft tree: grow where the draft is confident, verify the likeliest nodes.

The drafter expands, at each depth, the ``top_k`` likeliest nodes of the newest layer (their
score: the product of the draft's probabilities along the path from the committed end, kept
as a sum of logs) into their ``top_k`` likeliest children each. Then every drafted node is
ranked by score and the best ones form the tree to verify. A child never scores above its
parent (each factor is at most 1), so in the order of descending score, ties broken by depth,
parents come before their children: every prefix of that order is a tree, and how many nodes
to verify can be decided after drafting, from the scores and the measured cost of each width.

A node's score estimates the chance that verification accepts it: the sum of the kept scores
estimates the tokens a round accepts, and ``Calibration`` learns how far that is off. EAGLE-2
scores by the draft's own path probability; greedy (and keyed) verification, though, accepts
the draft's first choice whenever the two choices agree, whatever its probability (scored
by path probability, trees lost to chains: docs/design-notes.md, "Dynamic trees' scores").
So with ``first_accept`` (the rate at which first choices are accepted, learned from rounds
by ``FirstChoice``) a first choice scores that rate, and another child x the rest, shared in
proportion to the draft: (1 - rate) q(x) / (1 - q(first)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetspec.speculative.verify.tree import ROOT


def child_scores(row: np.ndarray, chosen: Sequence[int], first_accept: float | None) -> np.ndarray:
    """Log-scores of the children ``chosen`` (the first: the draft's own choice) of a node whose
    draft distribution is ``row``: log q(x), or with ``first_accept`` the model above. Each is
    at most 0, so scores never rise from a parent to its children."""
    chosen = np.asarray(chosen, np.int64)
    q = row[chosen].astype(np.float64)
    with np.errstate(divide="ignore"):
        if first_accept is None:
            return np.log(q)
        rate = min(max(first_accept, 0.01), 0.99)
        rest = max(1.0 - float(q[0]), 1e-12)
        scores = np.log(np.minimum((1 - rate) * q / rest, 1.0))
        scores[0] = np.log(rate)
    return scores


def rank_nodes(
    parents: Sequence[int], scores: Sequence[float], depths: Sequence[int], size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``size`` best drafted nodes as a tree: (indices into the drafted nodes, best first,
    each parent before its children; their parents, renumbered into that list, -1 for the
    committed end). ``scores``: each node's log-score (``child_scores`` summed along its
    path), a child's no higher than its parent's."""
    scores, depths = np.asarray(scores, np.float64), np.asarray(depths, np.int64)
    order = np.lexsort((np.arange(len(scores)), depths, -scores))[: max(size, 0)]
    position = {int(node): index for index, node in enumerate(order)}
    renumbered = np.empty(len(order), np.int64)
    for index, node in enumerate(order):
        parent = int(parents[node])
        if parent != ROOT and parent not in position:
            raise ValueError(
                f"node {int(node)} ranks above its parent {parent}: the scores "
                f"must not rise from a parent to its children"
            )
        renumbered[index] = ROOT if parent == ROOT else position[parent]
    return order, renumbered


def within_leaves(parents: Sequence[int], most: int | None) -> int:
    """The longest prefix of ranked nodes (parents first) with at most ``most`` leaves: a
    verifier may hold only so many branches (llama.cpp: a sequence id per leaf). A node
    below a leaf keeps the count, a node below an inner node (or the root) adds one, so the
    count never falls as the prefix grows. ``most`` None: no limit."""
    if most is None:
        return len(parents)
    has_child: set[int] = set()
    leaves = 0
    for index, parent in enumerate(parents):
        leaves += 0 if parent != ROOT and parent not in has_child else 1
        has_child.add(parent)
        if leaves > most:
            return index
    return len(parents)


@dataclass
class Calibration:
    """Accepted tokens over the tokens the scores expected, averaged over recent rounds
    (exponentially, ``decay`` per round); starts at ``prior``."""

    prior: float = 1.0
    decay: float = 0.9
    _accepted: float = 0.0
    _expected: float = 0.0

    def observe(self, expected: float, accepted: int) -> None:
        self._accepted = self._accepted * self.decay + accepted
        self._expected = self._expected * self.decay + expected

    @property
    def factor(self) -> float:
        if self._expected <= 0:
            return self.prior
        weight = min(self._expected, 4.0) / 4.0  # few rounds seen: lean on the prior
        measured = self._accepted / self._expected
        return weight * measured + (1 - weight) * self.prior


def best_width(
    acceptance: Sequence[float],
    factor: float,
    verify_s: Callable[[int], float | None],
    beside_rows: int = 0,
    beside_tokens: float = 0.0,
) -> int:
    """How many of the ranked nodes to verify (at least 1), once drafted (the draft is paid):
    the count n whose round commits the most tokens per verification second,
    (1 + factor * the first n nodes' acceptance) / verify_s(n + 1); ``verify_s(width)`` is
    None where the cost is not known, and such widths are not chosen (unless none is known:
    then all nodes). Other requests verified in the same forward (``beside_rows`` nodes,
    committing ``beside_tokens`` a round) widen each forward and count in what it commits."""
    expected = 1 + factor * np.cumsum(np.asarray(acceptance, np.float64)) + beside_tokens
    best, best_rate = len(expected), -1.0
    for count in range(1, len(expected) + 1):
        seconds = verify_s(count + 1 + beside_rows)
        if seconds is None:
            continue
        rate = expected[count - 1] / seconds
        if rate > best_rate:
            best, best_rate = count, rate
    return best


def first_choice_offers(parents: Sequence[int], path: Sequence[int]) -> tuple[bool, ...]:
    """Of a verified tree (ranked nodes, ``parents``) and its accepted ``path``: below the root
    and each accepted node that has children, whether verification took the first-listed
    child (the draft's own choice)."""
    first: dict[int, int] = {}
    for node, parent in enumerate(parents):
        first.setdefault(int(parent), node)
    offers = []
    for depth, parent in enumerate([ROOT, *path]):
        if parent not in first:
            break
        offers.append(depth < len(path) and path[depth] == first[parent])
    return tuple(offers)


@dataclass
class FirstChoice:
    """How often verification accepts the draft's first choice below an accepted node, over
    recent tree rounds (exponentially, ``decay`` per offer); starts at ``prior``."""

    prior: float = 0.7
    decay: float = 0.98
    _accepted: float = 0.0
    _offered: float = 0.0

    def observe(self, offers: Sequence[bool]) -> None:
        """One verified tree's offers (``first_choice_offers``): each, whether the draft's
        first choice was taken."""
        for taken in offers:
            self._accepted = self._accepted * self.decay + taken
            self._offered = self._offered * self.decay + 1

    @property
    def rate(self) -> float:
        weight = min(self._offered, 8.0) / 8.0  # few offers seen: lean on the prior
        measured = self._accepted / self._offered if self._offered else self.prior
        return weight * measured + (1 - weight) * self.prior
