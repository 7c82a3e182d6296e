"""Speculative decoding across the two workers: one request's rounds.

A round takes a ``Plan`` (from the budget controller, or fixed by the request) and returns
the verified tokens it emits and a ``RoundReport`` the controller learns from. Four kinds:
- plain: the drafter drafts ``branches`` x ``gamma`` (or by DuoDecoding's rule), then the
  verifier evaluates the draft as one tree and ``hetspec.speculative.verify.verdicts`` decides which
  drafted tokens the target accepts and which token it adds itself (the bonus);
- tree (``Limits.tree_k``, instead of plain single-branch rounds): the drafter drafts
  EAGLE-2's dynamic tree of ``gamma`` layers and ranks its nodes; the verified part is the
  ranked prefix that commits the most tokens per second (``speculative.dynamic_tree``);
- overlapped: while the verifier checks this round's single-branch draft, the drafter drafts
  the next one below it, guessing the bonus; if the whole draft and the guess hold, that
  run-ahead is the next round's draft at no waiting (its tokens were drawn given the guess,
  so they are as valid a proposal as a fresh draft: output stays lossless);
- the target alone (gamma 0): it decodes a few tokens by itself, where drafting does not pay.
Only verified tokens are emitted. The first token comes from the verifier's prefill logits,
so it waits for the target's prefill alone, never for a draft. A seeded request's tokens are
the target's keyed choices (``samplers.KeyedSampler``), the same whatever the rounds were.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hetspec.daemon.decode.autoregressive import alone_tokens, first_token
from hetspec.daemon.decode.requests import (
    GenerateRequest,
    GenerationResult,
    cut_at_end,
    end_ids,
    token_budget,
)
from hetspec.daemon.decode.round_sides import DrafterSide, Unverified, VerifierSide, WorkerPair
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.decode.text_output import TextOutput
from hetspec.daemon.supervision.worker_client import WorkerError
from hetspec.protocol import TokenLogprob, frame_array
from hetspec.protocol import worker_messages as m
from hetspec.speculative.control.budget import BudgetController, Choice
from hetspec.speculative.control.rounds import DraftCall, Plan, RoundReport
from hetspec.speculative.drafting.branching import uncertainty_branches
from hetspec.speculative.drafting.dynamic_tree import best_width, within_leaves
from hetspec.speculative.verify.distributions import distribution
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import KeyedSampler, sampler_for
from hetspec.speculative.verify.tree import is_path
from hetspec.speculative.verify.verdicts import (
    RowsOnDemand,
    Verdict,
    accept_token,
    verify_greedy,
    verify_sampled,
)

__all__ = ["Decoder", "WorkerPair"]


class RoundSink(Protocol):
    """Takes each round: the plan as chosen, its report, its seconds and tokens given."""

    def __call__(
        self, plan: Plan, report: RoundReport, *, seconds: float, emitted: int
    ) -> None: ...


def flatten(drafted: m.Drafted) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Branches as tree nodes: tokens, parents, and each node's (branch, step)."""
    tokens, parents, origin = [], [], []
    for branch, row in enumerate(drafted.tokens):
        parent = -1
        for step, token in enumerate(row):
            tokens.append(token)
            parents.append(parent)
            origin.append((branch, step))
            parent = len(tokens) - 1
    return tokens, parents, origin


def _shaped(plan: Plan, remaining: int) -> Plan:
    """The round a plan runs with ``remaining`` tokens left to emit: gamma cut to them (an
    overlapped round drafts at least one); what was expected of it is not carried."""
    gamma = min(plan.gamma, remaining)
    return Plan(max(gamma, 1) if plan.overlap else gamma, plan.branches, plan.overlap, plan.rule)


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # nothing awaits it: its failure is not news


@dataclass(frozen=True)
class RoundOutcome:
    emitted: list[int]  # verified tokens, cut at EOS and at the request's budget
    stopped: bool  # EOS reached
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when asked


