"""The budget controller against a simulated box whose costs and acceptance are known."""

from __future__ import annotations

import numpy as np
import pytest

from hetspec.speculative.budget import BudgetController


class SimulatedBox:
    """True costs and acceptance; the controller only sees noisy measurements of them."""

    def __init__(self, draft_step_s: float, verify_base_s: float, verify_per_node_s: float,
                 acceptance: float, rng: np.random.Generator, *,
                 contention: float = 1.0) -> None:  # fmt: skip
        self.draft_step_s = draft_step_s
        self.verify_base_s, self.verify_per_node_s = verify_base_s, verify_per_node_s
        self.acceptance = acceptance
        self.rng = rng
        self.contention = contention  # how much slower each worker runs while both compute

    def step_s(self, branches: int) -> float:
        return self.draft_step_s * (1 + 0.5 * (branches - 1))

    def verify_s(self, width: int) -> float:
        return self.verify_base_s + self.verify_per_node_s * width

    def first_acceptance(self, branches: int) -> float:
        return 1 - (1 - self.acceptance) ** branches

    def reach(self, depth: int, branches: int) -> float:
        """P(the first ``depth`` drafted tokens are accepted)."""
        return self.first_acceptance(branches) * self.acceptance ** (depth - 1)

    def rate(self, gamma: int, branches: int, overlap: bool = True) -> float:
        """Expected committed tokens per second of a fixed (gamma, branches, overlap).
        Overlapped (one branch) as the engine does it: the drafter runs gamma + 1 steps ahead
        during verification, both slowed by contention, and that run-ahead serves as the next
        draft only if gamma + 1 tokens would have been accepted; otherwise the next round
        drafts afresh first, alone."""
        tokens = 1 + sum(self.reach(depth, branches) for depth in range(1, gamma + 1))
        step, verify = self.step_s(branches), self.verify_s(gamma * branches + 1)
        if not overlap:
            return tokens / (gamma * step + verify)
        miss = 1 - self.reach(gamma + 1, branches)
        both = max((gamma + 1) * step, verify) * self.contention
        return tokens / (both + miss * gamma * step)

    def best_rate(self, parallel: bool = True) -> float:
        sequential = max(self.rate(g, k, False) for g in range(17) for k in range(1, 5))
        overlapped = max(self.rate(g, 1, True) for g in range(1, 17)) if parallel else 0
        return max(sequential, overlapped)

    def run_round(self, controller: BudgetController) -> None:
        decision = controller.choose()
        gamma, branches, overlap = decision.gamma, decision.branches, decision.overlap
        noise = self.rng.lognormal(0, 0.1, size=3)
        width = gamma * branches + 1
        if overlap:
            slow = self.contention
            controller.record_draft(gamma + 1, 1, (gamma + 1) * self.step_s(1) * slow * noise[0],
                                    overlapped=True)  # fmt: skip
            controller.record_verify(width, self.verify_s(width) * slow * noise[1],
                                     overlapped=True)  # fmt: skip
            if self.rng.random() > self.reach(gamma + 1, 1):  # a miss: the next draft is fresh
                controller.record_draft(gamma, 1, gamma * self.step_s(1) * noise[2])
        elif gamma == 0:
            controller.record_target_alone(self.verify_s(1) * noise[1])
        else:
            controller.record_draft(gamma, branches, gamma * self.step_s(branches) * noise[0])
            controller.record_verify(width, self.verify_s(width) * noise[1])
        accepted = 0
        if gamma and self.rng.random() < self.first_acceptance(branches):
            accepted = 1
            while accepted < gamma and self.rng.random() < self.acceptance:
                accepted += 1
        controller.record_round(gamma, branches, accepted)


def test_it_starts_with_one_token_then_gamma_equal_to_c() -> None:
    controller = BudgetController()
    first = controller.choose()
    assert (first.gamma, first.branches) == (1, 1)
    controller.record_draft(1, 1, 0.001)
    controller.record_verify(2, 0.006)
    assert controller.cost_ratio() == pytest.approx(6)
    assert controller.choose().gamma == 6


SEEDS = range(6)  # the box's noise differs per seed; the controller must do well on all


