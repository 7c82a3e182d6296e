"""When the controller deviates from the best plan to measure something again.

- Every ``probe_every`` rounds it tries a neighbour of the best plan (gamma -1, +1, a branch
  less, one more, and the other kind of round), so a cost measured once in a bad moment is
  measured again instead of ruling that choice out for good.
- While the target decodes alone (gamma 0) a plan is kept for ``keep_alone_rounds`` rounds
  without weighing the candidates again (such a round is about a millisecond), and each probe
  that finds gamma 0 still best halves how often the next comes (down to one in
  2**max_alone_backoff probe slots): a probe is a drafted round of the shape the model
  expects the most of (plain and overlapped by turns, overlapped only where the model does
  not price it far below plain), plus the drafter catching up.
- A request that starts while the target decodes alone starts with a probe, plain rounds of
  the chain that would pay most on text accepting the prior's rate, where that costs little
  against the request (``request_probe_share``): the text changes at a request, and the
  probes above come once in up to 128 rounds of ~50 ms of tokens each.
- The target alone, never measured, is priced as a one-node verification, dearer than it is
  where calls decode several tokens; one round measures it, half way between probes, after a
  few probe cycles (earlier it slowed the drafting shape's first settling), and again
  whenever that measurement has gone stale (``EstimateConfig.alone_max_age``).

The state lives in an immutable ``ExplorationState``: the controller's ``choose`` returns the
next one with its plan and installs it only when the round is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hetspec.speculative.control.cost_model import CostModel
from hetspec.speculative.control.planning import Limits, best_drafted, plan_of
from hetspec.speculative.control.rounds import Plan

# A probe from gamma 0 takes its overlapped turn only where the model expects that kind at
# least this share of the plain kind's rate: one priced far below plain costs more than it
# shows (docs/design-notes.md, "A probe from gamma 0 skips its overlapped turn")
OVERLAPPED_PROBE_SHARE = 0.8


@dataclass(frozen=True)
class ExplorationConfig:
    probe_every: int = 16  # rounds between tries of a neighbouring plan (0: never)
    keep_alone_rounds: int = 4
    max_alone_backoff: int = 3
    # rounds a probe from gamma 0 drafts: one round's acceptance is too noisy to overturn
    # estimates that made the target alone best
    alone_probe_rounds: int = 3
    alone_measured_after_probes: int = 4
    # A request that starts while the target decodes alone starts with a plain probe (new
    # text may accept drafts the last did not; probes between requests come too seldom to
    # see it), where the probe's expected loss against decoding alone is at most this share
    # of the request's time alone (0: never)
    request_probe_share: float = 0.05


@dataclass(frozen=True)
class ExplorationState:
    kept: int = 0  # rounds the last gamma-0 plan was reused without weighing
    alone_backoff: int = 0  # probe slots skipped while alone: 2**this - 1 of every 2**this
    alone_probes: int = 0  # probes taken from gamma 0 (they alternate two kinds)
    probe_left: int = 0  # rounds the running probe from gamma 0 still drafts its shape
    start_probe: Plan | None = None  # a new request's probe, its next round's plan


def probe_due(config: ExplorationConfig, state: ExplorationState, rounds: int, alone: bool) -> bool:
    every = config.probe_every
    if not every or rounds % every:
        return False
    return not alone or (rounds // every) % (1 << state.alone_backoff) == 0


def keeps_alone(config: ExplorationConfig, state: ExplorationState, due: bool) -> bool:
    """Whether the last plan, gamma 0, is reused without weighing the candidates."""
    return state.kept < config.keep_alone_rounds and not due


def after_weighing(
    config: ExplorationConfig, state: ExplorationState, best: Plan, due: bool
) -> ExplorationState:
    """The state once the candidates were weighed and ``best`` won."""
    if best.gamma:
        backoff = 0
    elif due:
        backoff = min(state.alone_backoff + 1, config.max_alone_backoff)
    else:
        backoff = state.alone_backoff
    return replace(state, kept=0, alone_backoff=backoff)


def alone_unmeasured_round(config: ExplorationConfig, rounds: int, measured: bool) -> bool:
    """Whether this round should measure the target alone, never measured yet or stale
    (``measured``: whether a fresh measurement exists)."""
    half = config.probe_every // 2
    settled = rounds >= config.alone_measured_after_probes * config.probe_every
    return not measured and settled and half > 0 and rounds % config.probe_every == half


def neighbour(
    best: Plan,
    model: CostModel,
    limits: Limits,
    state: ExplorationState,
    *,
    rounds: int,
    every: int,
    alone_rounds: int = 1,
) -> tuple[Plan, ExplorationState]:
    """By turns: gamma - 1, gamma + 1, one branch less, one more, and another kind of round:
    alternately overlapped or not (where allowed) and drafted by the rule or with fixed
    branches (where allowed). From gamma 0: the drafted shape the model expects the most of,
    plain and overlapped by turns (where allowed), for ``alone_rounds`` rounds."""
    others = ["overlap"] * limits.overlap + ["rule"] * bool(model.rule)
    turns = ["shorter", "longer", "fewer", "more"] + ["other"] * bool(others)
    probe = rounds // every
    turn = turns[probe % len(turns)]
    if turn == "other":  # the kinds of round take turns, keeping the cycle short
        turn = others[probe // len(turns) % len(others)]
    if best.gamma == 0:
        # not gamma 1: that round's width shows least what drafting is worth, and the costs
        # it measured (a cost is fitted to every width measured) priced drafting as dear as
        # the moment that made gamma 0 best, so the target stayed alone for good
        probes = state.alone_probes + 1
        state = replace(state, alone_probes=probes, probe_left=alone_rounds - 1)
        return _probe_from_alone(model, limits, overlapped_turn=probes % 2 == 0), state
    if turn == "rule":
        if best.rule:
            return plan_of(model, limits, best.gamma), state
        if best.gamma >= 2:
            return plan_of(model, limits, best.gamma, rule=True), state
        return best, state
    gamma = best.gamma + {"shorter": -1, "longer": 1}.get(turn, 0)
    branches = (1 if best.rule else best.branches) + {"fewer": -1, "more": 1}.get(turn, 0)
    if turn == "overlap":
        gamma = max(gamma, 1)
    overlap = best.overlap != (turn == "overlap") and gamma > 0
    if overlap:
        branches = 1
    if limits.fits(gamma, branches, overlap):
        return plan_of(model, limits, gamma, branches, overlap=overlap), state
    return best, state


def _probe_from_alone(model: CostModel, limits: Limits, *, overlapped_turn: bool) -> Plan:
    """The drafted shape the model expects the most of, of the turn's kind: overlapped on
    its turns, unless the model prices that kind far below plain."""
    plain = best_drafted(model, limits, overlap=False)
    if overlapped_turn:
        overlapped = best_drafted(model, limits, overlap=True)
        if overlapped.tokens_per_s >= OVERLAPPED_PROBE_SHARE * plain.tokens_per_s:
            return overlapped
    return plain


def request_probe(
    config: ExplorationConfig, model: CostModel, limits: Limits, tokens: int, prior: float
) -> Plan | None:
    """The probe a request of ``tokens`` tokens starts with while the target decodes alone:
    the plain chain that would pay most if the text accepted ``prior`` a token (the shape
    the current estimates prefer is the short one that made the target alone best, and one
    or two tokens show least what a text accepts), where its rounds' expected loss against
    the target alone by the current estimates is at most ``request_probe_share`` of the
    request's time alone; else None."""
    if config.request_probe_share <= 0 or tokens <= 0:
        return None
    depths = np.arange(model.reach.shape[1])
    hopeful = replace(model, reach=np.tile(prior**depths, (model.reach.shape[0], 1)))
    shape = best_drafted(hopeful, limits, overlap=False)
    probe = plan_of(model, limits, shape.gamma)
    round_loss = max(0.0, probe.round_s - probe.expected_tokens * model.alone_s)
    loss = config.alone_probe_rounds * round_loss
    return probe if loss <= config.request_probe_share * tokens * model.alone_s else None
