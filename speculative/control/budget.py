"""The budget controller: each round's shape, chosen for the most committed tokens per second.

DuoDecoding sets the draft length gamma once, to c = T_verify / T_draft. That is the right
start (the controller uses it for its first rounds), but the box changes under us: another
process takes a core, the prompt grows. So the controller maximizes

    expected tokens committed per round / expected seconds per round

over every shape a round may take (gamma 0..max_gamma, branches, overlapped or not, drafted by
DuoDecoding's uncertainty rule or not, the target alone), with costs and acceptance re-measured
from every round (``estimates``), predicted by one model (``cost_model``), searched in one
vectorized pass (``planning``), and now and then a neighbouring shape tried instead
(``exploration``), so that a choice judged in a bad moment is measured again.

The protocol: ``choose()`` returns a ``Choice`` and changes nothing; ``commit(choice)``
makes it the round that runs; ``observe(report)`` learns from the round's report. A choice
made ahead for a round that never runs is simply dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetspec.speculative.control import exploration as explore
from hetspec.speculative.control.estimates import EstimateConfig, Estimates
from hetspec.speculative.control.exploration import ExplorationConfig, ExplorationState
from hetspec.speculative.control.planning import Limits, best_plan, plan_of
from hetspec.speculative.control.rounds import NO_ONE_BESIDE, Beside, Plan, RoundReport
from hetspec.speculative.drafting.dynamic_tree import Calibration, FirstChoice, best_width


@dataclass(frozen=True)
class ControllerConfig:
    limits: Limits = field(default_factory=Limits)
    estimates: EstimateConfig = field(default_factory=EstimateConfig)
    exploration: ExplorationConfig = field(default_factory=ExplorationConfig)
    warmup_rounds: int = 3  # rounds at gamma = c before acceptance estimates are trusted
    # Drafting stops (gamma 0) only for a rate this much better than the best draft's: the
    # acceptance estimates are noisy, and at gamma 0 none are gathered.
    alone_entry_margin: float = 0.1
    rule_scale: float = 1.0  # the uncertainty rule's threshold: theta = scale x p1 x p2

    def __post_init__(self) -> None:
        limits, estimates = self.limits, self.estimates
        if limits.max_gamma > estimates.max_gamma or limits.max_branches > estimates.max_branches:
            raise ValueError(
                f"the limits allow shapes the estimates do not cover: {limits} against {estimates}"
            )

    @classmethod
    def of(cls, **tunables) -> ControllerConfig:
        """A config from flat tunables, each given to the part that has it (``max_gamma``
        sets both the limits' and the estimates')."""
        parts = {"limits": Limits, "estimates": EstimateConfig, "exploration": ExplorationConfig}
        given = {}
        for name, kind in parts.items():
            names = {f.name for f in dataclasses.fields(kind)}
            given[name] = kind(**{k: v for k, v in tunables.items() if k in names})
        known = set().union(*({f.name for f in dataclasses.fields(k)} for k in parts.values()))
        own = {k: v for k, v in tunables.items() if k not in known}
        return cls(**given, **own)


@dataclass(frozen=True)
class Choice:
    plan: Plan
    state: ExplorationState  # the exploration state once this plan is committed


@dataclass
class BudgetController:
    config: ControllerConfig = field(default_factory=ControllerConfig)
    history: list[Plan] = field(default_factory=list)  # committed plans, latest last
    HISTORY_KEPT = 1024  # a daemon runs for months: older plans are dropped

    def __post_init__(self) -> None:
        self.estimates = Estimates(self.config.estimates)
        self._state = ExplorationState()
        # what tree rounds accept: of the nodes' scores, and of the draft's first choices
        self.tree_calibration = Calibration()
        self.tree_first_choice = FirstChoice()
        # what model-free drafts accept, of their counted estimates
        self.lookup_calibration = Calibration()

    @property
    def limits(self) -> Limits:
        return self.config.limits

    def observe(self, report: RoundReport) -> None:
        """Learn from the round of the plan committed last."""
        plan = self.history[-1] if self.history else None
        if report.lookup is not None:  # ran instead of a plan: it teaches costs, not the plan
            self.estimates.observe(report)
            self.lookup_calibration.observe(report.lookup, report.accepted)
            return
        if report.gamma and plan is not None and plan.gamma and plan.round_s > 0:
            # the first drafted round after the target alone catches the drafter up on what
            # it decoded: the price of switching, not of drafting
            after_alone = len(self.history) > 1 and self.history[-2].gamma == 0
            if not after_alone:
                self.estimates.observe_delivery(report, plan.tokens_per_s)
        self.estimates.observe(report)
        if report.tree is not None:
            self.tree_calibration.observe(report.tree.expected, report.accepted)
            self.tree_first_choice.observe(report.tree.first_choices)

    def alone_plan(self) -> Plan:
        """The target alone as a plan priced by what was measured (seconds 0: not yet)."""
        return Plan(0, expected_tokens=1.0, round_s=self.estimates.alone_s() or 0.0)

    def lookup_price(
        self, acceptance: Sequence[float], rival: Plan, beside: Beside = NO_ONE_BESIDE
    ) -> tuple[int, float, float]:
        """How many of a model-free draft's ranked nodes (their estimated ``acceptance``) to
        verify in a round instead of running ``rival``, and that round's expected tokens and
        seconds: the count that commits the most tokens per second, where that beats
        ``rival``'s expected rate; 0 nodes: run ``rival``. A verification of unmeasured cost
        is tried (seconds 0: not priced), so that its cost is learned. ``beside``: as for
        ``choose``, the rows and tokens of the requests verified in the same forwards."""
        if not acceptance:
            return 0, 1.0, 0.0
        factor, verify_s = self.lookup_calibration.factor, self.estimates.verify_s
        width = best_width(acceptance, factor, verify_s, beside.rows, beside.tokens)
        expected = 1.0 + factor * float(sum(acceptance[:width]))
        seconds = verify_s(width + 1 + beside.rows)
        if seconds is None:
            return width, expected, 0.0
        seconds += self.estimates.overhead_s()
        rate, rival_rate = expected + beside.tokens, rival.expected_tokens + beside.tokens
        rival_s = rival.round_s if rival.round_s > 0 else float("inf")
        return (width if rate / seconds > rival_rate / rival_s else 0), expected, seconds

    def assume_verifier(self, seconds_by_width: dict[int, float]) -> None:
        """Start from the verifier's forward costs measured before serving (see
        ``Estimates.assume_verifier``)."""
        self.estimates.assume_verifier(seconds_by_width)

    def assume_overlap_factor(self, factor: float) -> None:
        """What an overlapped verification costs against a plain one until both were
        measured (see ``Estimates.assume_overlap_factor``)."""
        self.estimates.assume_overlap_factor(factor)

    def begin_request(self, tokens: int) -> None:
        """A request of at most ``tokens`` tokens begins (requests decode one at a time):
        acceptance learned from earlier ones weighs less, and where the target decodes alone
        the request starts with a probe if one costs little against it."""
        self.estimates.begin_request()
        if not self.decodes_alone():
            return
        model = self.estimates.cost_model(rule=False)
        if model is not None:
            probe = explore.request_probe(
                self.config.exploration,
                model,
                self.limits,
                tokens,
                self.config.estimates.prior_acceptance,
            )
            self._state = dataclasses.replace(self._state, start_probe=probe)

    def probes_first(self) -> bool:
        """Whether the next round is a new request's probe (it drafts)."""
        return self._state.start_probe is not None

    def decodes_alone(self) -> bool:
        """Whether the latest committed plan has the target decode alone (gamma 0)."""
        return bool(self.history) and self.history[-1].gamma == 0

    def commit(self, choice: Choice) -> Plan:
        self._state = choice.state
        self.history.append(choice.plan)
        if len(self.history) > 2 * self.HISTORY_KEPT:
            del self.history[: self.HISTORY_KEPT]
        return choice.plan

    def choose(self, beside: Beside = NO_ONE_BESIDE) -> Choice:
        """The next round's plan, weighed beside what the requests decoding at the same
        time put in each forward; nothing changes until it is committed."""
        config, limits, rounds = self.config, self.config.limits, self.estimates.rounds
        last = self.history[-1] if self.history else None
        alone = last is not None and last.gamma == 0
        if self._state.probe_left and last is not None and last.gamma:  # a probe from gamma 0
            return Choice(
                last, dataclasses.replace(self._state, probe_left=self._state.probe_left - 1)
            )
        if self._state.start_probe is not None:  # a new request's (begin_request's)
            rounds_left = config.exploration.alone_probe_rounds - 1
            return Choice(
                self._state.start_probe,
                dataclasses.replace(self._state, start_probe=None, kept=0, probe_left=rounds_left),
            )
        due = explore.probe_due(config.exploration, self._state, rounds, alone)
        if alone and explore.keeps_alone(config.exploration, self._state, due):
            return Choice(last, dataclasses.replace(self._state, kept=self._state.kept + 1))
        state = dataclasses.replace(self._state, kept=0)
        model = self.estimates.cost_model(limits.rule and limits.max_branches > 1, beside)
        if model is None:  # nothing measured yet: a one-token round measures both sides,
            # or, where it did not, two: a drafter whose catch-up's last forward yields the
            # first token's distribution (llama.cpp's) drafts one token without a step of its
            # own, and the controller chose one-token rounds for good
            gamma = 1 if not rounds else max(1, min(2, limits.max_gamma, limits.max_width - 1))
            return Choice(Plan(gamma, 1, round_s=0.0), state)
        if rounds < config.warmup_rounds:  # no acceptance data yet: DuoDecoding's gamma = c
            ratio = self.estimates.cost_ratio()
            gamma = max(1, min(limits.max_gamma, round(ratio), limits.max_width - 1))
            # overlapped where the model expects it to pay: on a box whose verifier computes
            # on the drafter's cores too, an overlapped round verifies without them
            kinds = (False, True) if limits.overlap else (False,)
            plans = [plan_of(model, limits, gamma, overlap=kind) for kind in kinds]
            rate = lambda plan: model.batch_rate(plan.expected_tokens, plan.round_s)  # noqa: E731
            return Choice(max(plans, key=rate), state)
        entry = 1.0 if alone else 1 / (1 + config.alone_entry_margin)
        # drafting is weighed at what its rounds delivered against their predictions
        best = best_plan(model, limits, entry / self.estimates.delivered_share())
        state = explore.after_weighing(config.exploration, state, best, due)
        plan = best
        if due:
            exploring = config.exploration
            plan, state = explore.neighbour(
                best,
                model,
                limits,
                state,
                rounds=rounds,
                every=exploring.probe_every,
                alone_rounds=exploring.alone_probe_rounds,
            )
        elif best.gamma and explore.alone_unmeasured_round(
            config.exploration, rounds, self.estimates.alone_measured()
        ):
            plan = plan_of(model, limits, 0)
        if plan.gamma == 0 and last is not None and last.gamma:
            # a trial of gamma 0: two rounds, not kept as a choice is (the engine measures
            # only the second: the first is a transition from drafting)
            state = dataclasses.replace(state, kept=config.exploration.keep_alone_rounds - 1)
        return Choice(plan, state)

    def summary(self) -> dict:
        """What the controller believes now and its latest plan, for request statistics."""
        plan = self.history[-1] if self.history else None
        return {
            **self.estimates.summary(),
            "last_decision": None
            if plan is None
            else {
                "gamma": plan.gamma,
                "branches": plan.branches,
                "overlap": plan.overlap,
                "expected_tokens": round(plan.expected_tokens, 3),
                "expected_tokens_per_s": round(plan.tokens_per_s, 1),
            },
        }
