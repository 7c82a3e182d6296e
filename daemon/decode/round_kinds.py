"""The kinds of speculative round, each one function from a plan to verified tokens and a report.

- plain: the drafter drafts ``branches`` x ``gamma`` (or by DuoDecoding's rule); the verifier
  evaluates the draft as one tree; the verdict keeps the accepted path and adds the target's
  own next token (the bonus);
- tree (``Limits.tree_k``, instead of single-branch plain rounds): the drafter drafts EAGLE-2's
  dynamic tree and ranks its nodes; the verified part is the ranked prefix that commits the
  most tokens per second (``speculative.drafting.dynamic_tree``);
- overlapped: while the verifier checks this round's chain, the drafter drafts the next one
  below it, guessing the bonus; if the whole chain and the guess hold, that run-ahead is the
  next round's draft at no waiting (its tokens were drawn given the guess, so they are as valid
  a proposal as a fresh draft: output stays lossless);
- alone (gamma 0): the target decodes a few tokens by itself, where drafting does not pay;
- grammar (a request with a grammar): the tokens the grammar forces, verified with no draft
  (the target computes them and chooses the next token under the grammar). A grammar's other
  rounds are plain (one chain) or alone, the workers keeping to the grammar as they draw.

Only verified tokens are emitted. Each function reads top to bottom: its calls go through the
scheduler (``ctx.schedule``), its verdict is taken where ``ctx.site`` says, and the controller
learns from the ``RoundReport`` it returns, nothing else.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from hetspec.daemon.decode.requests import cut_at_end
from hetspec.daemon.decode.round_context import Emitted, RoundContext
from hetspec.daemon.decode.round_sides import Unverified
from hetspec.daemon.decode.scheduler import Scheduler
from hetspec.daemon.decode.verdict_site import VerdictSite, second_opinion, walk_command
from hetspec.protocol import frame_array
from hetspec.protocol import worker_messages as m
from hetspec.speculative.control.rounds import DraftCall, Plan, RoundReport, TreeOutcome
from hetspec.speculative.drafting.branching import uncertainty_branches
from hetspec.speculative.drafting.dynamic_tree import (
    best_width,
    first_choice_offers,
    within_leaves,
)
from hetspec.speculative.drafting.model_free import TreeProposal
from hetspec.speculative.verify.verdicts import RowsOnDemand

Round = tuple[Emitted, RoundReport]


async def plain_round(ctx: RoundContext, schedule: Scheduler, plan: Plan, remaining: int) -> Round:
    """A draft of ``plan``'s branches, verified as one tree below the bonus."""
    drafted, draft, draft_s = await schedule.draft(plan, ctx.kind(plan))
    ctx.stats.worker_grammar(drafted.grammar)
    branches = Branches.of(drafted, ctx.pair.arena)
    rule = RuleProbe.of(ctx, plan, branches)
    site = ctx.site(drawn_walk=True)
    walk = walk_command(
        site,
        ctx.params,
        ctx.sampler,
        ctx.position,
        draft=drafted.probs,
        draft_rows=branches.row_index,
    )
    verification = await schedule.verify(
        branches.tokens, branches.parents, remaining, site=site, walk=walk, beside=rule.beside
    )
    draft_rows = None if ctx.params.greedy else branches.draft_rows()
    judged = ctx.judge(site, branches.tokens, branches.parents, verification.reply, draft_rows)
    emitted = ctx.commit(judged.verdict, branches.tokens, remaining, judged, verification.reply)
    ctx.drafter.unseen = emitted.tokens  # it holds the rest as this draft's pending nodes
    rule.after_verification()
    schedule.post_next_draft(remaining - len(emitted.tokens), emitted.stopped)
    period_s = time.perf_counter() - ctx.settled_at
    report = RoundReport(
        branches.gamma,
        branches.count,
        len(judged.verdict.path),
        rule=plan.rule,
        rule_k=rule.k,
        first_branch_accepted=branches.first_branch_kept(judged.verdict.path),
        drafts=(draft,),
        **_verification_fields(verification, len(branches.tokens)),
        overhead_s=period_s - draft_s - verification.seconds,
        period_s=period_s,
    )
    return emitted, report