class Decoder:
    """One request's rounds. ``plan``: a fixed plan (the request's gamma), else the
    controller's; the controller (shared by the mode's requests) learns from every round."""

    def __init__(
        self,
        request: GenerateRequest,
        pair: WorkerPair,
        controller: BudgetController,
        stats: SpeculativeStats,
        *,
        plan: Plan | None = None,
        log: RoundSink | None = None,
    ) -> None:
        self.request, self.pair, self.controller, self.stats = request, pair, controller, stats
        self.fixed = plan
        self.log = log  # each round's plan and report, where a round log is kept
        self.params = request.sampling
        # Seeded: keyed choices, the same noise as both workers'. Unseeded: speculative
        # sampling, from a stream of the daemon's own (the drafter's draws are independent).
        self.sampler = sampler_for(request.seed)
        self.position = 0  # the next token's index in the sequence (keyed noise's key)
        self.ends = end_ids(request, pair.verifier.ready.vocab)
        self.verifier = VerifierSide(pair)
        self.drafter: DrafterSide | None = None  # once the prompt is tokenized
        self.alone_streak = 0  # rounds in a row without a draft, up to this one
        self.upcoming: Choice | None = None  # the next round's plan, chosen ahead
        self.max_tokens = 0
        self.top = request.logprobs  # None: no log-probabilities
        self.first_logprob: list[TokenLogprob] | None = None
        # when the last round's period ended (its report; decoding's start before any): a
        # round's period runs from there to its own report, so that its overhead counts
        # everything between its calls, the bookkeeping and streaming around them included
        self.settled_at = 0.0
        # the next round's draft, sent as soon as this round's tokens were known
        self.early_draft: asyncio.Future | None = None

    # ------------------------------------------------------------ the request

    async def stream(self, result: GenerationResult) -> AsyncIterator[str]:
        """Yield text pieces of verified tokens only; ``result`` fills in as it goes."""
        try:
            first = await self._prefill(result)
        except BaseException:
            if self.drafter is not None:
                self.drafter.close()
            raise
        decode_start = self.settled_at = time.perf_counter()
        ready = self.pair.verifier.ready
        output = TextOutput(ready.token_bytes, self.request.stops, ready.special_tokens)
        self.verifier.bonus, self.drafter.unseen = first, [first]
        outcome = (
            RoundOutcome([], True)
            if first in self.ends
            else RoundOutcome([first], False, self.first_logprob)
        )
        try:
            while True:
                pieces = []  # one write per round, not per token
                for index, token in enumerate(outcome.emitted):
                    result.add(token, outcome.logprobs[index] if outcome.logprobs else None)
                    pieces.append(output.add(token))
                    if output.stopped:  # a stop string: the round's later tokens are dropped
                        break
                if any(pieces):
                    yield "".join(pieces)
                if outcome.stopped or output.stopped:
                    result.done_reason = "stop"
                    break
                if len(result.tokens) >= self.max_tokens:
                    break
                outcome = await self.round(self.max_tokens - len(result.tokens))
            if tail := output.flush():
                yield tail
        finally:
            result.decode_ms = (time.perf_counter() - decode_start) * 1000
            self._drop_early_draft()
            self.drafter.close()

    async def _prefill(self, result: GenerationResult) -> int:
        """Prefill the verifier and return the first token, chosen by the target from its
        prefill's logits. The drafter's prefill starts now only where the two do not share
        cores and drafting is planned; otherwise with the first draft."""
        verifier, started = self.pair.verifier, time.perf_counter()
        context = min(self.pair.drafter.ready.context, verifier.ready.context)
        verifier.prompt_bound.check(self.request.prompt, context)
        tokenized, _ = await verifier.call(
            m.Tokenize(request=verifier.next_request(), text=self.request.prompt)
        )
        prompt = tokenized.tokens
        room = self.controller.limits.max_width + 1
        self.max_tokens = token_budget(self.request, len(prompt), context, room)
        self.drafter = DrafterSide(self.pair, prompt, self.request.seed)
        if self.fixed is None:
            self.controller.begin_request(self.max_tokens)
        alone = (
            self.fixed is None
            and self.controller.decodes_alone()
            and not self.controller.probes_first()
        )
        spare_cores = bool(verifier.spec.spare_cores) and self.pair.alone_cores.preferred()
        head = self.pair.head  # a draft head prefills from the target's prompt features
        if not (spare_cores or alone or head):
            self.drafter.start_prefill()
        prefilled, frames = await verifier.call(
            m.Prefill(
                request=verifier.next_request(),
                tokens=prompt,
                out=self.pair.verify_slot,
                seed=self.request.seed,
                spare_cores=spare_cores,
                report_features=head,
            )
        )
        if head and prefilled.features is not None:
            rows = frame_array(prefilled.features, frames).copy()
            self.drafter.prompt_features = (prefilled.features_start, rows)
            if len(rows):  # the last row is the prompt's last position's
                self.drafter.features.add(len(prompt) - 1, rows[-1:])
        result.prompt_tokens = len(prompt)
        result.prompt_ms = (time.perf_counter() - started) * 1000
        logits = self.pair.arena.view(prefilled.logits)
        self.position = len(prompt) + 1
        first = first_token(logits, self.params, self.sampler, len(prompt))
        if self.top is not None:
            self.first_logprob = [token_logprob(logits[0], first, self.top)]
        return first

    # ------------------------------------------------------------ rounds

    def _plan(self, remaining: int) -> Plan:
        if self.fixed is not None:
            plan = self.fixed
        else:
            choice, self.upcoming = self.upcoming or self.controller.choose(), None
            plan = self.controller.commit(choice)
        return _shaped(plan, remaining)

    async def round(self, remaining: int) -> RoundOutcome:
        began = self.settled_at
        plan = self._plan(remaining)
        if not plan.overlap:
            self.drafter.run_ahead = None  # its pending nodes go with the next draft's append
        if plan.gamma == 0:
            outcome, report = await self._alone_round(remaining)
        elif plan.overlap:
            outcome, report = await self._overlapped_round(plan, remaining)
        elif self._tree_round_fits(plan):
            outcome, report = await self._tree_round(plan, remaining)
        else:
            outcome, report = await self._plain_round(plan, remaining)
        self.settled_at = time.perf_counter()
        self.alone_streak = self.alone_streak + 1 if plan.gamma == 0 else 0
        self.controller.observe(report)
        self.stats.count(report)
        if self.log is not None:  # the plan as chosen, with what the controller expected
            chosen = self.fixed or self.controller.history[-1]
            self.log(chosen, report, seconds=self.settled_at - began, emitted=len(outcome.emitted))
        return outcome

    async def _plain_round(self, plan: Plan, remaining: int):
        drafted, draft, draft_s = await self._choosing_ahead(
            self._draft(plan), weigh=self._weighs_beside_draft
        )
        tokens, parents, origin = flatten(drafted)
        probs = self.pair.arena.view(drafted.probs)
        # the rule's would-be k reads the draft's rows, which the next draft replaces: beside
        # a verification off the CPU, else once it is done
        rule_rows = None if plan.rule or len(drafted.tokens) > 1 else probs[0]
        beside = (
            None
            if rule_rows is None or self.pair.verifier_on_cpu
            else (lambda: self._rule_would_pick(rule_rows))
        )
        # a sampled walk's draft rows, node i's at index[i] of the drafter's rows, read in place
        index = None if self.params.greedy else [b * probs.shape[1] + s for b, s in origin]
        walk = self._walk(drafted.probs, index)
        verified, verify_s, trial, rule_k = await self._verify_while_drafter_idles(
            tokens, parents, remaining, beside, walk
        )
        width = len(tokens) + 1
        logits = self._target_rows(verified)
        draft_rows = (
            None if index is None else RowsOnDemand.at(probs.reshape(-1, probs.shape[-1]), index)
        )
        verdict = self._verdict(tokens, parents, verified, logits, draft_rows)
        emitted, stopped, logprobs = self._emitted(verdict, tokens, remaining, logits, verified)
        self.drafter.unseen = emitted  # it holds the rest as this draft's pending nodes
        branches, gamma = len(drafted.tokens), len(drafted.tokens[0])
        if rule_rows is not None and beside is None:
            rule_k = self._rule_would_pick(rule_rows)
        self._post_next_draft(remaining - len(emitted), stopped)  # the draft's rows are read
        first_branch = None
        if branches > 1:  # the path's first node is on the first branch, or it missed there
            on_first = bool(verdict.path) and origin[verdict.path[0]][0] == 0
            first_branch = len(verdict.path) if on_first else 0
        period_s = time.perf_counter() - self.settled_at
        report = RoundReport(
            gamma,
            branches,
            len(verdict.path),
            rule=plan.rule,
            rule_k=rule_k,
            first_branch_accepted=first_branch,
            drafts=(draft,),
            verify_width=width,
            verify_s=0.0 if trial else verify_s,
            verify_compute_s=verified.elapsed_ms / 1000,
            overhead_s=period_s - draft_s - verify_s,
            period_s=period_s,
        )
        return RoundOutcome(emitted, stopped, logprobs), report

    async def _verify_while_drafter_idles(
        self,
        tokens: list[int],
        parents: list[int],
        remaining: int,
        beside=None,
        walk: m.SampledWalk | None = None,
    ):
        """A round's verification once its draft is done: the drafter idles, so the verifier
        may borrow its cores (the measured better choice, now and then the other as a trial).
        The reply, its seconds, whether it was such a trial (not what rounds cost), and what
        ``beside`` (the daemon's work while the verifier computes, if any) returned.
        ``remaining``: what the request may emit from this round on; ``walk``: the verdict
        taken in the verifier (``_walk``)."""
        cores = self.pair.verify_cores if self.pair.verifier.spec.spare_cores else None
        spare_cores = cores is not None and cores.choose()
        start = time.perf_counter()
        reply = self.verifier.verify(
            tokens, parents, spare_cores=spare_cores, argmax_only=self._argmax_only, walk=walk
        )
        aside = beside() if beside is not None else None
        if not self._weighs_beside_draft:
            self._weigh_next_plan()
        verified, _ = await reply
        verify_s = time.perf_counter() - start
        self._announce_next_draft(remaining)
        if cores is None:
            return verified, verify_s, False, aside
        # per one-node verification: calls of every width compare
        size = self.controller.estimates.verify_size(len(tokens) + 1)
        cores.record(spare_cores, verified.elapsed_ms / 1000 / size)
        return verified, verify_s, cores.exploring, aside

    def _tree_round_fits(self, plan: Plan) -> bool:
        """Trees replace single-branch plain rounds of greedy and keyed requests. A drawn
        request keeps drawn chains: a tree's chosen nodes would be accepted with the target's
        probability of each (0.3 accepted a round at T = 1, against 1.8-2.1 drawn)."""
        return (
            bool(self.controller.limits.tree_k)
            and plan.branches == 1
            and not plan.rule
            and (self.params.greedy or isinstance(self.sampler, KeyedSampler))
        )

    async def _tree_round(self, plan: Plan, remaining: int):
        """EAGLE-2's dynamic tree of ``plan.gamma`` layers; of its ranked nodes, the verified
        prefix is the one that commits the most tokens per second, by the nodes' estimated
        acceptance (calibrated by what earlier tree rounds accepted) and the verifier's
        measured cost per width."""
        controller = self.controller
        calibration, first_choice = controller.tree_calibration, controller.tree_first_choice
        drafted, draft, draft_s = await self._choosing_ahead(
            self._draft(plan), weigh=self._weighs_beside_draft
        )
        settings = self.pair.verifier.spec.settings  # llama.cpp: a sequence id per leaf
        leaves = settings.n_seq_max - 1 if isinstance(settings, m.LlamaCppSettings) else None
        fits = within_leaves(drafted.parents, leaves)
        acceptance = drafted.acceptance[:fits]
        width = best_width(acceptance, calibration.factor, self.controller.estimates.verify_s)
        tokens, parents = drafted.tokens[0][:width], drafted.parents[:width]
        verified, verify_s, trial, _ = await self._verify_while_drafter_idles(
            tokens, parents, remaining, walk=self._walk()
        )
        logits = self._target_rows(verified)
        verdict = self._verdict(tokens, parents, verified, logits, None)  # greedy or keyed
        calibration.observe(float(sum(acceptance[:width])), len(verdict.path))
        first_choice.observe(parents, verdict.path)
        emitted, stopped, logprobs = self._emitted(verdict, tokens, remaining, logits, verified)
        self.drafter.unseen = emitted
        self._post_next_draft(remaining - len(emitted), stopped)
        period_s = time.perf_counter() - self.settled_at
        report = RoundReport(
            plan.gamma,
            1,
            len(verdict.path),
            drafts=(draft,),
            verify_width=len(tokens) + 1,
            verify_s=0.0 if trial else verify_s,
            verify_compute_s=verified.elapsed_ms / 1000,
            overhead_s=period_s - draft_s - verify_s,
            period_s=period_s,
        )
        return RoundOutcome(emitted, stopped, logprobs), report

    async def _overlapped_round(self, plan: Plan, remaining: int):
        start, drafts = time.perf_counter(), []
        if self.drafter.run_ahead is None:  # the last run-ahead missed: draft afresh first
            drafted, draft, _ = await self.drafter.draft(
                plan.gamma, 1, self.params, length=self.position
            )
            self.drafter.run_ahead, drafts = Unverified.of(drafted, self.pair.arena), [draft]
        fresh_s = time.perf_counter() - start
        draft, self.drafter.run_ahead = self.drafter.run_ahead, None
        tokens, parents = draft.tokens, list(range(-1, len(draft.tokens) - 1))
        verify_start = time.perf_counter()
        # a drawn request's second opinion below reads the target's last row: no walk there
        walk = self._walk(keyed_only=True)
        verify = asyncio.ensure_future(
            self.verifier.verify(tokens, parents, argmax_only=self._argmax_only, walk=walk)
        )
        ahead_gamma = max(1, min(plan.gamma, remaining - len(tokens)))
        ahead = self.drafter.start_run_ahead(draft, ahead_gamma, self.params)
        try:
            verified, _ = await self._choosing_ahead(verify)
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
        verify_s = time.perf_counter() - verify_start
        logits = self._target_rows(verified)
        verdict = self._verdict(tokens, parents, verified, logits, draft.probs)
        ahead_s, held = 0.0, None
        if ahead is not None:
            guessed, ahead_s = await ahead
            self.stats.run_ahead += 1
            compute_s = guessed.elapsed_ms / 1000
            drafts.append(
                DraftCall(guessed.forwards, 1, compute_s, ahead_s - compute_s, overlapped=True)
            )
            if len(verdict.path) == len(tokens):  # all accepted: does the guessed bonus hold?
                verdict, holds = self._second_opinion(verdict, guessed, logits)
                held = Unverified.of(guessed, self.pair.arena, skip=1) if holds else None
        emitted, stopped, logprobs = self._emitted(verdict, tokens, remaining, logits, verified)
        self.drafter.unseen += emitted
        if held is not None and not (stopped or len(emitted) >= remaining):
            self.drafter.run_ahead = held
            self.stats.run_ahead_held += 1
        period_s = time.perf_counter() - self.settled_at
        report = RoundReport(
            len(tokens),
            1,
            len(verdict.path),
            rule_k=self._rule_would_pick(draft.probs),
            drafts=tuple(drafts),
            verify_width=len(tokens) + 1,
            verify_s=verify_s,
            verify_compute_s=verified.elapsed_ms / 1000,
            verify_overlapped=ahead is not None,
            overhead_s=period_s - fresh_s - max(verify_s, ahead_s),
            period_s=period_s,
        )
        return RoundOutcome(emitted, stopped, logprobs), report

    async def _alone_round(self, remaining: int):
        """The target decodes a few tokens alone (``alone_tokens``), drawing them in its own
        process; the drafter falls behind by them and catches up when drafting resumes."""
        idle = self.drafter.idle()  # else the drafter prefills: the target keeps to its cores
        cores = self.pair.alone_cores
        spare_cores = idle and cores.choose()
        steps = alone_tokens(
            self.controller.estimates.target_alone_s(), trial=idle and cores.exploring
        )
        call = self.verifier.decode(
            min(steps, remaining), self.params, spare_cores=spare_cores, logprobs=self.top
        )
        decoded, frames = await self._choosing_ahead(call)
        tokens = decoded.tokens
        if decoded.features is not None and self.drafter.features is not None:
            features = frame_array(decoded.features, frames)
            self.drafter.features.add(decoded.features_start, features)
        self.verifier.decoded(tokens)
        self.position += len(tokens)
        emitted, stopped = cut_at_end(tokens, self.ends)
        emitted = emitted[:remaining]
        self.drafter.unseen += emitted
        compute_s = decoded.elapsed_ms / 1000 / len(tokens)
        if idle:
            cores.record(spare_cores, compute_s)
        # Not what decoding alone costs: the first round without a draft (a transition: it
        # evaluates the last round's bonus and moves the target onto the spare cores), a trial
        # of the core choice not preferred (two tokens, up to twice as slow), a round beside a
        # drafter at work. One such sample, never replaced while drafting looked better,
        # priced the target alone 1.4x too dear for a whole bench run.
        usual = idle and not cores.exploring
        period_s = time.perf_counter() - self.settled_at
        round_s = period_s / len(tokens) if self.alone_streak else None
        report = RoundReport(
            0,
            1,
            0,
            alone_round_s=round_s if usual else None,
            alone_compute_s=compute_s if usual else None,
        )
        return RoundOutcome(emitted, stopped, decoded.logprobs or None), report

    # ------------------------------------------------------------ pieces of a round

    def _draft(self, plan: Plan):
        """The draft call of a plain or tree round of ``plan``: the one sent early for it
        (``_post_next_draft``), else a new one."""
        early, self.early_draft = self.early_draft, None
        return early if early is not None else self._draft_call(plan, post=False)

    def _draft_call(self, plan: Plan, *, post: bool):
        """A draft call of a plain or tree round of ``plan``; with ``post``, its command sent
        now (the drafter's prefill done) rather than once awaited."""
        drafter, limits = self.drafter, self.controller.limits
        if self._tree_round_fits(plan):
            depth, k = plan.gamma, limits.tree_k
            size = min(limits.max_width - 1, k * (1 + (depth - 1) * k))
            call = drafter.post_tree if post else drafter.draft_tree
            return call(
                depth,
                k,
                size,
                self.params,
                length=self.position,
                first_accept=self.controller.tree_first_choice.rate,
            )
        scale = self.controller.config.rule_scale if plan.rule else None
        call = drafter.post_draft if post else drafter.draft
        return call(plan.gamma, plan.branches, self.params, scale, length=self.position)

    def _next_plain_draft(self, remaining: int) -> Plan | None:
        """The next round's plan where it is known already (fixed, or chosen ahead) and
        drafts a plain or tree round, as ``_plan`` will shape it with ``remaining`` tokens
        left to emit; else None."""
        chosen = self.fixed or (self.upcoming.plan if self.upcoming is not None else None)
        if chosen is None or remaining <= 0 or not self.drafter.can_post():
            return None
        plan = _shaped(chosen, remaining)
        return plan if plan.gamma > 0 and not plan.overlap else None

    def _post_next_draft(self, remaining: int, stopped: bool) -> None:
        """Send the next round's draft as soon as this round's tokens are known, where that
        round drafts a plain or tree round of a plan known already (fixed, or chosen ahead):
        the drafter drafts while the daemon reports this round, updates the controller and
        streams the tokens out. ``remaining``: what the request may emit after this round.
        Call it once nothing more reads this round's draft rows (the next draft's replace
        them)."""
        plan = None if stopped else self._next_plain_draft(remaining)
        if plan is not None:
            self.early_draft = asyncio.ensure_future(self._draft_call(plan, post=True))

    def _announce_next_draft(self, remaining: int) -> None:
        """Wake the drafter once a verification's reply is in where ``_post_next_draft`` will
        likely send it the next draft (``remaining``: what the request may emit from this
        round on, which emits at least one): it waits awake through the verdict instead of
        waking when the draft comes (where the verifier borrowed its cores, that wake-up was
        most of a draft call's link). Wrong only where the round ends the request: a short
        spin."""
        if self._next_plain_draft(remaining - 1) is not None:
            self.drafter.announce()

    def _drop_early_draft(self) -> None:
        """The request ended with a draft sent early for a round that will not run: it runs
        to its reply (a draft's time; cancelled before its first step, its call would never
        hear of it), which nothing reads."""
        early, self.early_draft = self.early_draft, None
        if early is not None:
            early.add_done_callback(_retrieved)

    @property
    def _weighs_beside_draft(self) -> bool:
        """Where a plain or tree round weighs the next plan: while its draft runs where the
        verifier computes on the CPU (the verification may borrow every core, and a core
        taken from it stalls all its threads), else while its verification runs (on a GPU
        box the longer call of the two, where an early draft may be done before the
        weighing, which then delays the verification's start)."""
        return self.pair.verifier_on_cpu

    def _weigh_next_plan(self) -> None:
        """Choose the next round's plan now, unless fixed or chosen already; it is
        committed only if that round runs."""
        if self.fixed is None and self.upcoming is None:
            self.upcoming = self.controller.choose()

    async def _choosing_ahead(self, call, *, weigh: bool = True):
        """Await a worker call, choosing the next round's plan while it runs (weighing every
        candidate takes most of a millisecond the daemon would otherwise add to the round)
        unless not ``weigh``. ``call``: a coroutine, or the task of a call whose command
        was sent (an early draft)."""
        sent = isinstance(call, asyncio.Future)
        task = asyncio.ensure_future(call)
        try:
            if weigh and self.fixed is None and self.upcoming is None:
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

    @property
    def _argmax_only(self) -> bool:
        """Greedy verification without log-probabilities needs each row's argmax alone."""
        return self.params.greedy and self.top is None

    def _walk(
        self,
        draft: m.ArrayRef | None = None,
        draft_rows: list[int] | None = None,
        *,
        keyed_only: bool = False,
    ) -> m.SampledWalk | None:
        """The verdict of a sampled request without log-probabilities, to be taken in the
        verifier (``SampledWalk``): only the rows its walk reaches leave the verifier's
        runtime, where the daemon's walk needed every row in the arena (a 128K-262K-token
        vocabulary makes them megabytes a round). Keyed: the verifier's own keyed sampler;
        drawn: ``draft`` (the drafter's rows, each drafted node's at ``draft_rows``) and a
        fresh seed from the daemon's stream, unless ``keyed_only``. None: the daemon walks."""
        if self.params.greedy or self.top is not None:
            return None
        if isinstance(self.sampler, KeyedSampler):
            return m.SampledWalk(self.params, self.position, keyed=True)
        if keyed_only or draft is None:
            return None
        seed = int(self.sampler.rng.integers(2**63))
        return m.SampledWalk(
            self.params, self.position, seed=seed, draft=draft, draft_rows=draft_rows
        )

    def _target_rows(self, verified: m.Verified) -> np.ndarray | None:
        """The verifier's logits rows, or with ``_argmax_only`` their argmax (1-d); None where
        the verifier took the verdict itself (``_walk``)."""
        if verified.logits is not None:
            return self.pair.arena.view(verified.logits)
        if verified.bonus >= 0:
            return None
        return np.asarray(verified.argmax, np.int64)

    def _walked(self, parents, verified: m.Verified) -> Verdict:
        """The verdict a verifier's walk replied, checked: a path of the tree it was sent and
        a bonus in the vocabulary (nothing unverified is emitted, a faulty worker's either)."""
        path, bonus, nodes = list(verified.path), verified.bonus, len(parents)
        vocab = self.pair.verifier.ready.vocab.size
        fits = all(0 <= node < nodes for node in path) and 0 <= bonus < vocab
        if not (fits and is_path(path, np.asarray(parents))):
            raise WorkerError(
                self.pair.verifier.spec.name,
                "protocol",
                f"a walk's verdict ({path}, bonus {bonus}) does not fit the "
                f"tree of {nodes} nodes it was sent",
            )
        return Verdict(path, bonus)

    def _verdict(self, tokens, parents, verified: m.Verified, logits, draft_rows) -> Verdict:
        """The verifier's own where it walked; else from ``logits``, whose row 0 chooses the
        token at ``self.position``."""
        if logits is None:
            return self._walked(parents, verified)
        if self.params.greedy:
            return verify_greedy(tokens, parents, logits)
        keyed = self.sampler if isinstance(self.sampler, KeyedSampler) else None
        return verify_sampled(
            tokens,
            parents,
            logits,
            self.params,
            position=self.position,
            keyed=keyed,
            rng=self.sampler.rng if keyed is None else None,
            draft=draft_rows,
        )

    def _emitted(
        self, verdict: Verdict, tokens, remaining: int, logits: np.ndarray, verified: m.Verified
    ):
        """The tokens to emit, cut at EOS and at ``remaining``, whether EOS came, and the
        tokens' log-probabilities from the target's ``logits`` when the request asked; the
        verifier keeps the accepted path and the bonus, whose features (the ones before each
        emitted token) a draft head gets with its next draft."""
        emitted = verdict.tokens(np.asarray(tokens))
        bonus_position = self.position - 1
        self.position += len(emitted)
        emitted, stopped = cut_at_end(emitted, self.ends)
        emitted = emitted[:remaining]
        self.verifier.accepted(verdict)
        if self.drafter.features is not None:
            kept = self.verifier.kept_features(verified, self.pair.arena)
            if kept is not None:
                self.drafter.features.add(bonus_position, kept)
        logprobs = None
        if self.top is not None:
            rows = verdict.rows()
            logprobs = [
                token_logprob(logits[row], token, self.top)
                for row, token in zip(rows, emitted, strict=False)
            ]
        return emitted, stopped, logprobs

    def _second_opinion(self, verdict: Verdict, guessed: m.Drafted, logits):
        """The whole draft was accepted and the run-ahead's first token guessed the bonus.
        Greedy and keyed: the guess holds if it is the target's choice, the bonus. Drawn: the
        guess was drawn from the drafter, so it is judged like a drafted token (kept with
        probability min(1, p/q), else the bonus is redrawn from the residual): the bonus
        still follows the target exactly."""
        guess = guessed.tokens[0][0]
        if self.params.greedy or isinstance(self.sampler, KeyedSampler):
            return verdict, guess == verdict.bonus
        target = distribution(logits[-1:], self.params)[0]
        draft = self.pair.arena.view(guessed.probs)[0, 0]
        held, bonus = accept_token(guess, draft, target, self.sampler.rng)
        return Verdict(verdict.path, bonus), held

    def _rule_would_pick(self, probs: np.ndarray) -> int | None:
        """The branch count DuoDecoding's rule would pick for a chain drafted from these
        probability rows, so the controller learns what the rule is worth on this text."""
        limits = self.controller.limits
        if len(probs) < 2 or not limits.rule or limits.max_branches < 2:
            return None
        return uncertainty_branches(
            probs[0], float(probs[1].max()), limits.max_branches, self.controller.config.rule_scale
        )
