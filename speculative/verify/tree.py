"""Token trees: drafted tokens with a parent each, the shape every runtime verifies.

A tree is given by ``parents``: ``parents[i]`` is the index of node i's parent, or -1 for a node
that continues the last committed token directly. Parents come before their children
(``parents[i] < i``), so a chain is ``[-1, 0, 1, ...]`` and k independent one-token branches are
``[-1] * k``. Position of node i = committed length + depth(i), depth counting from 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROOT = -1


class TreeError(ValueError):
    """The parent list does not describe a tree in topological order."""


def validate_parents(parents: Sequence[int], existing: int = 0) -> np.ndarray:
    """Check ``parents`` for nodes ``existing ..`` and return them as an int64 array.

    ``existing`` nodes already sit in a tree being extended; new node j (overall index
    existing + j) may point at any earlier node, old or new.
    """
    array = np.asarray(parents, dtype=np.int64).reshape(-1)
    limits = existing + np.arange(len(array))
    bad = np.flatnonzero((array < ROOT) | (array >= limits))
    if len(bad):
        j = int(bad[0])
        raise TreeError(
            f"node {existing + j} has parent {int(array[j])}; a parent must be -1 (the last "
            f"committed token) or an earlier node (0..{existing + j - 1})"
        )
    return array


def depths(parents: np.ndarray, existing_depths: np.ndarray | None = None) -> np.ndarray:
    """Depth of every new node (0 for children of the committed prefix)."""
    known = np.zeros(0, np.int64) if existing_depths is None else existing_depths
    out = np.concatenate([known, np.empty(len(parents), np.int64)])
    base = len(known)
    for j, parent in enumerate(parents):
        out[base + j] = 0 if parent == ROOT else out[parent] + 1
    return out[base:]


def ancestor_mask(parents: np.ndarray, existing_mask: np.ndarray | None = None) -> np.ndarray:
    """Rows for the new nodes of a boolean matrix: ``mask[i, j]`` iff j is i or an ancestor of i.

    With ``existing_mask`` (the square mask of the nodes already in the tree), the result has
    one row per new node and one column per node, old and new.
    """
    known = 0 if existing_mask is None else len(existing_mask)
    total = known + len(parents)
    full = np.zeros((total, total), dtype=bool)
    if known:
        full[:known, :known] = existing_mask
    for j, parent in enumerate(parents):
        i = known + j
        if parent != ROOT:
            full[i] = full[parent]
        full[i, i] = True
    return full[known:]


def path_to(node: int, parents: np.ndarray) -> list[int]:
    """Node indices from the first tree level down to ``node``, in order."""
    path = []
    while node != ROOT:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def is_path(nodes: Sequence[int], parents: np.ndarray) -> bool:
    """Whether ``nodes`` run from a child of the committed prefix down one branch (or are empty)."""
    return not nodes or list(nodes) == path_to(nodes[-1], parents)


def chain_parents(length: int, existing: int = 0, below: int = ROOT) -> np.ndarray:
    """Parents of a chain of ``length`` nodes appended to a tree of ``existing`` nodes.

    The chain's first node hangs below node ``below`` (-1: the committed prefix).
    """
    parents = np.arange(existing - 1, existing + length - 1, dtype=np.int64)
    if length:
        parents[0] = below
    return parents


def match_path(node_tokens: np.ndarray, parents: np.ndarray, sequence: Sequence[int]) -> list[int]:
    """The longest path from the prefix whose node tokens spell the start of ``sequence``.

    Lets a runtime keep what it already evaluated of a draft branch that got accepted.
    """
    first_child: dict[tuple[int, int], int] = {}  # (parent, token) -> its lowest node
    for node, key in enumerate(zip(parents.tolist(), node_tokens.tolist(), strict=True)):
        first_child.setdefault(key, node)
    path: list[int] = []
    parent = ROOT
    for token in sequence:
        node = first_child.get((parent, int(token)))
        if node is None:
            break
        path.append(node)
        parent = node
    return path