async def tree_round(ctx: RoundContext, schedule: Scheduler, plan: Plan, remaining: int) -> Round:
    """EAGLE-2's dynamic tree of ``plan.gamma`` layers; of its ranked nodes, the verified
    prefix is the one that commits the most tokens per second, by the nodes' estimated
    acceptance (calibrated by what earlier tree rounds accepted) and the verifier's measured
    cost per width."""
    drafted, draft, draft_s = await schedule.draft(plan, ctx.kind(plan))
    acceptance = drafted.acceptance[: within_leaves(drafted.parents, _leaves(ctx))]
    calibration = ctx.controller.tree_calibration.factor
    beside = schedule.beside()
    verify_s = ctx.controller.estimates.verify_s
    width = best_width(acceptance, calibration, verify_s, beside.rows, beside.tokens)
    schedule.post(width + 1, 1.0 + calibration * float(sum(acceptance[:width])))
    tokens, parents = drafted.tokens[0][:width], drafted.parents[:width]
    site = ctx.site(drawn_walk=False)  # greedy or keyed: trees are not drawn
    walk = walk_command(site, ctx.params, ctx.sampler, ctx.position)
    verification = await schedule.verify(tokens, parents, remaining, site=site, walk=walk)
    judged = ctx.judge(site, tokens, parents, verification.reply)
    emitted = ctx.commit(judged.verdict, tokens, remaining, judged, verification.reply)
    ctx.drafter.unseen = emitted.tokens
    schedule.post_next_draft(remaining - len(emitted.tokens), emitted.stopped)
    period_s = time.perf_counter() - ctx.settled_at
    path = judged.verdict.path
    report = RoundReport(
        plan.gamma,
        1,
        len(path),
        drafts=(draft,),
        **_verification_fields(verification, len(tokens)),
        overhead_s=period_s - draft_s - verification.seconds,
        period_s=period_s,
        tree=TreeOutcome(float(sum(acceptance[:width])), first_choice_offers(parents, path)),
    )
    return emitted, report


async def overlapped_round(
    ctx: RoundContext, schedule: Scheduler, plan: Plan, remaining: int
) -> Round:
    start, drafts = time.perf_counter(), []
    if ctx.drafter.run_ahead is None:  # the last run-ahead missed: draft afresh first
        fresh_chain = m.Chains(plan.gamma)
        drafted, fresh, _ = await ctx.drafter.draft(fresh_chain, ctx.params, length=ctx.position)
        ctx.drafter.run_ahead, drafts = Unverified.of(drafted, ctx.pair.arena), [fresh]
    fresh_s = time.perf_counter() - start
    chain, ctx.drafter.run_ahead = ctx.drafter.run_ahead, None
    tokens, parents = chain.tokens, list(range(-1, len(chain.tokens) - 1))
    site = ctx.site(drawn_walk=False)  # a drawn second opinion reads the target's last row
    walk = walk_command(site, ctx.params, ctx.sampler, ctx.position)
    verify_start = time.perf_counter()
    argmax_only = site is VerdictSite.ARGMAX
    reply = asyncio.ensure_future(
        ctx.verifier.verify(tokens, parents, argmax_only=argmax_only, walk=walk)
    )
    ahead_gamma = max(1, min(plan.gamma, remaining - len(tokens)))
    ahead = ctx.drafter.start_run_ahead(chain, ahead_gamma, ctx.params)
    try:
        verified, _ = await schedule.awaiting(reply)
    except BaseException:
        if ahead is not None:
            ahead.cancel()
        raise
    verify_s = time.perf_counter() - verify_start
    judged = ctx.judge(site, tokens, parents, verified, chain.probs)
    verdict, held, ahead_s = judged.verdict, None, 0.0
    if ahead is not None:
        guessed, ahead_s = await ahead
        ctx.stats.run_ahead += 1
        drafts.append(_run_ahead_cost(guessed, ahead_s))
        if len(verdict.path) == len(tokens):  # all accepted: does the guessed bonus hold?
            guess_row = ctx.pair.arena.view(guessed.probs)[0, 0]
            last_row = None if judged.rows is None else judged.rows[-1]
            verdict, holds = second_opinion(
                verdict,
                guessed.tokens[0][0],
                guess_row=guess_row,
                last_row=last_row,
                params=ctx.params,
                sampler=ctx.sampler,
            )
            held = Unverified.of(guessed, ctx.pair.arena, skip=1) if holds else None
    emitted = ctx.commit(verdict, tokens, remaining, judged, verified)
    ctx.drafter.unseen += emitted.tokens
    if held is not None and not (emitted.stopped or len(emitted.tokens) >= remaining):
        ctx.drafter.run_ahead = held
        ctx.stats.run_ahead_held += 1
    period_s = time.perf_counter() - ctx.settled_at
    report = RoundReport(
        len(tokens),
        1,
        len(verdict.path),
        rule_k=_rule_would_pick(ctx, chain.probs),
        drafts=tuple(drafts),
        verify_width=len(tokens) + 1,
        batch_rows=verified.batch_rows,
        verify_s=verify_s,
        verify_compute_s=verified.elapsed_ms / 1000,
        verify_overlapped=ahead is not None,
        overhead_s=period_s - fresh_s - max(verify_s, ahead_s),
        period_s=period_s,
    )
    return emitted, report


