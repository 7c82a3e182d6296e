"""Every trick that hides a round's latency, and nothing of the algorithm.

The next round's plan is chosen while a call runs; the next round's draft is sent as soon as
this round's tokens are known (the drafter drafts while the daemon reports, learns and
streams); the drafter is woken before that draft comes; the daemon's own work runs beside a
verification; and the target computes on the drafter's cores while the drafter idles, where
that measured faster (now and then the other choice, as a trial). A round asks the scheduler
for its calls; what it decides from their replies is its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from hetspec.daemon.decode.autoregressive import alone_tokens
from hetspec.daemon.decode.round_context import RoundContext, RoundKind
from hetspec.daemon.decode.verdict_site import VerdictSite
from hetspec.protocol import worker_messages as m
from hetspec.speculative.control.budget import Choice
from hetspec.speculative.control.rounds import NO_ONE_BESIDE, Beside, DraftCall, Plan
from hetspec.speculative.drafting.model_free import TreeProposal


def shaped(plan: Plan, remaining: int) -> Plan:
    """The round a plan runs with ``remaining`` tokens left to emit: gamma cut to them (an
    overlapped round drafts at least one); what was expected of it is not carried."""
    gamma = min(plan.gamma, remaining)
    return Plan(max(gamma, 1) if plan.overlap else gamma, plan.branches, plan.overlap, plan.rule)


def _depth(parents: Sequence[int]) -> int:
    depth = [0] * len(parents)
    for node, parent in enumerate(parents):
        depth[node] = 1 if parent < 0 else depth[parent] + 1
    return max(depth, default=0)


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # nothing awaits it: its failure is not news


@dataclass(frozen=True)
class LookupOffer:
    proposal: TreeProposal  # the model-free draft's nodes to verify
    plan: Plan  # its shape (depth, 1 branch or 2: a tree) and what the controller expects


@dataclass(frozen=True)
class Verification:
    reply: m.Verified
    seconds: float  # as the daemon saw it, the link included
    trial: bool  # a trial of the core choice not preferred: not what such rounds cost


@dataclass(frozen=True)
class AloneDecode:
    reply: m.Decoded
    frames: list
    usual: bool  # what decoding alone costs (not a trial, not beside a drafter at work)
    batch_rows: int = 0  # > 1: beside other requests, 1 + their rows a forward


class Scheduler:
    """One request's latency hiding. ``upcoming``: the next round's plan, chosen ahead (not
    committed until that round runs); ``early_draft``: the next round's draft call, sent."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.upcoming: Choice | None = None
        self.early_draft: asyncio.Future | None = None
        self._busy_drafter: asyncio.Future | None = None  # a draft dropped for a lookup
        # rounds since the last model-free draft's: the target alone decodes longer calls
        # as they grow (a lookup is weighed only between calls)
        self.rounds_without_lookup = 0
        self._proposed: tuple[tuple[int, int], TreeProposal] | None = None  # _proposal's

    # ------------------------------------------------------------ plans

    def next_round(self, remaining: int) -> tuple[Plan, RoundKind, TreeProposal | None]:
        """The next round: its plan, its kind, and for a model-free draft's or a grammar's
        round the nodes to verify. Where the request's grammar forces the next tokens, they
        are verified with no draft (the plan waits)."""
        ctx = self.ctx
        if ctx.constraint is None:
            return self._chosen_round(remaining)
        nodes = min(ctx.controller.limits.max_width - 1, remaining - 1)
        forced = ctx.constraint.forced(nodes)
        if forced:
            self._drop_early_draft_for_later()
            chain = TreeProposal(forced, list(range(-1, len(forced) - 1)), [1.0] * len(forced))
            return Plan(len(forced), 1), RoundKind.GRAMMAR, chain
        return self._chosen_round(remaining)

    def _drop_early_draft_for_later(self) -> None:
        """A round without the drafter runs first: a draft sent for the plan, which waits,
        is dropped (the text it drafted from will have grown)."""
        if self.early_draft is not None:
            self._busy_drafter, self.early_draft = self.early_draft, None
            self._busy_drafter.add_done_callback(_retrieved)

    def _chosen_round(self, remaining: int) -> tuple[Plan, RoundKind, TreeProposal | None]:
        """The request's own plan, else the one chosen ahead or the controller's choice now,
        committed only if it runs: a model-free draft runs instead where the controller
        prices it above that plan (the plan waits for the next round)."""
        ctx = self.ctx
        if ctx.fixed is not None:
            plan = shaped(ctx.fixed, remaining)
            self.post(plan.gamma * plan.branches + 1, plan.expected_tokens)
            return plan, ctx.kind(plan), None
        if ctx.pair.drafter is None:  # no draft model: the target alone, or a lookup
            alone = ctx.controller.alone_plan()
            offer = self._lookup_offer(alone, remaining)
            self.rounds_without_lookup = 0 if offer else self.rounds_without_lookup + 1
            if offer is None:
                self.post(1, 1.0)
                return alone, RoundKind.ALONE, None
            self._post_lookup(offer)
            return offer.plan, RoundKind.LOOKUP, offer.proposal
        choice, self.upcoming = self.upcoming or self._choose(), None
        offer = self._lookup_offer(choice.plan, remaining)
        if offer is not None:
            self.upcoming = choice
            self.rounds_without_lookup = 0
            self._drop_early_draft_for_later()
            self._post_lookup(offer)
            return offer.plan, RoundKind.LOOKUP, offer.proposal
        self.rounds_without_lookup += 1
        committed = ctx.controller.commit(choice)
        self.post(committed.gamma * committed.branches + 1, committed.expected_tokens)
        plan = shaped(committed, remaining)
        return plan, ctx.kind(plan), None

    # ------------------------------------------------------------ the requests beside

    def beside(self) -> Beside:
        """What the other requests decoding now put in each forward."""
        board = self.ctx.pair.board
        return NO_ONE_BESIDE if board is None else board.beside(self.ctx.pair.sequence)

    def post(self, rows: int, tokens: float) -> None:
        """This request's rounds now verify ``rows`` nodes a forward, committing ``tokens``
        (for the others' plans)."""
        board = self.ctx.pair.board
        if board is not None:
            board.post(self.ctx.pair.sequence, rows, tokens)

    def _post_lookup(self, offer: LookupOffer) -> None:
        self.post(len(offer.proposal.tokens) + 1, offer.plan.expected_tokens)

    def _choose(self) -> Choice:
        return self.ctx.controller.choose(self.beside())

    def _lookup_offer(self, rival: Plan, remaining: int) -> LookupOffer | None:
        """The model-free draft's nodes worth verifying instead of ``rival``, or None."""
        ctx = self.ctx
        nodes = min(ctx.controller.limits.max_width - 1, remaining - 1)
        if ctx.lookup is None or nodes < 1:
            return None
        proposal = self._proposal(nodes)
        price = ctx.controller.lookup_price(proposal.acceptance, rival, self.beside())
        width, tokens, seconds = price
        if width == 0:
            return None
        proposal = TreeProposal(*(column[:width] for column in proposal))
        chain = max(proposal.parents) == width - 2
        plan = Plan(
            _depth(proposal.parents), 1 if chain else 2, expected_tokens=tokens, round_s=seconds
        )
        return LookupOffer(proposal, plan)

    def _proposal(self, nodes: int) -> TreeProposal:
        """The model-free drafter's proposal of ``nodes`` nodes, made once for the text as it
        stands (a round asks whether to post, to wake the drafter and what to run next)."""
        key = (len(self.ctx.lookup), nodes)
        if self._proposed is None or self._proposed[0] != key:
            self._proposed = key, self.ctx.lookup.propose_tree(nodes, self.ctx.lookup_children)
        return self._proposed[1]

    def drafter_idle(self) -> bool:
        """Whether the drafter computes nothing: no prefill, no draft sent for a plan that
        waits (its cores may be borrowed)."""
        busy = self._busy_drafter
        return self.ctx.drafter.idle() and (busy is None or busy.done())

    def _weigh_next_plan(self) -> None:
        if self.ctx.fixed is None and self.upcoming is None:
            self.upcoming = self._choose()

    @property
    def _weighs_beside_draft(self) -> bool:
        """Where a drafting round weighs the next plan: beside its draft where the verifier
        computes on the CPU (the verification may borrow every core, and a core taken from it
        stalls all its threads), else beside its verification (on a GPU box the longer call,
        where an early draft may be done before the weighing would start)."""
        return self.ctx.pair.verifier_on_cpu

    async def awaiting(self, call: Awaitable, *, weigh: bool = True):
        """Await a worker call, choosing the next round's plan while it runs (weighing every
        candidate takes most of a millisecond the round would otherwise wait) unless not
        ``weigh``. ``call``: a coroutine, or the task of a call whose command was sent."""
        sent = isinstance(call, asyncio.Future)
        task = asyncio.ensure_future(call)
        try:
            if weigh and self.ctx.fixed is None and self.upcoming is None:
                await asyncio.sleep(0)  # the call's command goes out first
                self._weigh_next_plan()
            # a sent call's task runs to its reply: cancelled before its first step, it
            # would never hear of it
            return await (asyncio.shield(task) if sent else task)
        except BaseException:
            if sent:
                task.add_done_callback(_retrieved)
            else:
                task.cancel()
            raise

    # ------------------------------------------------------------ drafts

    async def draft(self, plan: Plan, kind: RoundKind) -> tuple[m.Drafted, DraftCall, float]:
        """A drafting round's draft: the one sent early for it, else a new call; the reply,
        its cost and the call's seconds."""
        early, self.early_draft = self.early_draft, None
        call = early if early is not None else self._draft_call(plan, kind, post=False)
        return await self.awaiting(call, weigh=self._weighs_beside_draft)

    def _draft_call(self, plan: Plan, kind: RoundKind, *, post: bool):
        """A plain or tree round's draft call; with ``post``, its command sent now (the
        drafter's prefill done) rather than once awaited."""
        ctx, shape = self.ctx, self._shape(plan, kind)
        call = ctx.drafter.post if post else ctx.drafter.draft
        return call(shape, ctx.params, length=ctx.position)

    def _shape(self, plan: Plan, kind: RoundKind) -> m.DraftShape:
        """What a plain or tree round of ``plan`` asks the drafter to draft."""
        controller = self.ctx.controller
        limits = controller.limits
        if self.ctx.constraint is not None:  # the drafter keeps a grammar's draft one chain
            return m.Chains(plan.gamma)
        if kind is RoundKind.TREE:
            depth, k = plan.gamma, limits.tree_k
            size = min(limits.max_width - 1, k * (1 + (depth - 1) * k))
            return m.DynamicTree(depth, k, size, controller.tree_first_choice.rate)
        if plan.rule:
            return m.RuleBranches(plan.gamma, plan.branches, controller.config.rule_scale)
        return m.Chains(plan.gamma, plan.branches)

    def _next_drafting_plan(self, remaining: int) -> tuple[Plan, RoundKind] | None:
        """The next round's plan where it is known already (fixed, or chosen ahead) and drafts
        a plain or tree round, shaped for ``remaining`` tokens left; else None."""
        ctx = self.ctx
        chosen = ctx.fixed or (self.upcoming.plan if self.upcoming is not None else None)
        if chosen is None or remaining <= 0 or not ctx.drafter.can_post():
            return None
        plan = shaped(chosen, remaining)
        kind = ctx.kind(plan)
        if kind not in (RoundKind.PLAIN, RoundKind.TREE):
            return None
        if ctx.fixed is None and self._lookup_offer(chosen, remaining) is not None:
            return None  # a model-free draft will likely run first
        return plan, kind

    def post_next_draft(self, remaining: int, stopped: bool) -> None:
        """Send the next round's draft now that this round's tokens are known, where that
        round drafts a plan known already. ``remaining``: what the request may emit after
        this round. Call it once nothing reads this round's draft rows (the next replace them)."""
        upcoming = None if stopped else self._next_drafting_plan(remaining)
        if upcoming is not None:
            plan, kind = upcoming
            self.early_draft = asyncio.ensure_future(self._draft_call(plan, kind, post=True))

    def drop_early_draft(self) -> None:
        """The request ended with a draft sent for a round that will not run: it runs to its
        reply (cancelled before its first step, its call would never hear of it), unread."""
        early, self.early_draft = self.early_draft, None
        if early is not None:
            early.add_done_callback(_retrieved)

    # ------------------------------------------------------------ verification

    async def verify(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        remaining: int,
        *,
        site: VerdictSite,
        walk: m.SampledWalk | None = None,
        beside: Callable[[], None] | None = None,
    ) -> Verification:
        """A drafting round's verification once its draft is done: the drafter idles, so the
        verifier may borrow its cores (the measured better choice, now and then the other as
        a trial); ``beside``: the daemon's work while the verifier computes. ``remaining``:
        what the request may emit from this round on (it emits at least one)."""
        ctx = self.ctx
        borrow = ctx.pair.verifier.spec.spare_cores and self.drafter_idle()
        cores = ctx.pair.verify_cores if borrow else None
        spare_cores = cores is not None and cores.choose()
        start = time.perf_counter()
        reply = ctx.verifier.verify(
            list(tokens),
            list(parents),
            spare_cores=spare_cores,
            argmax_only=site is VerdictSite.ARGMAX,
            walk=walk,
        )
        if beside is not None:
            beside()
        if not self._weighs_beside_draft:
            self._weigh_next_plan()
        verified, _ = await reply
        seconds = time.perf_counter() - start
        # wake the drafter for the draft about to be posted: it waits awake through the
        # verdict instead of waking when the draft comes (where the verifier borrowed its
        # cores, that wake-up was most of a draft call's link); wrong only where the round
        # ends the request: a short spin
        if self._next_drafting_plan(remaining - 1) is not None:
            ctx.drafter.announce()
        if cores is None:
            return Verification(verified, seconds, False)
        # per one-node verification: calls of every width compare
        size = ctx.controller.estimates.verify_size(len(tokens) + 1)
        cores.record(spare_cores, verified.elapsed_ms / 1000 / size)
        return Verification(verified, seconds, cores.exploring)

    # ------------------------------------------------------------ the target alone

    async def decode_alone(self, remaining: int) -> AloneDecode:
        """The target decodes a few tokens by itself (``alone_tokens`` of them), on the
        drafter's cores too where that measured faster and the drafter idles (it may still
        prefill: then the target keeps to its own cores)."""
        ctx = self.ctx
        idle = self.drafter_idle()
        # beside other requests a token costs their rows too: priced apart
        beside_rows = self.beside().rows
        cores = ctx.pair.alone_cores
        spare_cores = idle and cores.choose()
        steps = alone_tokens(
            ctx.controller.estimates.target_alone_s(), trial=idle and cores.exploring
        )
        if ctx.lookup is not None:  # soon after a lookup paid, weigh the next one soon
            steps = min(steps, 1 << min(self.rounds_without_lookup, 7))
        call = ctx.verifier.decode(
            min(steps, remaining),
            ctx.params,
            spare_cores=spare_cores,
            logprobs=ctx.logprobs,
            grammar=ctx.grammar_at,
            ends=ctx.ends,
        )
        decoded, frames = await self.awaiting(call)
        if idle:
            cores.record(spare_cores, decoded.elapsed_ms / 1000 / len(decoded.tokens))
        usual = idle and not cores.exploring
        return AloneDecode(decoded, frames, usual, 1 + beside_rows if beside_rows else 0)
