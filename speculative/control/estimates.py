"""What the controller has measured, learned from round reports only.

- A draft step: a level (a windowed median of recent steps, each scaled to one branch, so
  every round refreshes it whatever its branch count; a median, so one preempted step does
  not swing it) times a branch factor: per branch count, the windowed median of its steps
  against the chains' level when they were drafted (a ratio: it holds when the level moves,
  so it is kept once stale rather than forgotten); unmeasured counts extrapolate the nearest
  measured one's cost per extra branch, or before any ``branch_cost``. A draft call's
  latency (its link and the drafter's catch-up) is paid once per call.
- A verification: through windowed medians per tree width (weighted by their samples), the
  verifier's profile raised and stretched to them where it was measured, else a line.
- Acceptance by depth (and at depth 1 by branch count, and by the branch count the rule picks):
  exponentially decayed counts, so old behaviour fades within a few dozen rounds. A branched
  round also counts at depth 1 for one branch: its first branch holds the draft's own
  choices, the chain a one-branch round would have drafted, so chains' acceptance follows the
  text while branches are drafted (docs/design-notes.md, "Chains learned while branching").
- The target alone: its seconds per token, kept apart from the verify line (a verifier that
  did not wait for a draft answers faster), never forgotten but stale after
  ``alone_max_age`` rounds: the controller then measures it again.
- Before a cost is measured, the verifier's forward costs measured at load (the runtime
  choice's profile), where the daemon has them: ``assume_verifier``; after, their shape.
Costs are kept apart for plain rounds and overlapped ones (``ByOverlap``). Each quantity has
its tracker (``trackers``: windowed medians, decayed rates, delivered against predicted), and
a verification's cost by width is fitted through its medians (``verify_fit``). Medians
forget samples older than ``max_age`` rounds, so a choice measured long ago is judged by its
prior again (and tried again) rather than ruled out by a stale figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetspec.speculative.control.cost_model import (
    ByOverlap,
    CostModel,
    ProfileCurve,
    ProfiledVerify,
    RuleShare,
    VerifyCost,
    VerifyLine,
    linear_branch_factor,
)
from hetspec.speculative.control.rounds import NO_ONE_BESIDE, Beside, DraftCall, RoundReport
from hetspec.speculative.control.trackers import DecayedRate, Delivered, WindowedMedian
from hetspec.speculative.control.verify_fit import fit_line, fit_profile, scaled


@dataclass(frozen=True)
class EstimateConfig:
    max_gamma: int = 16
    max_branches: int = 4
    window: int = 24  # samples per median: re-converges within a few dozen rounds
    max_age: int = 96  # rounds after which a cost measurement is forgotten
    # rounds after which the target alone's cost is stale (still used until measured again):
    # measured once while drafting looks better, one bad moment would price it for good
    alone_max_age: int = 512
    decay: float = 0.95  # per-round weight of older acceptance counts
    prior_acceptance: float = 0.8  # for depths not observed yet (optimistic: explore them)
    prior_weight: float = 3.0  # in rounds: one unlucky round must not rule a depth out
    branch_cost: float = 0.4  # each extra branch adds this share of a draft step, unmeasured
    # P(a sibling's token is accepted at depth 1 | the draft's own first choice was not), each
    # sibling, until branched rounds measure it: far below the first choice's own rate, as
    # the round logs showed (docs/design-notes.md, "Chains learned while branching")
    prior_rescue: float = 0.3
    # At a new request, acceptance counts are cut to this many rounds' worth (0: kept): what
    # a draft accepts depends on the text, so earlier requests' counts are a prior that the
    # request's own rounds soon outweigh (a request's first probe among them)
    request_acceptance_rounds: float = 6.0
    # per drafted round, and per round of the target alone (evidence fades slowly while no
    # new comes), the weight of older rounds in what drafting delivered against its
    # prediction; and the predicted tokens of a prior that delivered as predicted
    delivered_decay: float = 0.95
    delivered_alone_decay: float = 0.99
    delivered_prior_tokens: float = 8.0
    # the share below which drafting is priced at what it delivered: above it the model's
    # own errors (a depth's optimistic prior, noise) are small, and its shapes differ in them
    delivered_trusted_above: float = 0.8


class Estimates:
    def __init__(self, config: EstimateConfig = EstimateConfig()) -> None:
        self.config = c = config
        self.rounds = 0  # rounds observed: the medians' clock
        self._draft_level = ByOverlap(self._median(), self._median())
        self._draft_latency = ByOverlap(self._median(), self._median())
        # verifications of one chain, by tree width
        self._verify: ByOverlap[dict[int, WindowedMedian]] = ByOverlap({}, {})
        self._branched: dict[int, WindowedMedian] = {}  # verifications of several branches
        self._overhead = self._median()
        # never forgotten (without it the target alone is priced as a one-node verification),
        # but measured again once stale
        self._alone = self._median(c.alone_max_age, keep_last=True)
        self._alone_compute = self._median(c.alone_max_age, keep_last=True)
        # a token of the target alone in forwards shared with other requests' rows
        self._alone_beside = self._median()
        self._depth = DecayedRate(c.max_gamma + 1)  # index: depth (1-based)
        # a draft step of b branches against the chains' level at the time (b >= 2)
        self._branch_ratio: dict[int, WindowedMedian] = {}
        self._first = DecayedRate(c.max_branches + 1)  # depth 1, by branch count
        # depth 1 where the first branch lost it: kept by a sibling, by branch count
        self._rescue = DecayedRate(c.max_branches + 1)
        # the rule branches where the drafter is unsure, so its rounds' first-depth acceptance
        # differs from fixed-k rounds'; every single-branch draft also says which k the rule
        # would have picked, so the rule's value is known before it is ever used
        self._rule_picked = np.zeros(c.max_branches + 1)
        self._rule_first = DecayedRate(c.max_branches + 1)  # rounds the rule drafted, by k
        self._single_first = DecayedRate(c.max_branches + 1)  # one branch, by would-be k
        self._profile: ProfileCurve | None = None  # the verifier's, measured before serving
        # verify_line's fits until a verification or a round is observed: a choice prices
        # dozens of widths (a dynamic tree's best_width), each fit a pass over the medians
        self._verify_samples = 0
        self._fits: dict[tuple[bool, bool], VerifyCost | None] = {}  # by (overlapped, borrow)
        self._fits_at = (-1, -1)  # (rounds, verification samples) the fits are of
        self._overlap_factor = 1.0  # an overlapped verification against a plain one, unmeasured
        self._delivered = Delivered()

    def _median(self, max_age: int | None = None, *, keep_last: bool = False) -> WindowedMedian:
        """A median on the rounds' clock, forgetting samples ``max_age`` rounds old (default:
        the config's ``max_age``)."""
        return WindowedMedian(
            self.config.window,
            lambda: self.rounds,
            max_age or self.config.max_age,
            keep_last=keep_last,
        )

    # ------------------------------------------------------------ learning

    def observe(self, report: RoundReport) -> None:
        config = self.config
        self._delivered.decay(
            config.delivered_decay if report.gamma else config.delivered_alone_decay
        )
        for call in report.drafts:
            self._observe_draft(call)
        if report.gamma == 0 and report.batch_rows > 1:  # beside others: not its own price
            if report.alone_round_s:
                self._alone_beside.add(report.alone_round_s)
        elif report.gamma == 0:
            if report.alone_round_s:
                self._alone.add(report.alone_round_s)
            if report.alone_compute_s:
                self._alone_compute.add(report.alone_compute_s)
        else:
            if report.verify_width > 0 and report.verify_s > 0:
                branched = report.branches > 1 and not report.verify_overlapped
                widths = self._branched if branched else self._verify.of(report.verify_overlapped)
                # a forward shared with other requests' rows cost what its whole width does
                width = max(report.verify_width, report.batch_rows)
                widths.setdefault(width, self._median()).add(report.verify_s)
                self._verify_samples += 1
            self._overhead.add(max(0.0, report.overhead_s))
        if report.lookup is None:  # a model-free draft's acceptance is not the draft model's
            self._observe_acceptance(report)

    def _observe_draft(self, call: DraftCall) -> None:
        if call.steps > 0 and call.compute_s > 0:
            step, level = call.compute_s / call.steps, self._draft_level.of(call.overlapped)
            branches = min(call.branches, self.config.max_branches)
            if branches > 1:
                if level.value:
                    ratio = self._branch_ratio.setdefault(branches, self._median(keep_last=True))
                    ratio.add(step / level.value)
                step /= float(self.branch_factor()[branches])  # a float: the summary is JSON
            level.add(step)
        # paid once a call: the link, and the catch-up (one forward or none, in a round)
        self._draft_latency.of(call.overlapped).add(max(0.0, call.latency_s + call.catch_up_s))

    def _observe_acceptance(self, report: RoundReport) -> None:
        self.rounds += 1
        if report.gamma == 0:  # nothing was offered, nothing learned
            return
        decay, top = self.config.decay, self.config.max_branches
        for rate in self._rates():
            rate.decay(decay)
        self._rule_picked *= decay
        accepted = report.accepted
        for depth in range(2, min(report.gamma, accepted + 1) + 1):
            self._depth.add(depth, depth <= accepted)
        branches, rule_k = min(report.branches, top), report.rule_k
        if report.rule:
            rule_k = branches
            self._rule_first.add(branches, accepted >= 1)
        elif branches > 1:
            self._first.add(branches, accepted >= 1)
            if report.first_branch_accepted == 0:
                self._rescue.add(branches, accepted >= 1)
        # every round's first branch holds the draft's own choices: a chain's first token
        first_branch = accepted if branches == 1 else report.first_branch_accepted
        if first_branch is not None:
            self._first.add(1, first_branch >= 1)
        if rule_k is not None:
            rule_k = min(max(rule_k, 1), top)
            self._rule_picked[rule_k] += 1
            if branches == 1:
                self._single_first.add(rule_k, accepted >= 1)

    def begin_request(self) -> None:
        """A new request, a new text: earlier acceptance becomes a prior of limited weight."""
        rounds = self.config.request_acceptance_rounds
        if rounds > 0:
            for rate in self._rates():
                rate.cap(rounds)
            self._delivered.cap(rounds * 2)  # about two tokens a round

    def _rates(self) -> tuple[DecayedRate, ...]:
        return (self._depth, self._first, self._rescue, self._rule_first, self._single_first)

    def assume_verifier(self, seconds_by_width: dict[int, float]) -> None:
        """Forward costs of the verifier measured before serving ({width: seconds}, width 1
        included): they price the target alone and verifications until rounds measure them,
        and then give the shape the measured verifications are fitted to. Without them the
        target alone, never measured, was priced as a verification timed while the drafter
        drafted beside it, many times dearer than it is (docs/design-notes.md)."""
        if 1 not in seconds_by_width or min(seconds_by_width.values()) <= 0:
            raise ValueError(
                f"a verifier profile needs positive costs from width 1 on, not {seconds_by_width}"
            )
        widths = np.array(sorted(seconds_by_width), float)
        times = np.array([seconds_by_width[int(w)] for w in widths])
        self._profile = ProfileCurve(tuple(widths.tolist()), tuple(times.tolist()))
        self._verify_samples += 1

    # ------------------------------------------------------------ costs

    def branch_factor(self) -> np.ndarray:
        """[branches]: a draft step of that many branches in chain steps (index 0 unused)."""
        config = self.config
        factors = linear_branch_factor(config.branch_cost, config.max_branches)
        measured = {b: m.value for b, m in self._branch_ratio.items() if m.value is not None}
        for branches in range(2, config.max_branches + 1):
            if branches in measured:
                factors[branches] = max(1.0, measured[branches])
            elif measured:  # the nearest measured count's cost per extra branch
                near = min(measured, key=lambda b: (abs(b - branches), b))
                per_branch = max(0.0, measured[near] - 1) / (near - 1)
                factors[branches] = 1 + per_branch * (branches - 1)
        return factors

    def draft_step_s(self, overlapped: bool = False) -> float | None:
        """Seconds per draft step of one branch; a kind of round (plain, overlapped) never
        measured borrows the other's."""
        level = self._draft_level
        return level.of(overlapped).value or level.of(not overlapped).value

    def draft_latency_s(self, overlapped: bool = False) -> float:
        latency = self._draft_latency
        return latency.of(overlapped).value or latency.of(not overlapped).value or 0.0

    def verify_line(self, overlapped: bool, borrow: bool = True) -> VerifyCost | None:
        """Through the medians per width, each weighted by its samples (a width tried once,
        as the first rounds try 2, must not tilt what dozens of rounds put through theirs):
        where the verifier's profile is known, the profile's curve raised and stretched to
        them (``verify_fit.fit_profile``); else a least-squares line (slope >= 0). Where one
        width only was measured, the line's slope comes from the other kind's line, scaled to
        this one's level: flat, it priced narrow trees like the one wide tree measured."""
        if self._fits_at != (self.rounds, self._verify_samples):
            self._fits_at, self._fits = (self.rounds, self._verify_samples), {}
        if (overlapped, borrow) not in self._fits:
            self._fits[overlapped, borrow] = self._fit_verify(overlapped, borrow)
        return self._fits[overlapped, borrow]

    def _fit_verify(self, overlapped: bool, borrow: bool) -> VerifyCost | None:
        points = self._points(self._verify.of(overlapped))
        if not points and not overlapped:  # only trees verified so far: priced as chains
            points = self._points(self._branched)
        if not points:
            return None
        widths, times, samples = np.array(points).T
        if self._profile is not None:
            return fit_profile(self._profile, widths, times, samples)
        line = fit_line(widths, times, samples)
        if len(points) == 1 and borrow:  # one width: no slope of its own
            other = self.verify_line(not overlapped, borrow=False)
            if other is not None:
                slope = other.slope * line.mean_t / float(other.at(round(line.mean_w)))
                line = VerifyLine(line.mean_w, line.mean_t, slope, line.floor)
        return line

    @staticmethod
    def _points(medians: dict[int, WindowedMedian]) -> list[tuple[int, float, int]]:
        """(width, median, samples) of the widths with fresh samples."""
        points = [(w, *m.median_and_count()) for w, m in medians.items()]
        return [point for point in points if point[2]]

    def branched_verify(self, line: VerifyCost | None = None) -> float:
        """What a verification of several branches costs against one chain of its width (the
        chains' line, ``line`` where the caller has fitted it): the samples' weighted mean
        ratio, 1 until both were measured."""
        chains = self._points(self._verify.plain)
        trees = self._points(self._branched)
        if not chains or not trees:
            return 1.0
        line = line or self.verify_line(False)
        ratios = [(median / float(line.at(width)), count) for width, median, count in trees]
        return float(np.average([r for r, _ in ratios], weights=[c for _, c in ratios]))

    def assume_overlap_factor(self, factor: float) -> None:
        """Until measured, an overlapped verification costs ``factor`` times a plain one (a
        verifier that computes on the drafter's cores while it idles, as the load profile was
        timed, does without them beside a drafting drafter: 2 on a 2-core box)."""
        if factor < 1:
            raise ValueError(f"an overlap factor must be >= 1, not {factor}")
        self._overlap_factor = factor

    def _verify_or_stand_in(self, overlapped: bool) -> VerifyCost | None:
        """This kind's line; where never measured, the profile measured at load, then
        the other kind's line, each as ``assume_overlap_factor`` relates them."""
        line = self.verify_line(overlapped)
        if line is not None:
            return line
        factor = self._overlap_factor
        if self._profile is not None:  # timed as plain rounds verify
            return ProfiledVerify(self._profile, 0.0, factor if overlapped else 1.0, 0.0)
        other = self.verify_line(not overlapped)
        return None if other is None else scaled(other, factor if overlapped else 1 / factor)

    def verify_s(self, width: int, overlapped: bool = False) -> float | None:
        line = self._verify_or_stand_in(overlapped)
        return None if line is None else float(line.at(width))

    def verify_size(self, width: int) -> float:
        """What a ``width``-node verification costs in one-node verifications, by the profile
        measured at load (without one: ``width``), so that calls of different widths compare."""
        if self._profile is None:
            return float(width)
        return float(self._profile.at(width) / self._profile.at(1))

    def cost_ratio(self) -> float | None:
        """DuoDecoding's c = T_verify / T_draft, once both were measured."""
        step, verify = self.draft_step_s(), self.verify_s(2)
        return None if step is None or verify is None else verify / step

    def alone_s(self) -> float | None:
        """Seconds per token of the target alone, its calls' overhead included: as measured,
        else by the load profile (a call decoding alone carries many tokens), else by a
        one-node verification; None before anything was."""
        if self._alone.value:
            return self._alone.value
        if self._profile is not None:
            return float(self._profile.at(1))
        verify = self._verify_or_stand_in(False)
        return None if verify is None else float(verify.at(1)) + self.overhead_s()

    def overhead_s(self) -> float:
        """A drafting round's own seconds besides its calls (the daemon's), as measured."""
        return self._overhead.value or 0.0

    def target_alone_s(self) -> float | None:
        """The target's own seconds per token decoding alone, once measured."""
        return self._alone_compute.value

    def observe_delivery(self, report: RoundReport, predicted_rate: float) -> None:
        """A drafted round measured whole (``report.period_s``, less any wait for the
        drafter's prefill), against the rate its plan was predicted to deliver."""
        if report.period_s <= 0 or predicted_rate <= 0:
            return
        waited = sum(call.prefill_wait_s for call in report.drafts)
        predicted = predicted_rate * max(report.period_s - waited, 0.0)
        self._delivered.add(report.accepted + 1, predicted)

    def delivered_share(self) -> float:
        """Drafted rounds' committed tokens over their prediction lately (see ``Delivered``),
        where clearly below 1; else 1 (also until measured)."""
        share = self._delivered.share(self.config.delivered_prior_tokens)
        return share if share < self.config.delivered_trusted_above else 1.0

    def alone_measured(self) -> bool:
        """Whether the target alone's cost was measured within ``alone_max_age`` rounds."""
        return len(self._alone) > 0

    # ------------------------------------------------------------ acceptance

    def _rate(self, rate: DecayedRate, index: int, prior: float) -> float:
        return float(rate.rate(index, prior, self.config.prior_weight))

    def acceptance(self, depth: int, branches: int = 1) -> float:
        """P(depth accepted | depth - 1 accepted); at depth 1 with ``branches`` candidates:
        the first branch's (a chain's, measured every round) or else a sibling's rescue
        (measured where branched rounds report their first branch; ``prior_rescue`` a
        sibling before), so branches follow the text as chains do."""
        prior = self.config.prior_acceptance
        if depth > 1:
            return self._rate(self._depth, depth, prior)
        single = self._rate(self._first, 1, prior)
        if branches == 1:
            return single
        if self._rescue.tries.sum() < 1e-9 and self._first.tries[branches] >= 1:
            # branched rounds that never said which branch kept depth 1: as they measured it
            return self._rate(self._first, branches, prior)
        sibling_prior = 1 - (1 - self.config.prior_rescue) ** (branches - 1)
        rescue = self._rate(self._rescue, branches, sibling_prior)
        return 1 - (1 - single) * (1 - rescue)

    def rule_acceptance(self, k: int) -> float:
        """P(depth 1 accepted) when the rule picks ``k``: from the rounds it drafted, and
        before those from single-branch rounds it would have given ``k`` (as independent
        tries), else from all single-branch rounds."""
        single = self._rate(self._single_first, k, self.acceptance(1, 1))
        return self._rate(self._rule_first, k, 1 - (1 - single) ** k)

    def rule_shares(self) -> list[tuple[int, float]]:
        """(k, how often the rule picks k), from recent rounds; k = 1 before any."""
        total = self._rule_picked.sum()
        if total < 1e-9:
            return [(1, 1.0)]
        return [(k, float(n / total)) for k, n in enumerate(self._rule_picked) if n > 0]

    def reach(self, branches: int) -> np.ndarray:
        """[depth]: P(the first depth tokens accepted), depth 0 .. max_gamma + 1."""
        return _reach_rows([self.acceptance(1, branches)], self._deeper_acceptance())[0]

    def _deeper_acceptance(self) -> np.ndarray:
        """acceptance(d) for d = 2 .. max_gamma + 1 (the last depth's for the one beyond)."""
        config, top = self.config, self.config.max_gamma
        deeper = np.minimum(np.arange(2, top + 2), top)
        return self._depth.rate(deeper, config.prior_acceptance, config.prior_weight)

    # ------------------------------------------------------------ the model

    def cost_model(self, rule: bool, beside: Beside = NO_ONE_BESIDE) -> CostModel | None:
        """The costs and acceptance as measured; None before a draft and a verification
        were; ``rule``: include the rule's rounds as candidates; ``beside``: what the
        requests decoding at the same time put in each forward."""
        step = ByOverlap(self.draft_step_s(False), self.draft_step_s(True))
        verify = ByOverlap(self._verify_or_stand_in(False), self._verify_or_stand_in(True))
        if step.plain is None or verify.plain is None:
            return None
        deeper = self._deeper_acceptance()
        branches = range(1, self.config.max_branches + 1)
        reach = _reach_rows([0.0] + [self.acceptance(1, b) for b in branches], deeper)
        reach[0] = 0.0  # unused: no round drafts zero branches
        overhead = self.overhead_s()
        alone = self.alone_s()
        shares = ()
        if rule:
            picked = self.rule_shares()
            rows = _reach_rows([self.rule_acceptance(k) for k, _ in picked], deeper)
            shares = tuple(
                RuleShare(k, share, row) for (k, share), row in zip(picked, rows, strict=True)
            )
        latency = ByOverlap(self.draft_latency_s(False), self.draft_latency_s(True))
        return CostModel(
            step,
            latency,
            verify,
            reach,
            overhead,
            self.branch_factor(),
            alone,
            shares,
            self.branched_verify(verify.plain),
            beside,
            self._alone_beside.value if beside.rows else None,
        )

    def summary(self) -> dict:
        """What is believed now, in milliseconds, for the request statistics."""

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        def fit(width: int, overlapped: bool) -> float | None:
            line = self.verify_line(overlapped)
            return None if line is None else ms(float(line.at(width)))

        return {
            "draft_step_ms": {
                "plain": ms(self._draft_level.plain.value),
                "overlapped": ms(self._draft_level.overlapped.value),
            },
            "draft_latency_ms": {
                "plain": ms(self._draft_latency.plain.value),
                "overlapped": ms(self._draft_latency.overlapped.value),
            },
            "verify_ms": {
                kind: {w: fit(w, o) for w in (1, 2, 5, 9, 17)}
                for kind, o in (("plain", False), ("overlapped", True))
            },
            # what the line is fitted through: {width: [median, samples]}
            "verify_medians_ms": {
                kind: {
                    w: [ms(m.value), len(m)]
                    for w, m in sorted(self._verify.of(o).items())
                    if len(m)
                }
                for kind, o in (("plain", False), ("overlapped", True))
            },
            "branched_verify": round(self.branched_verify(), 3),
            "branch_factor": [round(f, 2) for f in self.branch_factor()[2:].tolist()],
            "overhead_ms": ms(self._overhead.value),
            "target_alone_round_ms": ms(self._alone.value),
            "target_alone_beside_others_round_ms": ms(self._alone_beside.value),
            "delivered_share": round(self.delivered_share(), 3),
            "acceptance_by_depth": [round(self.acceptance(d), 3) for d in range(1, 9)],
        }


def _reach_rows(firsts: list[float], deeper: np.ndarray) -> np.ndarray:
    """[row, depth]: P(the first depth tokens accepted), depth 0 .. max_gamma + 1, for each
    first-token acceptance in ``firsts`` over the same later depths (``deeper``)."""
    steps = np.empty((len(firsts), len(deeper) + 2))
    steps[:, 0] = 1.0
    steps[:, 1] = firsts
    steps[:, 2:] = deeper
    return np.cumprod(steps, axis=1)
