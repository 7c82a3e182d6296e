"""Where a round's verdict is taken, as one explicit value, and the verdict taken there.

A verification's reply carries what its site needs and nothing more: each row's argmax (the
daemon walks a greedy tree), the logits rows in the arena (the daemon walks: log-probabilities
were asked, or a drawn request's round reads the target's rows itself), or the verdict (the
verifier walked a sampled tree and only the rows its walk reached left its runtime).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetspec.daemon.supervision.worker_client import WorkerError
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.verify.distributions import distribution
from hetspec.speculative.verify.samplers import KeyedSampler, Sampler
from hetspec.speculative.verify.tree import is_path
from hetspec.speculative.verify.verdicts import (
    RowsOnDemand,
    Verdict,
    accept_token,
    verify_greedy,
    verify_sampled,
)


class VerdictSite(enum.Enum):
    ARGMAX = "argmax"  # greedy, no log-probabilities: the daemon walks each row's argmax
    LOGITS = "logits"  # the daemon walks the logits rows the verifier put in the arena
    VERIFIER = "verifier"  # the verifier walks a sampled tree and replies the verdict


def verdict_site(
    params: SamplingParams,
    logprobs: int | None,
    sampler: Sampler,
    *,
    drawn_walk: bool,
    constrained: bool = False,
) -> VerdictSite:
    """Where a round's verdict is taken. ``drawn_walk``: whether the verifier may walk a drawn
    (unseeded) request's tree, i.e. the round gives it the drafter's rows and reads no row of
    the target afterwards (an overlapped round's second opinion reads the last one);
    ``constrained``: a grammar masks the target's rows, which the daemon holds."""
    if logprobs is not None or constrained:
        return VerdictSite.LOGITS  # the log-probabilities (or the grammar) need the rows
    if params.greedy:
        return VerdictSite.ARGMAX
    keyed = isinstance(sampler, KeyedSampler)
    return VerdictSite.VERIFIER if keyed or drawn_walk else VerdictSite.LOGITS


def walk_command(
    site: VerdictSite,
    params: SamplingParams,
    sampler: Sampler,
    position: int,
    *,
    draft: m.ArrayRef | None = None,
    draft_rows: list[int] | None = None,
) -> m.SampledWalk | None:
    """The ``SampledWalk`` a verification carries where the verifier takes the verdict: its
    keyed sampler's, or speculative sampling against ``draft`` (the drafter's rows, node i's at
    ``draft_rows[i]``) with a fresh seed from the request's stream."""
    if site is not VerdictSite.VERIFIER:
        return None
    if isinstance(sampler, KeyedSampler):
        return m.SampledWalk(params, position, keyed=True)
    seed = int(sampler.rng.integers(2**63))
    return m.SampledWalk(params, position, seed=seed, draft=draft, draft_rows=draft_rows or [])


@dataclass(frozen=True)
class Judged:
    verdict: Verdict
    # the target's rows, each a logits row (LOGITS) or an argmax (ARGMAX, 1-d); None where
    # the verifier walked
    rows: np.ndarray | None


def judge(
    site: VerdictSite,
    tokens: Sequence[int],
    parents: Sequence[int],
    verified: m.Verified,
    *,
    arena: Arena,
    vocab_size: int,
    verifier_name: str,
    params: SamplingParams,
    sampler: Sampler,
    position: int,
    draft_rows: RowsOnDemand | np.ndarray | None = None,
    constraint: Constraint | None = None,
) -> Judged:
    """The verdict on a drafted tree (``tokens``, ``parents``) from a reply taken at ``site``;
    row 0 of the target's rows chooses the token at ``position``; ``constraint``: the
    request's grammar, which masks each row the walk reads (``LOGITS`` only). A reply that
    does not carry what its site needs, or a walk whose verdict does not fit the tree, is the
    worker's fault (``WorkerError``): nothing unverified is emitted."""
    if site is VerdictSite.VERIFIER:
        return Judged(_walked(parents, verified, vocab_size, verifier_name), None)
    if site is VerdictSite.ARGMAX:
        if len(verified.argmax) != len(tokens) + 1:
            raise _misfit(verifier_name, f"{len(verified.argmax)} argmax rows", len(tokens))
        rows = np.asarray(verified.argmax, np.int64)
        return Judged(verify_greedy(list(tokens), list(parents), rows), rows)
    if verified.logits is None:
        raise _misfit(verifier_name, "no logits", len(tokens))
    rows = arena.view(verified.logits)
    if constraint is not None:
        rows = constraint.rows(rows, tokens, parents)
    if params.greedy:
        return Judged(verify_greedy(list(tokens), list(parents), rows), rows)
    keyed = sampler if isinstance(sampler, KeyedSampler) else None
    verdict = verify_sampled(
        list(tokens),
        list(parents),
        rows,
        params,
        position=position,
        keyed=keyed,
        rng=sampler.rng if keyed is None else None,
        draft=draft_rows,
    )
    return Judged(verdict, rows)


def _misfit(verifier_name: str, what: str, nodes: int) -> WorkerError:
    return WorkerError(
        verifier_name, "protocol", f"a verification replied {what} for a tree of {nodes} nodes"
    )


def _walked(
    parents: Sequence[int], verified: m.Verified, vocab_size: int, verifier_name: str
) -> Verdict:
    """The verdict a verifier's walk replied, checked: a path of the tree it was sent and a
    bonus in the vocabulary (nothing unverified is emitted, a faulty worker's either)."""
    path, bonus, nodes = list(verified.path), verified.bonus, len(parents)
    fits = all(0 <= node < nodes for node in path) and 0 <= bonus < vocab_size
    if not (fits and is_path(path, np.asarray(parents))):
        raise WorkerError(
            verifier_name,
            "protocol",
            f"a walk's verdict ({path}, bonus {bonus}) does not fit the "
            f"tree of {nodes} nodes it was sent",
        )
    return Verdict(path, bonus)


def second_opinion(
    verdict: Verdict,
    guess: int,
    *,
    guess_row: np.ndarray | None,
    last_row: np.ndarray | None,
    params: SamplingParams,
    sampler: Sampler,
) -> tuple[Verdict, bool]:
    """The whole draft was accepted and a run-ahead's first token guessed the bonus: whether
    the guess holds, and the verdict. Greedy and keyed: it holds if it is the target's choice,
    the bonus. Drawn: the guess was drawn from the drafter (``guess_row``), so it is judged
    like a drafted token (kept with probability min(1, p/q), else the bonus is redrawn from the
    residual of the target's ``last_row``): the bonus still follows the target exactly."""
    if params.greedy or isinstance(sampler, KeyedSampler):
        return verdict, guess == verdict.bonus
    target = distribution(last_row[None, :], params)[0]
    held, bonus = accept_token(guess, guess_row, target, sampler.rng)
    return Verdict(verdict.path, bonus), held