async def lookup_round(
    ctx: RoundContext, schedule: Scheduler, proposal: TreeProposal, remaining: int
) -> Round:
    """A model-free draft (proposed from the request's own tokens: no draft call), verified
    as one tree below the bonus. A drawn request's walk reads it as one-hot proposals: each
    node kept with the target's probability of it, the bonus drawn from what is left."""
    tokens, parents = list(proposal.tokens), list(proposal.parents)
    site = ctx.site(drawn_walk=False)  # the daemon walks a drawn request's one-hot rows
    walk = walk_command(site, ctx.params, ctx.sampler, ctx.position)
    verification = await schedule.verify(tokens, parents, remaining, site=site, walk=walk)
    one_hot = None if ctx.params.greedy else _one_hot_rows(ctx, tokens, verification.reply)
    judged = ctx.judge(site, tokens, parents, verification.reply, one_hot)
    emitted = ctx.commit(judged.verdict, tokens, remaining, judged, verification.reply)
    ctx.drafter.unseen += emitted.tokens  # a draft model catches up with its next draft
    schedule.post_next_draft(remaining - len(emitted.tokens), emitted.stopped)
    period_s = time.perf_counter() - ctx.settled_at
    path = judged.verdict.path
    report = RoundReport(
        len(tokens),  # its nodes, as a chain's: what was offered to the target
        1,
        len(path),
        **_verification_fields(verification, len(tokens)),
        overhead_s=period_s - verification.seconds,
        period_s=period_s,
        lookup=float(sum(proposal.acceptance)),
    )
    return emitted, report


async def grammar_round(
    ctx: RoundContext, schedule: Scheduler, forced: TreeProposal, remaining: int
) -> Round:
    """The chain of tokens the request's grammar forces, verified below the bonus: each is
    the only token the masked target may choose, so it is kept, and the target chooses the
    token after them under the grammar. The controller learns no cost from it (neither a
    draft's nor the target alone's)."""
    tokens, parents = list(forced.tokens), list(forced.parents)
    site = ctx.site(drawn_walk=False)  # the grammar's masks are the daemon's: LOGITS
    verification = await schedule.verify(tokens, parents, remaining, site=site)
    one_hot = None if ctx.params.greedy else _one_hot_rows(ctx, tokens, verification.reply)
    judged = ctx.judge(site, tokens, parents, verification.reply, one_hot)
    emitted = ctx.commit(judged.verdict, tokens, remaining, judged, verification.reply)
    ctx.stats.grammar_forced += min(len(judged.verdict.path), len(emitted.tokens))
    ctx.drafter.unseen += emitted.tokens
    schedule.post_next_draft(remaining - len(emitted.tokens), emitted.stopped)
    period_s = time.perf_counter() - ctx.settled_at
    return emitted, RoundReport(0, 1, 0, overhead_s=period_s - verification.seconds)


async def alone_round(ctx: RoundContext, schedule: Scheduler, remaining: int) -> Round:
    """The target decodes a few tokens alone, drawing them in its own process; the drafter
    falls behind by them and catches up when drafting resumes."""
    decode = await schedule.decode_alone(remaining)
    ctx.stats.worker_grammar(decode.reply.grammar)
    tokens = decode.reply.tokens
    if decode.reply.features is not None and ctx.drafter.features is not None:
        features = frame_array(decode.reply.features, decode.frames)
        ctx.drafter.features.add(decode.reply.features_start, features)
    ctx.verifier.decoded(tokens)
    ctx.position += len(tokens)
    emitted, stopped = cut_at_end(tokens, ctx.ends)
    emitted = emitted[:remaining]
    ctx.emitted(emitted)
    ctx.drafter.unseen += emitted
    # Not what decoding alone costs: the first round without a draft (a transition: it
    # evaluates the last round's bonus and moves the target onto the spare cores), a trial of
    # the core choice not preferred, a round beside a drafter at work (design-notes: "A trial
    # of the other core choice does not price the target alone").
    compute_s = decode.reply.elapsed_ms / 1000 / len(tokens)
    period_s = time.perf_counter() - ctx.settled_at
    round_s = period_s / len(tokens) if ctx.alone_streak else None
    report = RoundReport(
        0,
        1,
        0,
        alone_round_s=round_s if decode.usual else None,
        alone_compute_s=compute_s if decode.usual else None,
        batch_rows=decode.batch_rows,
    )
    return Emitted(emitted, stopped, decode.reply.logprobs or None), report


