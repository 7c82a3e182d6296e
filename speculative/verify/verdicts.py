"""Verification of a drafted token tree against the target's distributions.

Rows of ``target`` are indexed by node + 1: row 0 is the target's next-token distribution after
the committed prefix (the tree's root), row i + 1 the distribution after node i. Rows of
``draft`` are indexed by node: the distribution node i was drawn from.

- Greedy: walk down from the root, each step taking the child whose token is the target's
  argmax; the first miss ends the walk and the argmax itself is the bonus token. The output is
  the target's own greedy output, whatever the draft proposed.
- Keyed (a seeded request): the target's token at each node is its Gumbel-max choice with the
  noise of that node's position (``samplers.KeyedSampler``); the walk is the greedy one over
  those perturbed scores. The output is what the target alone samples with that seed.
- Sampling: multi-candidate speculative sampling (SpecInfer's recursive rejection). At a node,
  its children are tried in order; child x is accepted with probability min(1, p(x) / q(x));
  after a rejection the target distribution becomes the residual norm(max(p - q, 0)) for the
  next sibling. When no child is accepted, the bonus token is drawn from what remains. With
  siblings drawn independently from q, every emitted token follows the target's distribution
  exactly (tests check it with chi-square).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.verify.distributions import WarpedRows, draw
from hetspec.speculative.verify.samplers import KeyedSampler
from hetspec.speculative.verify.tree import ROOT, depths, validate_parents


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted nodes, root first
    bonus: int  # the target's own next token after the path

    def tokens(self, node_tokens: np.ndarray) -> list[int]:
        """Every token this round commits: the accepted ones, then the bonus."""
        return [int(node_tokens[node]) for node in self.path] + [self.bonus]

    def rows(self) -> list[int]:
        """The target row each committed token was chosen from (row 0 follows the committed
        prefix, row i + 1 node i)."""
        return [0] + [node + 1 for node in self.path]


def _children(parents: np.ndarray) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(node)
    return children


def _check(tokens: np.ndarray, parents: np.ndarray, target: np.ndarray) -> None:
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
    if target.shape[0] != len(tokens) + 1:
        raise ValueError(
            f"{len(tokens)} nodes need {len(tokens) + 1} target rows, not {target.shape[0]}"
        )


def _walk(tokens, parents, target: np.ndarray, choose: Callable[[int], int]) -> Verdict:
    """The longest path whose every token is ``choose(row)`` of the row before it; rows are
    chosen only where the walk reaches (a large vocabulary makes each one cost)."""
    tokens, parents = np.asarray(tokens), validate_parents(parents)
    _check(tokens, parents, target)
    children = _children(parents)
    node, path = ROOT, []
    while True:
        wanted = choose(node + 1)
        match = next((c for c in children.get(node, []) if tokens[c] == wanted), None)
        if match is None:
            return Verdict(path, wanted)
        path.append(match)
        node = match


def _greedy_chain(tokens, parents, choices: np.ndarray) -> Verdict | None:
    """``verify_greedy`` of a one-branch draft against each row's choice, in plain Python
    (a round's critical path: numpy's per-call costs were most of the walk, ~5x more with
    the caches cold after a CPU verifier's forward); None where ``parents`` is no chain."""
    parents = parents.tolist() if isinstance(parents, np.ndarray) else list(parents)
    if parents != list(range(-1, len(parents) - 1)):
        return None
    _check(tokens, parents, choices)
    wanted = choices.tolist()
    kept = 0
    for token in tokens:
        if token != wanted[kept]:
            break
        kept += 1
    return Verdict(list(range(kept)), int(wanted[kept]))


def verify_greedy(tokens, parents, target: np.ndarray) -> Verdict:
    """The longest path agreeing with the target's argmax; ``target`` may be logits, or the
    argmax of each row already (a 1-d array)."""
    if target.ndim == 1:
        chain = _greedy_chain(tokens, parents, target)
        if chain is not None:
            return chain
        return _walk(tokens, parents, target, lambda row: int(target[row]))
    return _walk(tokens, parents, target, lambda row: int(np.argmax(target[row])))


def verify_keyed(
    tokens, parents, target: np.ndarray, sampler: KeyedSampler, position: int
) -> Verdict:
    """``verify_greedy`` over the target's keyed choices: row 0 chooses the token at
    ``position``, row i + 1 (after node i) the token at position + depth(i) + 1. ``target``:
    probability rows after the request's warping."""
    parents = validate_parents(parents)
    positions = np.concatenate([[position], position + depths(parents) + 1]).tolist()

    def choose(row: int) -> int:
        return int(np.argmax(sampler.scores(target[row], positions[row])))

    return _walk(tokens, parents, target, choose)


def _accepts(token: int, p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> bool:
    """Keep ``token``, drawn from ``q``, with probability min(1, p/q): u * q < p (in float64;
    only the token's entries are read)."""
    return bool(rng.random() * float(q[token]) < float(p[token]))


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(p - q, 0) in float64 (p and q float32 or float64): computed only after a rejection,
    so an accepted token costs no pass over the vocabulary."""
    residual = np.subtract(p, q, dtype=np.float64)
    return np.maximum(residual, 0.0, out=residual)


def accept_token(
    token: int, draft: np.ndarray, target: np.ndarray, rng: np.random.Generator
) -> tuple[bool, int]:
    """Speculative sampling of one drafted ``token`` drawn from ``draft``: kept with probability
    min(1, p/q), else replaced by a draw from the residual norm(max(p - q, 0)). Either way the
    returned token follows ``target``; returns (kept, token)."""
    if _accepts(token, target, draft, rng):
        return True, int(token)
    residual = _residual(target, draft)
    return False, draw(residual if residual.sum() > 0 else target, rng)


def verify_sampling(
    tokens, parents, draft: np.ndarray, target: np.ndarray, rng: np.random.Generator
) -> Verdict:
    """Lossless recursive rejection over the tree; ``draft``/``target`` are probability rows
    after the same temperature/top-k/top-p warping (arrays, or ``WarpedRows``; only the rows
    the walk reaches are read)."""
    tokens, parents = np.asarray(tokens), validate_parents(parents)
    _check(tokens, parents, target)
    if draft.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} nodes need {len(tokens)} draft rows, not {draft.shape[0]}")
    children = _children(parents)
    node, path = ROOT, []
    while True:
        p = target[node + 1]  # float64 from the first rejection on
        accepted = None
        for child in children.get(node, []):
            q = draft[child]
            token = tokens[child]
            if _accepts(token, p, q, rng):
                accepted = child
                break
            residual = _residual(p, q)
            total = residual.sum()
            if total <= 0:  # p <= q everywhere means p == q: rejection had probability 0
                break
            p = residual / total
        if accepted is None:
            return Verdict(path, draw(p, rng))
        path.append(accepted)
        node = accepted


class RowsOnDemand:
    """Vocabulary-wide rows, each read by ``read(row)`` only when indexed (``shape``: rows,
    vocab): a walk reads the rows it reaches and no other (a runtime's logits off its device,
    a draft's rows in place)."""

    def __init__(self, shape: tuple[int, int], read: Callable[[int], np.ndarray]) -> None:
        self.shape, self._read = shape, read

    @classmethod
    def at(cls, array: np.ndarray, index: list[int]) -> RowsOnDemand:
        """Rows ``index[i]`` of a 2-d ``array`` as row i, read in place."""
        return cls((len(index), array.shape[1]), lambda row: array[index[row]])

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, row: int) -> np.ndarray:
        if not 0 <= row < self.shape[0]:
            raise IndexError(f"row {row} of {self.shape[0]}")
        return self._read(row)


def verify_sampled(
    tokens,
    parents,
    logits,
    params: SamplingParams,
    *,
    position: int,
    keyed: KeyedSampler | None = None,
    rng: np.random.Generator | None = None,
    draft=None,
) -> Verdict:
    """A sampled request's verdict from the target's logit rows (an array, or any object
    with ``shape`` whose rows are read when first indexed), warped by ``params`` row by row
    as the walk reaches them: ``keyed``'s choices (row 0 choosing the token at ``position``),
    else speculative sampling with ``rng`` against ``draft`` (rows as ``verify_sampling``
    takes them). The daemon and a verifier walking in its own process (``SampledWalk``) take
    it the same way."""
    target = WarpedRows(logits, params)
    if keyed is not None:
        return verify_keyed(tokens, parents, target, keyed, position)
    if rng is None or draft is None:
        raise ValueError("speculative sampling needs a generator and the draft's rows")
    return verify_sampling(tokens, parents, draft, target, rng)
