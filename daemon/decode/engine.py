"""Speculative decoding across the two workers: one request, prefill to its last round.

The first token comes from the verifier's prefill logits, so it waits for the target's
prefill alone, never for a draft. Then each round runs the controller's plan (or the
request's own) as one of the kinds in ``round_kinds``; the controller learns from every
round's report. Only verified tokens are emitted. A seeded request's tokens are the target's
keyed choices (``samplers.KeyedSampler``), the same whatever the rounds were.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from hetspec.daemon.decode.autoregressive import first_token
from hetspec.daemon.decode.prompt_input import (
    prefill,
    prompt_ids,
    record_prompt,
    wanted_prompt_logprobs,
)
from hetspec.daemon.decode.requests import (
    GenerateRequest,
    GenerationResult,
    end_ids,
    token_budget,
)
from hetspec.daemon.decode.round_context import Emitted, RoundContext, RoundKind
from hetspec.daemon.decode.round_kinds import (
    alone_round,
    grammar_round,
    lookup_round,
    overlapped_round,
    plain_round,
    tree_round,
)
from hetspec.daemon.decode.round_sides import DrafterSide, NoDrafter, VerifierSide, WorkerPair
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.decode.scheduler import Scheduler
from hetspec.daemon.decode.text_output import TextOutput
from hetspec.protocol import frame_array
from hetspec.protocol import worker_messages as m
from hetspec.speculative.constrain.constraint import Constraint
from hetspec.speculative.control.budget import BudgetController
from hetspec.speculative.control.rounds import Plan, RoundReport
from hetspec.speculative.drafting.model_free import ModelFreeDrafter
from hetspec.speculative.verify.logprobs import token_logprob
from hetspec.speculative.verify.samplers import sampler_for

__all__ = ["Decoder", "LookupSource", "WorkerPair"]


class RoundSink(Protocol):
    """Takes each round: the plan as chosen, its report, its seconds and tokens given."""

    def __call__(
        self, plan: Plan, report: RoundReport, *, seconds: float, emitted: int
    ) -> None: ...


@dataclass(frozen=True)
class LookupSource:
    """Where a request's model-free drafter comes from: ``drafter()`` makes one, and
    ``children`` bounds the children it may propose below a node (1: chains)."""

    drafter: Callable[[], ModelFreeDrafter]
    children: int | None = None


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
        lookup: LookupSource | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        if pair.drafter is None and plan is not None and plan.gamma > 0:
            raise ValueError(f"a draft of {plan.gamma} tokens a round needs a draft model")
        self.request, self.pair, self.controller, self.stats = request, pair, controller, stats
        self.fixed = plan
        # model-free drafts, weighed against the controller's plans (not a request's own)
        self.lookup = lookup if plan is None else None
        self.log = log  # each round's plan and report, where a round log is kept
        self.constraint = constraint  # the request's grammar, fresh (nothing consumed)
        self.ctx: RoundContext | None = None  # once the prompt is tokenized
        self.schedule: Scheduler | None = None
        self.max_tokens = 0

    async def stream(self, result: GenerationResult) -> AsyncIterator[str]:
        """Yield text pieces of verified tokens only; ``result`` fills in as it goes."""
        try:
            outcome = await self._prefill(result)
        except BaseException:
            if self.ctx is not None:
                self.ctx.drafter.close()
            raise
        if self.max_tokens == 0:  # the prompt's prefill alone (an echo)
            outcome = Emitted([], False)
        ctx = self.ctx
        decode_start = ctx.settled_at = time.perf_counter()
        ready = self.pair.verifier.ready
        output = TextOutput(ready.token_bytes, self.request.stops, ready.special_tokens)
        try:
            while True:
                pieces = []  # one write per round, not per token
                for index, token in enumerate(outcome.tokens):
                    result.add(token, outcome.logprobs[index] if outcome.logprobs else None)
                    pieces.append(output.add(token))
                    if output.stopped:  # a stop string: the round's later tokens are dropped
                        break
                if any(pieces):
                    yield "".join(pieces)
                if outcome.stopped or output.stopped:
                    if not output.stopped and outcome.logprobs:  # the end token's: reported
                        result.logprobs += outcome.logprobs[len(outcome.tokens) :]
                    result.done_reason = "stop"
                    break
                if len(result.tokens) >= self.max_tokens:
                    break
                outcome = await self.round(self.max_tokens - len(result.tokens))
            if tail := output.flush():
                yield tail
        finally:
            result.decode_ms = (time.perf_counter() - decode_start) * 1000
            self.stats.grammar_cost(ctx.constraint)
            self.schedule.drop_early_draft()
            ctx.drafter.close()

    async def _prefill(self, result: GenerationResult) -> Emitted:
        """Prefill the verifier; the first token, chosen by the target from its prefill's
        logits. The drafter's prefill starts now only where the two do not share cores and
        drafting is planned; otherwise with the first draft."""
        request, pair, verifier = self.request, self.pair, self.pair.verifier
        started = time.perf_counter()
        context = verifier.ready.context
        if pair.drafter is not None:
            context = min(pair.drafter.ready.context, context)
        prompt = await prompt_ids(request, verifier, context)
        room = self.controller.limits.max_width + 1
        self.max_tokens = token_budget(request, len(prompt), context, room)
        # Seeded: keyed choices, the same noise as both workers'. Unseeded: speculative
        # sampling, from a stream of the daemon's own (the drafter's draws are independent).
        ctx = self.ctx = RoundContext(
            pair,
            self.controller,
            self.stats,
            request.sampling,
            sampler_for(request.seed),
            end_ids(request, verifier.ready.vocab),
            request.logprobs,
            VerifierSide(pair),
            NoDrafter() if pair.drafter is None else DrafterSide(pair, prompt, request.seed),
            fixed=self.fixed,
            constraint=self.constraint,
        )
        if self.constraint is not None:
            ctx.grammar_at = m.GrammarAt(self.constraint.text, len(prompt))
            ctx.drafter.grammar = ctx.grammar_at
        if self.lookup is not None:
            ctx.lookup, ctx.lookup_children = self.lookup.drafter(), self.lookup.children
            ctx.lookup.extend(prompt)
        self.schedule = Scheduler(ctx)
        if self.fixed is None:
            self.controller.begin_request(self.max_tokens)
        alone = (
            self.fixed is None
            and self.controller.decodes_alone()
            and not self.controller.probes_first()
        )
        spare_cores = bool(verifier.spec.spare_cores) and pair.alone_cores.preferred()
        if not (spare_cores or alone or pair.head):  # a head prefills from the target's features
            ctx.drafter.start_prefill()
        prefilled, frames = await prefill(
            verifier,
            m.Prefill(
                request=verifier.next_request(),
                tokens=prompt,
                out=pair.verify_slot,
                seed=request.seed,
                spare_cores=spare_cores,
                report_features=pair.head,
                prompt_logprobs=wanted_prompt_logprobs(request),
                sequence=pair.sequence,
            ),
            pair.prefill_chunk,
        )
        record_prompt(result, prompt, prefilled)
        if pair.head and prefilled.features is not None:
            rows = frame_array(prefilled.features, frames).copy()
            ctx.drafter.prompt_features = (prefilled.features_start, rows)
            if len(rows):  # the last row is the prompt's last position's
                ctx.drafter.features.add(len(prompt) - 1, rows[-1:])
        result.prompt_tokens = len(prompt)
        result.prompt_ms = (time.perf_counter() - started) * 1000
        logits = pair.arena.view(prefilled.logits)
        if ctx.constraint is not None:  # the first token is chosen under the grammar too
            logits = ctx.constraint.masked(logits[0])[None, :]
        ctx.position = len(prompt) + 1
        first = first_token(logits, ctx.params, ctx.sampler, len(prompt))
        ctx.verifier.bonus, ctx.drafter.unseen = first, [first]
        ctx.emitted([first])
        top = request.logprobs
        logprob = None if top is None else [token_logprob(logits[0], first, top)]
        if first in ctx.ends:  # reported, not emitted: a scorer reads the answer's first row
            return Emitted([], True, logprob)
        return Emitted([first], False, logprob)

    async def round(self, remaining: int) -> Emitted:
        """One round of the next plan, ``remaining`` tokens left to emit; the controller
        learns from its report."""
        ctx, schedule = self.ctx, self.schedule
        began = ctx.settled_at
        plan, kind, proposal = schedule.next_round(remaining)
        if kind is not RoundKind.OVERLAPPED:
            ctx.drafter.run_ahead = None  # its pending nodes go with the next draft's append
        if kind is RoundKind.ALONE:
            emitted, report = await alone_round(ctx, schedule, remaining)
        elif kind is RoundKind.LOOKUP:
            emitted, report = await lookup_round(ctx, schedule, proposal, remaining)
        elif kind is RoundKind.GRAMMAR:
            emitted, report = await grammar_round(ctx, schedule, proposal, remaining)
        elif kind is RoundKind.OVERLAPPED:
            emitted, report = await overlapped_round(ctx, schedule, plan, remaining)
        elif kind is RoundKind.TREE:
            emitted, report = await tree_round(ctx, schedule, plan, remaining)
        else:
            emitted, report = await plain_round(ctx, schedule, plan, remaining)
        ctx.settled_at = time.perf_counter()
        ctx.alone_streak = ctx.alone_streak + 1 if kind is RoundKind.ALONE else 0
        self.controller.observe(report)
        self.stats.count(report)
        if self.log is not None:  # the plan as chosen, with what the controller expected
            # no plan committed
            own = kind in (RoundKind.LOOKUP, RoundKind.GRAMMAR) or self.pair.drafter is None
            chosen = plan if own else self.fixed or self.controller.history[-1]
            seconds = ctx.settled_at - began
            self.log(chosen, report, seconds=seconds, emitted=len(emitted.tokens))
        return emitted
