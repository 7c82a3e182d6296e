"""The budget controller: how many tokens to draft, in how many branches, given what it costs.

DuoDecoding sets the draft length gamma once, to c = T_verify / T_draft. That is the right
start but the box changes under us (another process takes a core, the prompt grows), so the
controller keeps measuring:
- T_draft(branches): seconds per drafting step: a level (a windowed median of recent steps, each
  scaled to one branch, so every round refreshes it whatever its branch count; a median, so
  one preempted step does not swing it) times the cost of k branches relative to one,
  1 + batched_step_cost * (k - 1) (llama.cpp's batched branches measured 0.28-0.39 on the
  demo pair; per-k estimates went stale for the branch counts not chosen lately and misled
  the controller after a load change); plus a draft call's latency (the message round trip and
  the worker's wake-up, a windowed median of call time minus the worker's own time), paid
  once per call whatever its length: folded into the steps, it made short drafts look dear
  and long ones cheap, and hid what a run-ahead costs (its reply came 0.85 ms after its
  1.25 ms of drafting on a busy 2-vCPU VM);
- T_verify(width): a least-squares line through windowed medians per tree width;
- acceptance by depth (and at depth 1 by branch count): exponentially decayed counts, so old
  behaviour fades within a few dozen rounds.
Costs are kept apart for rounds where one worker computes at a time and for overlapped ones,
where both compute at once: on a box whose cores share execution resources (SMT siblings, a
VM's vCPUs) each then runs slower, and that decides whether overlapping pays.
From these it predicts, for every (gamma, branches, overlap), gamma = 0 included (no draft: the
target decodes alone, for boxes or texts where drafting does not pay), the expected tokens a round
commits (the accepted ones plus the target's bonus token) and the round's duration, and picks
the best rate. Sequential: draft + verify. Overlapped (one branch): while the verifier
verifies, the drafter drafts the next round (gamma + 1 steps: its guess of the bonus token,
then gamma) assuming the whole draft is accepted; that draft is used only when all gamma
tokens and the guess hold (about the chance that gamma + 1 tokens are accepted), otherwise
the next round drafts afresh first. So an overlapped round costs
max((gamma + 1) draft steps, verify) + P(miss) * gamma draft steps.
Depths never tried yet get an optimistic prior, so the controller explores them when the costs
make them plausible; and every ``probe_every`` rounds it tries a neighbour of its choice (gamma
+-1, branches +-1, the other kind of round), so a cost measured once in a bad moment is
measured again instead of ruling that choice out for good.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from hetspec.speculative.branching import branch_length


class WindowedMedian:
    """The median of the last ``window`` samples, forgetting samples older than ``max_age``
    ticks of ``clock`` (the controller's round count): a choice measured long ago, under other
    conditions, then has no estimate and is judged by its prior again (so it gets tried again)
    instead of being ruled out by a stale median that rare probes could not move."""

    def __init__(self, window: int, clock=None, max_age: int | None = None) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._clock = clock or (lambda: 0)
        self._max_age = max_age

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    def _fresh(self) -> list[float]:
        if self._max_age is None:
            return [value for _, value in self._samples]
        oldest = self._clock() - self._max_age
        return [value for tick, value in self._samples if tick >= oldest]

    def __len__(self) -> int:
        return len(self._fresh())

    @property
    def value(self) -> float | None:
        fresh = self._fresh()
        return statistics.median(fresh) if fresh else None


@dataclass(frozen=True)
class Decision:
    gamma: int  # tokens drafted per branch (0: none, the target decodes alone)
    branches: int
    expected_tokens: float  # committed per round, bonus included
    round_s: float
    tokens_per_s: float
    overlap: bool = False  # the drafter drafts the next round while this one is verified
    # DuoDecoding's rule picks the branch count: gamma is then the budget the branches share
    # and branches the most it may pick
    dynamic: bool = False


@dataclass(frozen=True)
class _Line:
    mean_w: float
    mean_t: float
    slope: float
    floor: float

    def at(self, width: int) -> float:
        return max(self.mean_t + self.slope * (width - self.mean_w), self.floor)


@dataclass(frozen=True)
class _Snapshot:
    """Every estimate ``choose`` needs, computed once per decision (it weighs ~100 candidates
    every round, and a round is a few milliseconds)."""

    step: dict[bool, float]  # seconds per draft step of one branch, by "overlapped"
    latency: dict[bool, float]  # a draft call's seconds besides its steps, by "overlapped"
    verify: dict[bool, _Line]
    reach: list[list[float]]  # [branches][depth]: P(the first depth tokens are accepted)
    overhead: float
    branch_cost: float
    alone: float  # seconds of a round without a draft (the target decoding one token)
    dynamic: list[tuple[int, float, list[float]]]  # the rule's rounds: (k, share, reach)

    def step_s(self, branches: int, overlapped: bool = False) -> float:
        return self.step[overlapped] * (1 + self.branch_cost * (branches - 1))

    def draft_s(self, steps: int, branches: int = 1, overlapped: bool = False) -> float:
        """A draft call of ``steps`` steps, from sending it to having its reply."""
        return self.latency[overlapped] + steps * self.step_s(branches, overlapped)

    def tokens(self, gamma: int, branches: int) -> float:
        return 1.0 + sum(self.reach[branches][1 : gamma + 1])  # the bonus always comes


@dataclass
class BudgetController:
    max_gamma: int = 16
    max_branches: int = 4
    max_width: int = 64  # nodes a verification may hold (the arena slot size)
    parallel: bool = True  # overlapped rounds may be chosen (they draft a single branch)
    window: int = 24  # samples per median: re-converges within a few dozen rounds
    decay: float = 0.95  # per-round weight of older acceptance counts
    prior_acceptance: float = 0.8  # for depths not observed yet (optimistic: explore them)
    prior_weight: float = 3.0  # in rounds: one unlucky round must not rule a depth out
    batched_step_cost: float = 0.4  # each extra branch adds this share of a draft step
    warmup_rounds: int = 3  # rounds at gamma = c before acceptance estimates are trusted
    probe_every: int = 16  # rounds between tries of a neighbouring gamma (0: never)
    max_age: int = 96  # rounds after which a cost measurement is forgotten
    dynamic: bool = True  # may choose DuoDecoding's uncertainty rule (plain rounds)
    dynamic_scale: float = 1.0  # the rule's threshold: theta = scale x p1 x p2
    # rounds a choice of gamma 0 is kept without weighing every candidate again: while the
    # target decodes alone only its own cost is measured, and such a round is about a
    # millisecond, of which choosing took a tenth
    keep_alone_rounds: int = 4
    # While the target decodes alone, each probe that finds gamma 0 still best halves how
    # often the next comes (down to one in 2**max_alone_backoff probe slots): a probe is a
    # drafted round plus the drafter catching up on everything since the last, which on the
    # 2-vCPU VM cost adaptive 15% against the target alone where drafting never paid.
    max_alone_backoff: int = 3
    # Drafting stops (gamma 0) only for a rate this much better than the best draft's: the
    # acceptance estimates are noisy, and at gamma 0 none are gathered, so a dip could park
    # the controller there for rounds where drafting was in fact better.
    alone_entry_margin: float = 0.1
    history: list[Decision] = field(default_factory=list)  # the latest decisions
    HISTORY_KEPT = 1024  # a daemon runs for months: older decisions are dropped
    ALONE_MEASURED_AFTER_PROBES = 4  # see _alone_unmeasured

    def __post_init__(self) -> None:
        # keyed by "overlapped": costs differ when both workers compute at once (they share a
        # box: on a 2-vCPU VM a forward took 1.7x as long while the other vCPU was busy)
        self._draft_level = {c: self._median() for c in (False, True)}
        self._draft_latency = {c: self._median() for c in (False, True)}
        self._verify: dict[bool, dict[int, WindowedMedian]] = {False: {}, True: {}}
        self._offered = [0.0] * (self.max_gamma + 1)  # index = depth (1-based)
        self._accepted = [0.0] * (self.max_gamma + 1)
        self._first_offered = [0.0] * (self.max_branches + 1)  # depth 1, by branch count
        self._first_accepted = [0.0] * (self.max_branches + 1)
        # rounds drafted by the rule, by the k it picked: how often, and first-depth acceptance
        # (it branches where the drafter is unsure, so these differ from fixed-k rounds')
        # Every single-branch draft also says which k the rule would have picked (its first two
        # probability rows decide), so the rule's value is known before it is ever used.
        self._rule_picked = [0.0] * (self.max_branches + 1)
        self._rule_offered = [0.0] * (self.max_branches + 1)  # rounds the rule drafted
        self._rule_accepted = [0.0] * (self.max_branches + 1)
        self._single_offered = [0.0] * (self.max_branches + 1)  # one branch, by would-be k
        self._single_accepted = [0.0] * (self.max_branches + 1)
        self._rounds = 0
        self._kept = 0  # rounds the last gamma-0 decision was reused
        self._alone_backoff = 0  # probe slots skipped while alone: 2**this - 1 of every 2**this
        self._alone_probes = 0  # probes taken from gamma 0 (they alternate two kinds)
        self._overhead = self._median()
        # seconds per token of rounds with gamma 0, never forgotten: without it the target
        # alone was priced as a one-node verification (a call per token), twice its cost when
        # it decodes several tokens per call, and drafting looked better than it was
        self._alone = WindowedMedian(self.window)
        self._alone_compute = WindowedMedian(self.window)

    def _median(self) -> WindowedMedian:
        return WindowedMedian(self.window, lambda: self._rounds, self.max_age)

    # ------------------------------------------------------------ measurements

    def record_draft(
        self, steps: int, branches: int, seconds: float, *, overlapped: bool = False
    ) -> None:
        """A draft of ``steps`` steps (one forward each) for ``branches`` branches, alone or
        while the verifier computed (``overlapped``)."""
        if steps > 0 and seconds > 0:
            level = self._draft_level[overlapped]
            level.add(seconds / steps / self._branch_factor(branches))

    def record_draft_latency(self, seconds: float, *, overlapped: bool = False) -> None:
        """A draft call's time besides the worker's own (messages, wake-ups)."""
        self._draft_latency[overlapped].add(max(0.0, seconds))

    def decodes_alone(self) -> bool:
        """Whether the latest decision has the target decode alone (gamma 0)."""
        return bool(self.history) and self.history[-1].gamma == 0

    def target_alone_s(self) -> float | None:
        """Seconds per token the target computes when it decodes alone, once measured: what
        sizes its calls (the round's time per token, call latency included, would shrink
        the calls it is measured on: on a busy VM it settled on one token per call)."""
        return self._alone_compute.value

    def record_target_alone(self, seconds: float, *, compute_s: float | None = None) -> None:
        """A round without a draft: ``seconds`` per token of the whole round, ``compute_s``
        per token of the target's own work. Kept apart from the verify line: a verifier that
        did not wait for a draft meanwhile answers faster than one that did (it was not
        asleep), so width-1 rounds do not fit the line through drafted rounds."""
        if seconds > 0:
            self._alone.add(seconds)
        if compute_s:
            self._alone_compute.add(compute_s)

    def record_overhead(self, seconds: float) -> None:
        """What a round costs besides drafting and verifying: messages, bookkeeping, catching
        the drafter up with the emitted tokens. Added to every candidate's round time."""
        self._overhead.add(max(0.0, seconds))

    def record_verify(self, width: int, seconds: float, *, overlapped: bool = False) -> None:
        if width > 0 and seconds > 0:
            widths = self._verify[overlapped]
            widths.setdefault(width, self._median()).add(seconds)

    def record_round(
        self,
        gamma: int,
        branches: int,
        accepted: int,
        *,
        dynamic: bool = False,
        rule_k: int | None = None,
    ) -> None:
        """A verified round: ``accepted`` of the ``gamma`` tokens on the best branch; with
        ``dynamic``, the rule drafted ``branches`` sequences of ``gamma`` tokens; ``rule_k``:
        the k the rule would have picked for this single-branch draft."""
        self._rounds += 1
        if gamma == 0:  # the target alone: nothing was offered, nothing learned
            return
        for depth in range(1, self.max_gamma + 1):
            self._offered[depth] *= self.decay
            self._accepted[depth] *= self.decay
        for counts in (self._first_offered, self._first_accepted, self._rule_picked,
                       self._rule_offered, self._rule_accepted, self._single_offered,
                       self._single_accepted):  # fmt: skip
            for k in range(1, self.max_branches + 1):
                counts[k] *= self.decay
        for depth in range(2 if dynamic else 1, min(gamma, accepted + 1) + 1):
            self._offered[depth] += 1
            self._accepted[depth] += depth <= accepted
        branches = min(branches, self.max_branches)
        if dynamic:
            rule_k = branches
            self._rule_offered[branches] += 1
            self._rule_accepted[branches] += accepted >= 1
        else:
            self._first_offered[branches] += 1
            self._first_accepted[branches] += accepted >= 1
        if rule_k is not None:
            rule_k = min(max(rule_k, 1), self.max_branches)
            self._rule_picked[rule_k] += 1
            if branches == 1:
                self._single_offered[rule_k] += 1
                self._single_accepted[rule_k] += accepted >= 1

    # ------------------------------------------------------------ estimates

    def _branch_factor(self, branches: int) -> float:
        """A step's cost for ``branches`` branches relative to one branch."""
        return 1 + self.batched_step_cost * (branches - 1)

    def draft_step_s(self, branches: int, overlapped: bool = False) -> float | None:
        """Seconds per draft step; a condition never measured borrows the other's."""
        level = self._draft_level[overlapped].value or self._draft_level[not overlapped].value
        return None if level is None else level * self._branch_factor(branches)

    def draft_latency_s(self, overlapped: bool = False) -> float:
        """A draft call's latency; a condition never measured borrows the other's (0 before
        any: then the steps carry it)."""
        latency = self._draft_latency
        return latency[overlapped].value or latency[not overlapped].value or 0.0

    def verify_s(self, width: int, overlapped: bool = False) -> float | None:
        """Seconds to verify ``width`` nodes; a condition never measured borrows the other's."""
        return self._verify_fit(width, overlapped) or self._verify_fit(width, not overlapped)

    def _verify_fit(self, width: int, overlapped: bool) -> float | None:
        line = self._verify_line(overlapped)
        return None if line is None else line.at(width)

    def _verify_line(self, overlapped: bool, borrow: bool = True) -> _Line | None:
        """A least-squares line (slope >= 0) through the windowed medians per width. Where
        one width only was measured, the slope comes from the other condition's line, scaled
        to this one's level: flat, it priced narrow trees like the one wide tree measured and
        kept the controller from ever trying them."""
        points = [(w, m.value) for w, m in self._verify[overlapped].items() if len(m)]
        if not points:
            return None
        n = len(points)
        mean_w = sum(w for w, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        spread = sum((w - mean_w) ** 2 for w, _ in points)
        slope = 0.0
        if spread > 0:
            slope = max(0.0, sum((w - mean_w) * (t - mean_t) for w, t in points) / spread)
        elif borrow and (other := self._verify_line(not overlapped, borrow=False)):
            slope = other.slope * mean_t / other.at(round(mean_w))
        return _Line(mean_w, mean_t, slope, min(t for _, t in points) * 0.5)

    def acceptance(self, depth: int, branches: int = 1) -> float:
        """P(depth accepted | depth - 1 accepted); at depth 1 with ``branches`` candidates."""
        if depth == 1:
            offered, accepted = self._first_offered[branches], self._first_accepted[branches]
            seen = max(range(1, self.max_branches + 1), key=self._first_offered.__getitem__)
            if offered < 1 and self._first_offered[seen] >= 1:
                # unseen: infer from the branch count seen most, as independent tries
                single = 1 - (1 - self.acceptance(1, seen)) ** (1 / seen)
                return 1 - (1 - single) ** branches
        else:
            offered, accepted = self._offered[depth], self._accepted[depth]
        prior = self.prior_acceptance * self.prior_weight
        return (accepted + prior) / (offered + self.prior_weight)

    def rule_acceptance(self, branches: int) -> float:
        """P(depth 1 accepted) when the rule picks ``branches``: from the rounds it drafted,
        and before those from single-branch rounds it would have given ``branches`` (as
        independent tries), else from all single-branch rounds."""
        w = self.prior_weight
        single = self.acceptance(1, 1)
        single = (self._single_accepted[branches] + single * w) / (
            self._single_offered[branches] + w
        )
        inferred = 1 - (1 - single) ** branches
        offered, accepted = self._rule_offered[branches], self._rule_accepted[branches]
        return (accepted + inferred * w) / (offered + w)

    def rule_shares(self) -> list[tuple[int, float]]:
        """(k, how often the rule picks k), from recent rule rounds; k = 1 before any."""
        total = sum(self._rule_picked)
        if total < 1e-9:
            return [(1, 1.0)]
        return [(k, n / total) for k, n in enumerate(self._rule_picked) if n > 0]

    def expected_tokens(self, gamma: int, branches: int = 1) -> float:
        total, reach = 1.0, 1.0  # the bonus token always comes
        for depth in range(1, gamma + 1):
            reach *= self.acceptance(depth, branches)
            total += reach
        return total

    def reach(self, depth: int, branches: int = 1) -> float:
        """P(the first ``depth`` drafted tokens are all accepted)."""
        chance = 1.0
        for d in range(1, depth + 1):
            chance *= self.acceptance(min(d, self.max_gamma), branches)
        return chance

    # ------------------------------------------------------------ decisions

    def cost_ratio(self) -> float | None:
        """DuoDecoding's c = T_verify / T_draft, once both were measured."""
        step, verify = self.draft_step_s(1), self.verify_s(2)
        return None if step is None or verify is None else verify / step

    def estimates(self) -> dict:
        """What the controller believes now, in milliseconds, for the request statistics."""

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        decision = self.history[-1] if self.history else None
        return {
            "draft_step_ms": {"alone": ms(self._draft_level[False].value),
                              "overlapped": ms(self._draft_level[True].value)},
            "draft_latency_ms": {"alone": ms(self._draft_latency[False].value),
                                 "overlapped": ms(self._draft_latency[True].value)},
            "verify_ms": {kind: {w: ms(self._verify_fit(w, c)) for w in (1, 2, 5, 9, 17)}
                          for kind, c in (("alone", False), ("overlapped", True))},
            "overhead_ms": ms(self._overhead.value),
            "target_alone_round_ms": ms(self._alone.value),
            "acceptance_by_depth": [round(self.acceptance(d), 3) for d in range(1, 9)],
            "last_decision": None if decision is None else {
                "gamma": decision.gamma, "branches": decision.branches,
                "overlap": decision.overlap,
                "expected_tokens": round(decision.expected_tokens, 3),
                "expected_tokens_per_s": round(decision.tokens_per_s, 1)},
        }  # fmt: skip

    def _snapshot(self) -> _Snapshot:
        step = {c: self.draft_step_s(1, c) for c in (False, True)}
        latency = {c: self.draft_latency_s(c) for c in (False, True)}
        verify = {c: self._verify_line(c) or self._verify_line(not c) for c in (False, True)}
        reach = [[]]
        for branches in range(1, self.max_branches + 1):
            chances = [1.0]
            for depth in range(1, self.max_gamma + 2):
                chances.append(chances[-1] * self.acceptance(min(depth, self.max_gamma), branches))
            reach.append(chances)
        overhead = self._overhead.value or 0.0
        plain = verify[False]
        alone = self._alone.value or (plain.at(1) + overhead if plain else float("inf"))
        dynamic = []
        for k, share in self.rule_shares() if self.dynamic and self.max_branches > 1 else []:
            chances = [1.0, self.rule_acceptance(k)]
            for depth in range(2, self.max_gamma + 1):
                chances.append(chances[-1] * self.acceptance(depth, k))
            dynamic.append((k, share, chances))
        return _Snapshot(step, latency, verify, reach, overhead, self.batched_step_cost, alone,
                         dynamic)  # fmt: skip

    def choose(self) -> Decision:
        last = self.history[-1] if self.history else None
        alone = last is not None and last.gamma == 0
        probe_due = self.probe_every and self._rounds % self.probe_every == 0
        if probe_due and alone:  # thinned out while the target keeps decoding alone
            probe_due = (self._rounds // self.probe_every) % (1 << self._alone_backoff) == 0
        if alone and self._kept < self.keep_alone_rounds and not probe_due:
            self._kept += 1
            self.history.append(last)
            return last
        self._kept = 0
        ratio = self.cost_ratio()
        if ratio is None:
            decision = Decision(1, 1, 1.0, 0.0, 0.0)  # nothing measured yet: a 1-token round
        elif self._rounds < self.warmup_rounds:  # no acceptance data yet: DuoDecoding's gamma = c
            gamma = max(1, min(self.max_gamma, round(ratio), self.max_width - 1))
            decision = self._evaluate(gamma, 1, self.parallel)
        else:
            snapshot = self._snapshot()
            entry = 1.0 if alone else 1 / (1 + self.alone_entry_margin)
            _, gamma, branches, overlap = max(self._rates(snapshot, entry))
            # (a negative branch count marks the rule's candidates, to keep the tuples cheap)
            decision = self._evaluate(gamma, max(branches, 1), overlap, snapshot,
                                      dynamic=branches < 0)  # fmt: skip
            if decision.gamma:
                self._alone_backoff = 0
            elif probe_due:
                self._alone_backoff = min(self._alone_backoff + 1, self.max_alone_backoff)
            if probe_due:
                decision = self._neighbour(decision, snapshot)
            elif decision.gamma and self._alone_unmeasured():
                decision = self._evaluate(0, 1, False, snapshot)
            if decision.gamma == 0 and self.history and self.history[-1].gamma:
                # a trial of gamma 0: two rounds, not kept as a choice is (the engine measures
                # only the second: the first is a transition from drafting)
                self._kept = self.keep_alone_rounds - 1
        self.history.append(decision)
        if len(self.history) > 2 * self.HISTORY_KEPT:
            del self.history[: self.HISTORY_KEPT]
        return decision

    def _alone_unmeasured(self) -> bool:
        """Whether this round should measure the target alone, never measured yet: its price
        is a guess then (a one-node verification, dearer than decoding alone, where calls
        take several tokens and the verifier may borrow the drafter's cores). One round, half
        way between probes, so the probes' cycle stays as it is, and only after a few probe
        cycles: earlier, while the drafting shape first settles, it slowed that down (the
        simulated boxes' settled rate 0.5% lower)."""
        half, rounds = self.probe_every // 2, self._rounds
        settled = rounds >= self.ALONE_MEASURED_AFTER_PROBES * self.probe_every
        return not len(self._alone) and settled and half > 0 and rounds % self.probe_every == half

    def _neighbour(self, best: Decision, snapshot: _Snapshot) -> Decision:
        """By turns: gamma - 1, gamma + 1, one branch less, one branch more, and another kind
        of round: alternately overlapped or not (when overlapping is allowed) and drafted by
        the rule or with fixed branches (when the rule is); where allowed."""
        others = ["overlap"] * self.parallel + ["rule"] * bool(snapshot.dynamic)
        turns = ["shorter", "longer", "fewer", "more"] + ["other"] * bool(others)
        probe = self._rounds // self.probe_every
        turn = turns[probe % len(turns)]
        if turn == "other":  # the kinds of round take turns, keeping the cycle short
            turn = others[probe // len(turns) % len(others)]
        if best.gamma == 0:  # from the target alone only a draft is a neighbour
            self._alone_probes += 1
            turn = ["longer", "overlap"][self._alone_probes % 2] if self.parallel else "longer"
        if turn == "rule":
            if best.dynamic:
                return self._evaluate(best.gamma, 1, False, snapshot)
            if best.gamma >= 2:
                return self._evaluate(best.gamma, 1, False, snapshot, dynamic=True)
            return best
        gamma = best.gamma + {"shorter": -1, "longer": 1}.get(turn, 0)
        branches = (1 if best.dynamic else best.branches) + {"fewer": -1, "more": 1}.get(turn, 0)
        if turn == "overlap":
            gamma = max(gamma, 1)
        overlap = best.overlap != (turn == "overlap") and gamma > 0
        if overlap:
            branches = 1
        if (int(overlap) <= gamma <= self.max_gamma and 1 <= branches <= self.max_branches
                and gamma * branches + 1 <= self.max_width):  # fmt: skip
            return self._evaluate(gamma, branches, overlap, snapshot)
        return best

    def _evaluate(
        self,
        gamma: int,
        branches: int,
        overlap: bool = False,
        snapshot: _Snapshot | None = None,
        dynamic: bool = False,
    ) -> Decision:
        s = snapshot or self._snapshot()
        if gamma == 0:
            return Decision(0, 1, 1.0, s.alone, 1 / s.alone)
        if dynamic and s.dynamic:
            tokens, round_s = self._rule_round(s, gamma)
            return Decision(gamma, self.max_branches, tokens, round_s, tokens / round_s,
                            dynamic=True)  # fmt: skip
        verify_s = s.verify[overlap].at(gamma * branches + 1)  # the tree plus the last bonus
        if overlap:
            held = s.reach[1][gamma + 1]  # the run-ahead becomes the next draft
            fresh_s = s.draft_s(gamma)  # otherwise the next round drafts alone first
            round_s = max(s.draft_s(gamma + 1, 1, True), verify_s) + (1 - held) * fresh_s
        else:
            round_s = s.draft_s(gamma, branches) + verify_s
        round_s += s.overhead
        tokens = s.tokens(gamma, branches)
        return Decision(gamma, branches, tokens, round_s, tokens / round_s, overlap)

    def _rule_round(self, s: _Snapshot, budget: int) -> tuple[float, float]:
        """Expected tokens and seconds of a round drafted by the rule with ``budget``, over
        the branch counts it has been picking: k sequences of budget // k tokens, drafted in
        budget forwards when k = 1 and budget // k + 1 otherwise (the rule's probe)."""
        plain, tokens, round_s = s.verify[False], 0.0, s.overhead
        for k, share, reach in s.dynamic:
            length = branch_length(budget, k)
            forwards = budget if k == 1 else length + 1
            tokens += share * (1.0 + sum(reach[1 : length + 1]))
            round_s += share * (s.draft_s(forwards, k) + plain.at(k * length + 1))
        return tokens, round_s

    def _rates(self, s: _Snapshot, alone_weight: float = 1.0):
        """(expected tokens/s, gamma, branches, overlap) of every candidate: ``_evaluate``'s
        arithmetic, inlined, because it runs ~100 times a round. The target alone's rate is
        weighed by ``alone_weight``."""
        overhead, plain, ahead = s.overhead, s.verify[False], s.verify[True]
        latency, ahead_latency = s.latency[False], s.latency[True]
        yield alone_weight / s.alone, 0, 1, False  # no draft: the target alone
        for branches in range(1, self.max_branches + 1):
            step, reach, tokens = s.step_s(branches), s.reach[branches], 1.0
            for gamma in range(1, self.max_gamma + 1):
                if gamma * branches + 1 > self.max_width:
                    break
                tokens += reach[gamma]
                fresh = latency + gamma * step
                round_s = fresh + plain.at(gamma * branches + 1) + overhead
                yield tokens / round_s, gamma, branches, False
                if self.parallel and branches == 1:
                    run_ahead = ahead_latency + (gamma + 1) * s.step_s(1, True)
                    both = max(run_ahead, ahead.at(gamma + 1))
                    round_s = both + (1 - reach[gamma + 1]) * fresh + overhead
                    yield tokens / round_s, gamma, 1, True
        if s.dynamic:  # drafted by the rule, as a plain round (branches = the cap)
            for budget in range(2, min(self.max_gamma, self.max_width - 1) + 1):
                tokens, round_s = self._rule_round(s, budget)
                yield tokens / round_s, budget, -self.max_branches, False