# ---------------------------------------------------------------- named steps


@dataclass(frozen=True)
class Branches:
    """A plain round's draft as tree nodes: tokens, parents, and each node's (branch, step);
    ``probs``: the drafter's rows, (branches, steps, vocab)."""

    tokens: list[int]
    parents: list[int]
    origin: list[tuple[int, int]]
    probs: np.ndarray
    count: int  # branches drafted (the rule picks its own)
    gamma: int  # tokens per branch

    @classmethod
    def of(cls, drafted: m.Drafted, arena) -> Branches:
        tokens, parents, origin = [], [], []
        for branch, row in enumerate(drafted.tokens):
            parent = -1
            for step, token in enumerate(row):
                tokens.append(token)
                parents.append(parent)
                origin.append((branch, step))
                parent = len(tokens) - 1
        probs = arena.view(drafted.probs)
        return cls(tokens, parents, origin, probs, len(drafted.tokens), len(drafted.tokens[0]))

    @property
    def row_index(self) -> list[int]:
        """Node i's draft row among the drafter's rows flattened to (rows, vocab)."""
        steps = self.probs.shape[1]
        return [branch * steps + step for branch, step in self.origin]

    def draft_rows(self) -> RowsOnDemand:
        """Each node's draft row, read in place."""
        return RowsOnDemand.at(self.probs.reshape(-1, self.probs.shape[-1]), self.row_index)

    def first_branch_kept(self, path: list[int]) -> int | None:
        """Several branches: the drafted tokens the first branch kept (its chain's choices:
        0 where the path left it at once); None for one branch."""
        if self.count == 1:
            return None
        on_first = bool(path) and self.origin[path[0]][0] == 0
        return len(path) if on_first else 0


class RuleProbe:
    """The branch count DuoDecoding's rule would pick for a single-branch draft, so that the
    controller learns what the rule is worth on this text. It reads the draft's rows, which
    the next draft replaces: beside the verification where that runs off the CPU, else once
    it is done (before the next draft is posted)."""

    def __init__(self, ctx: RoundContext, rows: np.ndarray | None, beside: bool) -> None:
        self._ctx, self._rows, self._beside = ctx, rows, beside
        self.k: int | None = None

    @classmethod
    def of(cls, ctx: RoundContext, plan: Plan, branches: Branches) -> RuleProbe:
        rows = None if plan.rule or branches.count > 1 else branches.probs[0]
        return cls(ctx, rows, beside=not ctx.pair.verifier_on_cpu)

    def beside(self) -> None:
        if self._rows is not None and self._beside:
            self.k = _rule_would_pick(self._ctx, self._rows)

    def after_verification(self) -> None:
        if self._rows is not None and not self._beside:
            self.k = _rule_would_pick(self._ctx, self._rows)


def _rule_would_pick(ctx: RoundContext, probs: np.ndarray) -> int | None:
    limits = ctx.controller.limits
    if len(probs) < 2 or not limits.rule or limits.max_branches < 2:
        return None
    scale = ctx.controller.config.rule_scale
    return uncertainty_branches(probs[0], float(probs[1].max()), limits.max_branches, scale)


def _verification_fields(verification, drafted_nodes: int) -> dict:
    """A drafting round's report fields of its verification; a trial of the core choice not
    preferred is not what such rounds cost (verify_s 0)."""
    return {
        "verify_width": drafted_nodes + 1,
        "verify_s": 0.0 if verification.trial else verification.seconds,
        "verify_compute_s": verification.reply.elapsed_ms / 1000,
        "batch_rows": verification.reply.batch_rows,
    }


def _one_hot_rows(ctx: RoundContext, tokens: list[int], verified: m.Verified) -> RowsOnDemand:
    """A model-free draft's nodes as draft rows: each certain of its own token."""
    width = ctx.pair.arena.view(verified.logits).shape[-1] if verified.logits is not None else 0

    def row(node: int) -> np.ndarray:
        one_hot = np.zeros(width, np.float32)
        one_hot[tokens[node]] = 1.0
        return one_hot

    return RowsOnDemand((len(tokens), width), row)


def _leaves(ctx: RoundContext) -> int | None:
    """The leaves a tree may have in the verifier: llama.cpp's, a sequence id each."""
    settings = ctx.pair.verifier.spec.settings
    return settings.n_seq_max - 1 if isinstance(settings, m.LlamaCppSettings) else None


def _run_ahead_cost(guessed: m.Drafted, seconds: float) -> DraftCall:
    compute_s = guessed.elapsed_ms / 1000
    return DraftCall(guessed.forwards, 1, compute_s, seconds - compute_s, overlapped=True)
