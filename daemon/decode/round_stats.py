"""One request's speculative rounds, counted for its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetspec.protocol import worker_messages as m
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.control.budget import BudgetController
from hetspec.speculative.control.rounds import RoundReport


@dataclass
class SpeculativeStats:
    """One request's rounds, for its statistics."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds accepting >= depth
    gammas: list[int] = field(default_factory=list)
    branches: list[int] = field(default_factory=list)
    draft_steps: int = 0
    draft_compute_ms: float = 0.0  # the drafter's own time for those steps
    verify_ms: float = 0.0
    run_ahead: int = 0  # overlapped rounds: the drafter drafted ahead during verification
    run_ahead_held: int = 0  # ... whose run-ahead became the next draft
    rule_rounds: int = 0  # rounds drafted by DuoDecoding's uncertainty rule
    verified_nodes: int = 0  # drafted nodes sent to verification (a tree's chosen width)
    # the daemon's share: its work between calls, and calls' time beyond the workers' own
    overhead_ms: float = 0.0
    draft_link_ms: float = 0.0
    draft_calls: int = 0
    verify_link_ms: float = 0.0
    verifications: int = 0
    prefill_wait_ms: float = 0.0  # waiting for the drafter's late prefill (DraftCall's)
    grammar_forced: int = 0  # tokens a grammar forced, emitted with no draft
    grammar_masks: int = 0  # the grammar's masks the daemon computed, and their time
    grammar_mask_ms: float = 0.0
    # ... and the workers' (drafting, decoding alone), their compiles besides
    grammar_worker_masks: int = 0
    grammar_worker_mask_ms: float = 0.0
    grammar_compile_ms: float = 0.0

    def count(self, report: RoundReport) -> None:
        self.rounds += 1
        self.drafted += report.drafted
        self.accepted += report.accepted
        self.gammas.append(report.gamma)
        self.branches.append(report.branches)
        self.rule_rounds += report.rule
        self.verified_nodes += max(report.verify_width - 1, 0) if report.gamma else 0
        self.overhead_ms += report.overhead_s * 1000
        if report.gamma and report.verify_s:
            self.verifications += 1
            self.verify_link_ms += (report.verify_s - report.verify_compute_s) * 1000
        for call in report.drafts:
            if not call.overlapped:  # an overlapped call's wait hides behind verification
                self.draft_calls += 1
                self.draft_link_ms += call.latency_s * 1000
            self.draft_steps += call.steps
            self.prefill_wait_ms += call.prefill_wait_s * 1000
            self.draft_compute_ms += call.compute_s * 1000 if call.steps else 0.0
        self.verify_ms += (report.verify_s if report.gamma else report.alone_compute_s or 0) * 1000
        depths = self.accepted_by_depth
        depths += [0] * (report.accepted - len(depths))
        for depth in range(report.accepted):
            depths[depth] += 1

    def worker_grammar(self, cost: m.GrammarCost | None) -> None:
        """A worker's reply's grammar cost (None: it reported none)."""
        if cost is not None:
            self.grammar_worker_masks += cost.masks
            self.grammar_worker_mask_ms += cost.mask_ms
            self.grammar_compile_ms += cost.compile_ms

    def grammar_cost(self, constraint: Constraint | None) -> None:
        """What the request's grammar computed (None: it had none)."""
        if constraint is not None:
            self.grammar_masks, self.grammar_mask_ms = constraint.masks, constraint.mask_s * 1000

    def summary(self, controller: BudgetController) -> dict:
        per = self.rounds or None
        step = self.draft_compute_ms / self.draft_steps if self.draft_steps else None
        return {
            "rounds": self.rounds,
            "draft_n": self.drafted,
            "draft_n_accepted": self.accepted,
            "mean_accepted_length": round(self.accepted / per, 3) if per else 0,
            "acceptance_by_depth": self.accepted_by_depth,
            "gamma_history": self.gammas[-64:],
            "branch_history": self.branches[-64:],
            "t_draft_ms": None if step is None else round(step, 3),
            "t_verify_ms": round(self.verify_ms / per, 3) if per else None,
            "run_ahead": self.run_ahead,
            "run_ahead_held": self.run_ahead_held,
            "rule_rounds": self.rule_rounds,
            "verified_nodes": self.verified_nodes,
            "grammar_forced": self.grammar_forced,
            "grammar_masks": self.grammar_masks,
            "grammar_mask_ms": round(self.grammar_mask_ms, 3),
            "grammar_worker_masks": self.grammar_worker_masks,
            "grammar_worker_mask_ms": round(self.grammar_worker_mask_ms, 3),
            "grammar_compile_ms": round(self.grammar_compile_ms, 3),
            "t_overhead_ms": round(self.overhead_ms / per, 3) if per else None,
            "t_prefill_wait_ms": round(self.prefill_wait_ms / per, 3) if per else None,
            "t_draft_link_ms": _mean(self.draft_link_ms, self.draft_calls),
            "t_verify_link_ms": _mean(self.verify_link_ms, self.verifications),
            "controller": controller.summary(),
        }


def _mean(total_ms: float, count: int) -> float | None:
    return round(total_ms / count, 3) if count else None
