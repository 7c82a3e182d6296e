"""What a round of a given shape is expected to commit and cost: the controller's one model.

A round commits its accepted tokens plus the target's bonus token, so with reach(b, d) =
P(the first d drafted tokens are accepted, b branches drafted) it commits
1 + sum_{d <= gamma} reach(b, d) tokens. It lasts:
- a plain round: a draft call of gamma steps, then a verification of gamma * b + 1 nodes;
- an overlapped round (one branch): while the verifier verifies, the drafter drafts the next
  round (gamma + 1 steps: its guess of the bonus, then gamma), assuming the whole draft is
  accepted; that run-ahead is the next draft only if gamma + 1 tokens hold, else the next
  round drafts afresh first: max(run-ahead, verify) + (1 - reach(1, gamma + 1)) * fresh draft;
- a round drafted by DuoDecoding's rule with budget B: k sequences of B // k tokens, over the
  branch counts k the rule has been picking (B forwards when k = 1, B // k + 1 otherwise);
- a round without a draft: the target decoding one token alone.
A draft step of b branches costs ``branch_factor[b]`` steps of a chain (measured: it depends
on how the drafter's runtime drafts branches).
Every drafted round also pays ``overhead`` (messages, bookkeeping). Where other requests
decode at the same time (``beside``), their rows share each forward: a round verifies at its
own width plus theirs, and a shape is weighed by what the whole batch commits a round (its
tokens plus theirs) per second, so a request's wider draft pays for slowing the others too.
Costs are kept apart for one worker computing at a time and both at once (``overlapped``): on
cores that share execution resources each runs slower then, and that decides whether
overlapping pays.

The controller builds one from its estimates each time it weighs the candidates; the tests'
simulated box builds one from its true costs, so the two cannot drift apart.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, TypeVar

import numpy as np

from hetspec.speculative.control.rounds import NO_ONE_BESIDE, Beside

T = TypeVar("T")

# Integer widths a profile curve tabulates: every tree a round may verify (the controller
# prices every candidate's width at each choice)
TABULATED_WIDTHS = 128


@dataclass(frozen=True)
class VerifyLine:
    """Seconds to verify a tree of ``width`` nodes: a line, never below ``floor``."""

    mean_w: float
    mean_t: float
    slope: float
    floor: float

    def at(self, width):
        return np.maximum(self.mean_t + self.slope * (np.asarray(width) - self.mean_w), self.floor)

    @classmethod
    def exact(cls, base_s: float, per_node_s: float) -> VerifyLine:
        """base + per_node x width (the simulated box's)."""
        return cls(0.0, base_s, per_node_s, 0.0)


@dataclass(frozen=True)
class ProfileCurve:
    """Seconds to verify ``width`` nodes as a profile measured them at a few widths: straight
    between them, the last segment's slope beyond them."""

    widths: tuple[float, ...]
    times: tuple[float, ...]

    def at(self, width):
        """Seconds at ``width`` (a number or an array; widths >= 0)."""
        if isinstance(width, int | float):  # the engine's per-round calls: no numpy overhead
            return self._at_scalar(float(width))
        width = np.asarray(width)
        if width.dtype.kind in "iu":
            try:
                return self._table[width]
            except IndexError:  # wider than tabulated
                pass
        return self._curve(width)

    @cached_property
    def _table(self) -> np.ndarray:
        """``at`` of the integer widths 0 .. TABULATED_WIDTHS - 1, computed once: the same
        values, without numpy's interpolation per call."""
        table = self._curve(np.arange(TABULATED_WIDTHS))
        table.flags.writeable = False
        return table

    def _curve(self, width) -> np.ndarray:
        width = np.asarray(width, float)
        inside = np.interp(width, self.widths, self.times)
        if len(self.widths) < 2:
            return inside
        slope = (self.times[-1] - self.times[-2]) / (self.widths[-1] - self.widths[-2])
        return np.where(
            width > self.widths[-1],
            self.times[-1] + max(slope, 0.0) * (width - self.widths[-1]),
            inside,
        )

    def _at_scalar(self, width: float) -> float:
        """``at`` for one width, as numpy's interp computes it."""
        widths, times = self.widths, self.times
        if len(widths) >= 2 and width > widths[-1]:
            slope = (times[-1] - times[-2]) / (widths[-1] - widths[-2])
            return times[-1] + max(slope, 0.0) * (width - widths[-1])
        if width <= widths[0]:
            return float(times[0])
        if width >= widths[-1]:
            return float(times[-1])
        j = bisect.bisect_right(widths, width) - 1
        slope = (times[j + 1] - times[j]) / (widths[j + 1] - widths[j])
        return slope * (width - widths[j]) + times[j]


@dataclass(frozen=True)
class ProfiledVerify:
    """A verification's seconds as ``base + scale x`` the profile's: the profile knows the
    shape (a CPU kernel's cost climbs in steps: one pass over the weights serves up to 8
    nodes), the rounds measure the level; never below ``floor``."""

    profile: ProfileCurve
    base: float
    scale: float
    floor: float

    def at(self, width):
        return np.maximum(self.base + self.scale * self.profile.at(width), self.floor)


VerifyCost = VerifyLine | ProfiledVerify


@dataclass(frozen=True)
class ByOverlap(Generic[T]):
    """One quantity kept apart for plain rounds (one worker computes at a time) and
    overlapped ones (the drafter drafts ahead while the verifier verifies)."""

    plain: T
    overlapped: T

    def of(self, overlapped: bool) -> T:
        return self.overlapped if overlapped else self.plain


@dataclass(frozen=True)
class RuleShare:
    """How often the rule picks ``k`` branches, and reach by depth in those rounds."""

    k: int
    share: float
    reach: np.ndarray  # [depth]: P(the first depth tokens accepted); reach[0] = 1


def linear_branch_factor(branch_cost: float, max_branches: int) -> np.ndarray:
    """[branches]: 1 + ``branch_cost`` x (branches - 1), from 0 to ``max_branches``."""
    return 1 + branch_cost * (np.arange(max_branches + 1) - 1.0)


@dataclass(frozen=True)
class CostModel:
    step_s: ByOverlap[float]  # seconds per draft step of one branch
    latency_s: ByOverlap[float]  # a draft call's seconds besides its steps
    verify: ByOverlap[VerifyCost]
    reach: np.ndarray  # [branches, depth]: P(the first depth tokens accepted); row 0 unused
    overhead_s: float
    # [branches]: a draft step of that many branches against one of a chain (index 0 unused)
    branch_factor: np.ndarray
    alone_s: float  # seconds per token of the target decoding alone
    rule: tuple[RuleShare, ...] = ()  # empty: the rule is not a candidate
    # a verification of several branches against one chain of its width (a verifier whose
    # trees gather each path's keys pays more for them: docs/design-notes.md)
    branched_verify: float = 1.0
    beside: Beside = NO_ONE_BESIDE  # the other requests' rows in each forward
    # seconds per token of the target alone beside them, as measured (None: not yet)
    alone_beside_s: float | None = None

    @property
    def max_gamma(self) -> int:
        return self.reach.shape[1] - 2  # an overlapped round needs reach at gamma + 1

    def draft_s(self, steps, branches=1, overlapped: bool = False):
        """A draft call of ``steps`` steps, from sending it to having its reply."""
        step = self.step_s.of(overlapped) * self.branch_factor[np.asarray(branches)]
        return self.latency_s.of(overlapped) + np.asarray(steps) * step

    def predict(self, gamma, branches=1, overlap=False) -> tuple[np.ndarray, np.ndarray]:
        """Expected (tokens committed, seconds) of rounds of these shapes; the arguments
        broadcast, so one call weighs every candidate. gamma 0: the target alone."""
        gamma, branches = np.asarray(gamma), np.asarray(branches)
        overlap = np.asarray(overlap, bool)
        accepted = self._accepted
        drafted = gamma > 0
        g = np.where(drafted, gamma, 1)
        tokens = np.where(drafted, 1.0 + accepted[branches, g - 1], 1.0)
        fresh = self.draft_s(g, branches)
        premium = np.where(branches > 1, self.branched_verify, 1.0)
        rows = self.beside.rows
        plain = fresh + self.verify.plain.at(g * branches + 1 + rows) * premium
        ahead = self.draft_s(g + 1, 1, overlapped=True)
        held = self.reach[1, np.minimum(g + 1, self.reach.shape[1] - 1)]
        verify_ahead = self.verify.overlapped.at(g + 1 + rows)
        overlapped = np.maximum(ahead, verify_ahead) + (1 - held) * fresh
        seconds = np.where(overlap, overlapped, plain) + self.overhead_s
        return tokens, np.where(drafted, seconds, self.alone_batched_s)

    @cached_property
    def alone_batched_s(self) -> float:
        """A token of the target alone beside the other requests: as measured beside
        others, else ``alone_s`` (measured without them) raised as a one-node verification
        is by their rows."""
        rows = self.beside.rows
        if not rows:
            return self.alone_s
        if self.alone_beside_s:
            return self.alone_beside_s
        plain = self.verify.plain
        return self.alone_s * float(plain.at(1 + rows)) / max(float(plain.at(1)), 1e-12)

    def batch_rate(self, tokens, seconds):
        """What the whole batch commits per second, this request's rounds of ``tokens`` in
        ``seconds`` beside the others' (arrays broadcast)."""
        return (np.asarray(tokens) + self.beside.tokens) / seconds

    @cached_property
    def _rule_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rule's shares, branch counts and [count, depth] cumulative reach (1 + the sum
        of reach[1..d]), built once per model."""
        shares = np.array([s.share for s in self.rule])
        picked = np.array([s.k for s in self.rule])
        return shares, picked, np.cumsum([s.reach for s in self.rule], axis=1)

    @cached_property
    def _accepted(self) -> np.ndarray:
        """[branches, gamma - 1]: the sum of reach over depths 1 .. gamma."""
        return np.cumsum(self.reach[:, 1:], axis=1)

    def predict_rule(self, budget) -> tuple[np.ndarray, np.ndarray]:
        """Expected (tokens, seconds) of rounds drafted by the rule with these budgets (an
        array weighs them all in one call)."""
        budget = np.asarray(budget)
        if not self.rule:
            return np.zeros(budget.shape), np.full(budget.shape, self.overhead_s)
        # one row per branch count the rule picks, one column per budget (in one pass: the
        # controller weighs every budget each round)
        column = (-1,) + (1,) * budget.ndim
        shares, picked, accepted = self._rule_arrays
        share = shares.reshape(column)
        k = np.minimum(picked.reshape(column), budget)
        length = np.maximum(1, budget // k)  # branch_length, elementwise
        forwards = np.where(k == 1, budget, length + 1)
        kept = accepted[np.arange(len(self.rule)).reshape(column), length]
        verify = self.verify.plain.at(k * length + 1 + self.beside.rows)
        verify = verify * np.where(k > 1, self.branched_verify, 1.0)
        tokens = (share * kept).sum(axis=0)
        seconds = self.overhead_s + (share * (self.draft_s(forwards, k) + verify)).sum(axis=0)
        return tokens, seconds
