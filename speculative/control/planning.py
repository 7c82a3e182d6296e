"""The best plan under a cost model: every candidate shape weighed in one vectorized call."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hetspec.speculative.control.cost_model import CostModel
from hetspec.speculative.control.rounds import Plan


@dataclass(frozen=True)
class Limits:
    """Which shapes a round may take."""

    max_gamma: int = 16
    max_branches: int = 4
    max_width: int = 64  # nodes a verification may hold (the arena slot size)
    overlap: bool = True  # overlapped rounds (one branch) may be chosen
    rule: bool = True  # rounds drafted by DuoDecoding's rule may be chosen
    # > 0: plain rounds draft EAGLE-2's dynamic tree instead of branches, expanding this many
    # nodes a layer (gamma layers), and verify as many of its nodes as the costs make pay
    tree_k: int = 0

    def fits(self, gamma: int, branches: int, overlap: bool = False) -> bool:
        return (
            int(overlap) <= gamma <= self.max_gamma
            and 1 <= branches <= self.max_branches
            and gamma * branches + 1 <= self.max_width
            and not (overlap and (branches > 1 or not self.overlap))
        )


def plan_of(
    model: CostModel,
    limits: Limits,
    gamma: int,
    branches: int = 1,
    *,
    overlap: bool = False,
    rule: bool = False,
) -> Plan:
    """The plan of one shape with what ``model`` expects of it."""
    if rule and model.rule:
        tokens, seconds = model.predict_rule(gamma)
        return Plan(
            gamma,
            limits.max_branches,
            rule=True,
            expected_tokens=float(tokens),
            round_s=float(seconds),
        )
    tokens, seconds = model.predict(gamma, branches, overlap)
    drafted = gamma > 0
    return Plan(
        gamma,
        branches if drafted else 1,
        overlap and drafted,
        expected_tokens=float(tokens),
        round_s=float(seconds),
    )


@lru_cache(maxsize=16)
def _grid(limits: Limits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gamma, branches, overlap) of every drafted shape the limits allow (built once per
    limits: read-only arrays)."""
    shapes = [
        (g, b, False)
        for b in range(1, limits.max_branches + 1)
        for g in range(1, limits.max_gamma + 1)
        if g * b + 1 <= limits.max_width
    ]
    if limits.overlap:
        shapes += [
            (g, 1, True) for g in range(1, limits.max_gamma + 1) if g + 1 <= limits.max_width
        ]
    arrays = tuple(np.array(column) for column in zip(*shapes, strict=True))
    for array in arrays:
        array.flags.writeable = False
    return arrays


def best_drafted(model: CostModel, limits: Limits, overlap: bool) -> Plan:
    """The drafted shape of one kind, overlapped or plain, that ``model`` expects the most
    committed tokens per second of (``limits.overlap`` off: plain whatever ``overlap``)."""
    gammas, branches, overlaps = _grid(limits)
    kind = overlaps == (overlap and limits.overlap)
    gammas, branches, overlaps = gammas[kind], branches[kind], overlaps[kind]
    tokens, seconds = model.predict(gammas, branches, overlaps)
    best = int(np.argmax(model.batch_rate(tokens, seconds)))
    return Plan(
        int(gammas[best]),
        int(branches[best]),
        bool(overlaps[best]),
        expected_tokens=float(tokens[best]),
        round_s=float(seconds[best]),
    )


def best_plan(model: CostModel, limits: Limits, alone_weight: float = 1.0) -> Plan:
    """The candidate with the highest expected tokens per second; the target alone's rate
    is weighed by ``alone_weight`` (below 1: drafting stops only for a clearly better rate)."""
    gammas, branches, overlaps = _grid(limits)
    tokens, seconds = model.predict(gammas, branches, overlaps)
    best = int(np.argmax(model.batch_rate(tokens, seconds)))
    plan = Plan(
        int(gammas[best]),
        int(branches[best]),
        bool(overlaps[best]),
        expected_tokens=float(tokens[best]),
        round_s=float(seconds[best]),
    )
    if limits.rule and model.rule:
        budgets = np.arange(2, min(limits.max_gamma, limits.max_width - 1) + 1)
        if budgets.size:
            tokens, seconds = model.predict_rule(budgets)
            rates = model.batch_rate(tokens, seconds)
            top = int(np.argmax(rates))
            if rates[top] > model.batch_rate(plan.expected_tokens, plan.round_s):
                plan = Plan(
                    int(budgets[top]),
                    limits.max_branches,
                    rule=True,
                    expected_tokens=float(tokens[top]),
                    round_s=float(seconds[top]),
                )
    alone_s = model.alone_batched_s
    beside = model.beside.tokens
    if (alone_weight + beside) / alone_s > model.batch_rate(plan.expected_tokens, plan.round_s):
        return Plan(0, expected_tokens=1.0, round_s=alone_s)
    return plan
