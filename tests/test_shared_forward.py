"""One budget across requests: plans weighed beside the other requests in each forward.

Pure: cost models and controllers against a simulated box whose verifier evaluates every
request's rows in one forward, and whose one drafter drafts for them in turn.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetspec.daemon.decode.batch_board import BatchBoard
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.control.cost_model import ByOverlap, CostModel, VerifyLine
from hetspec.speculative.control.estimates import Estimates
from hetspec.speculative.control.planning import Limits, best_plan
from hetspec.speculative.control.rounds import (
    NO_ONE_BESIDE,
    Beside,
    DraftCall,
    Plan,
    RoundReport,
)
from hetspec.speculative.drafting.dynamic_tree import best_width

MAX_GAMMA = 16


def model_of(
    acceptance: float,
    step_s: float,
    base_s: float,
    per_node_s: float,
    beside: Beside = NO_ONE_BESIDE,
    *,
    alone_s: float | None = None,
) -> CostModel:
    depths = np.arange(MAX_GAMMA + 2)
    reach = np.array([[acceptance**d for d in depths] for _ in range(5)])
    verify = VerifyLine.exact(base_s, per_node_s)
    return CostModel(
        step_s=ByOverlap(step_s, step_s),
        latency_s=ByOverlap(0.0, 0.0),
        verify=ByOverlap(verify, verify),
        reach=reach,
        overhead_s=0.0,
        branch_factor=np.array([1.0, 1.0, 1.4, 1.8, 2.2]),
        alone_s=alone_s if alone_s is not None else base_s + per_node_s,
        beside=beside,
    )


def test_a_round_beside_others_is_priced_at_the_forward_s_whole_width() -> None:
    alone = model_of(0.7, 0.001, 0.010, 0.001)
    beside = model_of(0.7, 0.001, 0.010, 0.001, Beside(rows=12, tokens=6.0))
    for gamma, branches, overlap in [(1, 1, False), (4, 1, False), (3, 2, False), (5, 1, True)]:
        tokens, seconds = beside.predict(gamma, branches, overlap)
        own_tokens, own_seconds = alone.predict(gamma, branches, overlap)
        assert float(tokens) == pytest.approx(float(own_tokens))  # what it commits is its own
        # 12 more rows in the verification, nothing else dearer
        assert float(seconds) == pytest.approx(float(own_seconds) + 12 * 0.001)
    # the target alone beside them: a one-node verification's cost raised by their rows
    assert beside.alone_batched_s == pytest.approx(alone.alone_s * (0.011 + 0.012) / 0.011)
    assert alone.alone_batched_s == alone.alone_s


def test_the_chosen_plan_is_the_one_the_whole_batch_commits_most_per_second_with() -> None:
    limits = Limits(max_gamma=MAX_GAMMA, max_branches=4, max_width=64, rule=False)
    for rows, tokens in [(0, 0.0), (8, 4.0), (24, 9.0), (60, 30.0)]:
        model = model_of(0.75, 0.0015, 0.012, 0.0009, Beside(rows, tokens))
        plan = best_plan(model, limits)
        candidates = [Plan(0, expected_tokens=1.0, round_s=model.alone_batched_s)]
        for g in range(1, MAX_GAMMA + 1):
            for b in range(1, 5):
                for o in (False, True):
                    if limits.fits(g, b, o):
                        t, s = model.predict(g, b, o)
                        candidates.append(Plan(g, b, o, expected_tokens=float(t), round_s=float(s)))
        best = max(candidates, key=lambda p: (p.expected_tokens + tokens) / p.round_s)
        assert (plan.gamma, plan.branches, plan.overlap) == (
            best.gamma,
            best.branches,
            best.overlap,
        )


def test_a_request_drafts_less_as_the_forward_fills_and_decodes_alone_in_a_full_one() -> None:
    """A verifier whose forward costs a node's share of it (a wide batch is no longer free):
    beside more requests a request's draft buys less, down to none."""
    limits = Limits(max_gamma=MAX_GAMMA, max_branches=1, max_width=64, rule=False)
    gammas = []
    for others in range(0, 8):
        # each other request: a 4-node chain committing 2.5 tokens a round
        model = model_of(0.7, 0.001, 0.008, 0.001, Beside(rows=4 * others, tokens=2.5 * others))
        gammas.append(best_plan(model, limits).gamma)
    assert gammas[0] >= 2
    assert all(later <= earlier for earlier, later in itertools.pairwise(gammas))
    assert gammas[-1] == 0, gammas


def test_the_tree_width_counts_the_other_requests_rows_and_tokens() -> None:
    acceptance = [0.9, 0.7, 0.5, 0.35, 0.2, 0.1, 0.05, 0.02]

    def verify_s(width: int) -> float:  # flat to 8 nodes, then a node's share each
        return 0.01 + 0.002 * max(0, width - 8)

    alone = best_width(acceptance, 1.0, verify_s)
    beside = best_width(acceptance, 1.0, verify_s, beside_rows=12, beside_tokens=6.0)
    assert alone >= 6  # the flat part is free
    assert beside < alone  # beside others every node widens a paid forward


def test_a_verification_is_learned_at_the_width_of_the_forward_that_paid_for_it() -> None:
    estimates = Estimates()
    estimates.assume_verifier({1: 0.01, 8: 0.012, 32: 0.03, 64: 0.06})
    for _ in range(12):
        estimates.observe(
            RoundReport(
                3,
                1,
                2,
                drafts=(DraftCall(3, 1, 0.003, 0.0),),
                verify_width=4,
                batch_rows=32,
                verify_s=0.03,
            )
        )
    # priced at 32 rows, where its time was measured; its own 4 nodes far less (the
    # profile's shape, above a floor of half the cheapest measured)
    assert estimates.verify_s(32) == pytest.approx(0.03, rel=0.05)
    assert estimates.verify_s(4) <= 0.5 * estimates.verify_s(32) + 1e-9