@pytest.mark.parametrize("contention", [1.0, 1.7])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("acceptance", [0.5, 0.9])
def test_it_converges_near_the_best_fixed_budget(parallel, acceptance, contention) -> None:
    shares = []
    for seed in SEEDS:
        box = SimulatedBox(0.001, 0.006, 0.0002, acceptance, np.random.default_rng(seed),
                           contention=contention)  # fmt: skip
        controller = BudgetController(parallel=parallel)
        for _ in range(150):
            box.run_round(controller)
        late = controller.history[-50:]
        achieved = np.mean([box.rate(d.gamma, d.branches, d.overlap) for d in late])
        shares.append(achieved / box.best_rate(parallel))
    assert np.mean(shares) >= 0.95, shares
    assert min(shares) >= 0.9, shares


def test_it_overlaps_only_where_the_box_runs_both_workers_at_full_speed() -> None:
    def overlapped_share(contention: float) -> float:
        box = SimulatedBox(0.001, 0.006, 0.0002, 0.7, np.random.default_rng(0),
                           contention=contention)  # fmt: skip
        controller = BudgetController(parallel=True)
        for _ in range(150):
            box.run_round(controller)
        return np.mean([d.overlap for d in controller.history[-50:]])

    assert overlapped_share(1.0) >= 0.8  # a CPU drafting for a GPU: overlap pays
    assert overlapped_share(1.8) <= 0.2  # two vCPUs that slow each other down: it does not


def test_it_reconverges_when_the_cpu_gets_busier_mid_run() -> None:
    shares = []
    for seed in SEEDS:
        box = SimulatedBox(0.001, 0.008, 0.0001, 0.8, np.random.default_rng(seed))
        controller = BudgetController()
        for _ in range(100):
            box.run_round(controller)
        before = controller.history[-1].gamma
        box.draft_step_s *= 3  # another process takes the drafter's core
        for _ in range(40):
            box.run_round(controller)
        after = controller.history[-10:]
        assert after[-1].gamma < before
        achieved = np.mean([box.rate(d.gamma, d.branches, d.overlap) for d in after])
        shares.append(achieved / box.best_rate())
    assert np.mean(shares) >= 0.95, shares
    assert min(shares) >= 0.9, shares


def test_acceptance_by_depth_follows_what_happened() -> None:
    controller = BudgetController(prior_weight=0.01)
    for _ in range(50):
        controller.record_round(gamma=4, branches=1, accepted=2)
    assert controller.acceptance(1) == pytest.approx(1, abs=0.01)
    assert controller.acceptance(2) == pytest.approx(1, abs=0.01)
    assert controller.acceptance(3) == pytest.approx(0, abs=0.01)
    assert controller.expected_tokens(4) == pytest.approx(3, abs=0.05)


def test_a_costly_round_overhead_is_amortised_over_longer_drafts() -> None:
    def settled_gamma(overhead_s: float) -> int:
        controller = BudgetController(parallel=False, prior_weight=0.01)
        rng = np.random.default_rng(0)
        for _ in range(60):
            controller.record_draft(1, 1, 0.001)
            controller.record_verify(2, 0.005)
            controller.record_verify(17, 0.006)
            controller.record_overhead(overhead_s)
            accepted = min(16, int(rng.geometric(0.2)) - 1)  # acceptance 0.8 at every depth
            controller.record_round(gamma=16, branches=1, accepted=accepted)
        return controller.choose().gamma

    assert settled_gamma(0.02) > settled_gamma(0.0)


def test_the_fast_candidate_loop_agrees_with_the_cost_model() -> None:
    box = SimulatedBox(0.0004, 0.003, 0.0001, 0.7, np.random.default_rng(0), contention=1.3)
    controller = BudgetController(parallel=True, max_width=63)
    for _ in range(100):
        box.run_round(controller)
    snapshot = controller._snapshot()
    rates = list(controller._rates(snapshot))
    assert any(overlap for *_, overlap in rates)
    assert any(not o for *_, o in rates)
    for rate, gamma, branches, overlap in rates:
        decision = controller._evaluate(gamma, branches, overlap, snapshot)
        assert rate == pytest.approx(decision.tokens_per_s, rel=1e-9)


def test_it_drafts_nothing_where_drafting_cannot_pay() -> None:
    """A drafter slower than the target (a CPU torch draft against a llama.cpp target on a
    small box): the target decoding alone (gamma 0) is the best choice, and it is taken."""
    box = SimulatedBox(0.004, 0.001, 0.00005, 0.6, np.random.default_rng(0))
    controller = BudgetController(parallel=True)
    for _ in range(120):
        box.run_round(controller)
    late = controller.history[-40:]
    assert np.mean([d.gamma == 0 for d in late]) >= 0.8