class BatchBox:
    """Requests decoding together: each round every request drafts in turn on the one
    drafter, then one forward verifies every request's nodes (base + per node x all rows)."""

    def __init__(self, acceptance: float, step_s: float, base_s: float, per_node_s: float):
        self.acceptance, self.step_s = acceptance, step_s
        self.base_s, self.per_node_s = base_s, per_node_s
        self.rng = np.random.default_rng(7)

    def verify_s(self, rows: int) -> float:
        return self.base_s + self.per_node_s * rows

    def run(self, controllers: list[BudgetController], rounds: int, shared: bool) -> float:
        """Tokens per second of the whole batch over ``rounds`` rounds; ``shared``: each
        request's plan is weighed beside the others' latest plans (else alone, as before)."""
        profile = {w: self.verify_s(w) for w in (1, 8, 16, 32, 64, 128)}
        for controller in controllers:
            controller.assume_verifier(profile)
        plans: list[Plan] = [Plan(0, round_s=self.verify_s(1))] * len(controllers)
        committed = seconds = 0.0
        for _ in range(rounds):
            for i, controller in enumerate(controllers):
                others = [p for j, p in enumerate(plans) if j != i]
                beside = Beside(
                    sum(p.gamma * p.branches + 1 for p in others),
                    sum(p.expected_tokens for p in others),
                )
                plans[i] = controller.commit(controller.choose(beside if shared else Beside()))
            rows = sum(p.gamma * p.branches + 1 for p in plans)
            drafted = sum(p.gamma * p.branches for p in plans)
            verify_s = self.verify_s(rows) * self.rng.lognormal(0, 0.05)
            period = drafted * self.step_s + verify_s
            for controller, plan in zip(controllers, plans, strict=True):
                accepted = 0
                while accepted < plan.gamma and self.rng.random() < self.acceptance:
                    accepted += 1
                committed += 1 + accepted
                if plan.gamma == 0:
                    report = RoundReport(0, 1, 0, alone_round_s=self.verify_s(rows))
                else:
                    draft = DraftCall(plan.gamma, 1, plan.gamma * self.step_s, 0.0)
                    report = RoundReport(
                        plan.gamma,
                        plan.branches,
                        accepted,
                        drafts=(draft,),
                        verify_width=plan.gamma * plan.branches + 1,
                        batch_rows=rows,
                        verify_s=verify_s,
                        period_s=period,
                    )
                controller.observe(report)
            seconds += period
        return committed / seconds


def _controllers(n: int) -> list[BudgetController]:
    config = ControllerConfig.of(overlap=False, rule=False, max_branches=1)
    return [BudgetController(config) for _ in range(n)]


def test_requests_weighed_together_commit_more_than_each_weighing_its_own_rounds() -> None:
    """Four requests on a verifier that is not flat in width: each weighing its own rounds
    drafts as if the forward held its rows only; weighed beside the others' they draft
    what the batch can afford, and the batch commits more per second, near the best fixed
    gamma for all."""
    box = BatchBox(acceptance=0.7, step_s=0.0012, base_s=0.010, per_node_s=0.0012)
    own = box.run(_controllers(4), 400, shared=False)
    together = box.run(_controllers(4), 400, shared=True)
    fixed = []
    for gamma in range(0, 9):
        expected = sum(0.7**d for d in range(1, gamma + 1)) + 1
        fixed.append(4 * expected / (4 * gamma * 0.0012 + box.verify_s(4 * (gamma + 1))))
    assert together > own * 1.03, (together, own)
    assert together > 0.9 * max(fixed), (together, max(fixed))


def test_the_board_tells_a_seat_what_the_other_seats_put_in_a_forward() -> None:
    board = BatchBoard()
    assert board.beside(0) == Beside()
    with board.seated(0):
        assert board.beside(0) == Beside()  # alone: nothing beside it
        with board.seated(2):
            assert board.beside(0) == Beside(1, 1.0)  # a request not drafting yet: a row
            board.post(2, 5, 3.2)
            board.post(0, 9, 4.0)
            assert board.beside(0) == Beside(5, 3.2)
            assert board.beside(2) == Beside(9, 4.0)
            assert board.beside(1) == Beside(14, 7.2)  # a seat not taken sees them all
        assert board.seats == 1  # a request that ends leaves, whatever it posted
        assert board.beside(0) == Beside()
    assert board.seats == 0


def test_the_target_alone_beside_others_is_priced_apart_from_its_own_price() -> None:
    estimates = Estimates()
    estimates.assume_verifier({1: 0.01, 8: 0.012, 32: 0.03})
    draft = DraftCall(3, 1, 0.003, 0.0)
    estimates.observe(RoundReport(3, 1, 2, drafts=(draft,), verify_width=4, verify_s=0.012))
    for _ in range(6):
        estimates.observe(RoundReport(0, 1, 0, alone_round_s=0.011))
        estimates.observe(RoundReport(0, 1, 0, alone_round_s=0.04, batch_rows=13))
    assert estimates.alone_s() == pytest.approx(0.011)  # its own, untouched by the batch
    alone = estimates.cost_model(False)
    beside = estimates.cost_model(False, Beside(12, 5.0))
    assert alone.alone_batched_s == pytest.approx(0.011)
    assert beside.alone_batched_s == pytest.approx(0.04)  # as measured beside them
    assert estimates.summary()["target_alone_beside_others_round_ms"] == pytest.approx(40.0)
