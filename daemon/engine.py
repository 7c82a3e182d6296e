"""Speculative decoding across the two workers, one round after the other (sequential mode).

Each round the drafter drafts ``gamma`` tokens in ``branches`` branches, the verifier evaluates
them as one tree, and ``hetspec.speculative.verify`` decides which drafted tokens the target
accepts and which token the target itself adds (the bonus). Only those tokens are emitted.

Bookkeeping between rounds, carried by the next round's commands: the drafter appends
everything emitted (its accepted nodes are reused, the bonus is evaluated) before it drafts;
the verifier commits only the accepted nodes, and the bonus token becomes the first node of the
next round's tree, so the target evaluates it together with the next draft instead of in a
forward of its own. The first token needs no round: the verifier's prefill returns the logits
after the prompt, the target chooses the token from them, and it becomes the first bonus; so
it arrives after the slower of the two prefills (they run at once), not after a draft.

The overlapped mode (drafting round k + 1 while round k is verified) builds on this loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from hetspec.daemon.generation import (
    GenerateRequest,
    GenerationResult,
    TextOutput,
    alone_tokens,
    first_token,
    token_budget,
)
from hetspec.daemon.worker_client import WorkerClient
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.speculative.branching import uncertainty_branches
from hetspec.speculative.budget import BudgetController, Decision
from hetspec.speculative.sampling import distribution
from hetspec.speculative.spare_cores import SpareCoreChoice
from hetspec.speculative.verify import (
    Verdict,
    accept_token,
    verify_greedy,
    verify_sampling,
)

VERIFIER_STREAM = 0x5EC  # told apart from the drafter's stream of the same seed (see __init__)


@dataclass
class SpeculativeStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds accepting >= depth
    gammas: list[int] = field(default_factory=list)
    branches: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    run_ahead: int = 0  # overlapped rounds: the drafter drafted ahead during verification
    run_ahead_held: int = 0  # ... whose run-ahead became the next draft
    rule_rounds: int = 0  # rounds drafted by DuoDecoding's uncertainty rule

    def summary(self, controller: BudgetController) -> dict:
        step = controller.draft_step_s(1)
        return {
            "rounds": self.rounds,
            "draft_n": self.drafted,
            "draft_n_accepted": self.accepted,
            "mean_accepted_length": round(self.accepted / self.rounds, 3) if self.rounds else 0,
            "acceptance_by_depth": self.accepted_by_depth,
            "gamma_history": self.gammas[-64:],
            "branch_history": self.branches[-64:],
            "t_draft_ms": round(step * 1000, 3) if step else None,
            "t_verify_ms": round(self.verify_ms / self.rounds, 3) if self.rounds else None,
            "run_ahead": self.run_ahead,
            "run_ahead_held": self.run_ahead_held,
            "rule_rounds": self.rule_rounds,
            "controller": controller.estimates(),
        }


def _draft_tree(drafted: m.Drafted) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Flatten branches into tree nodes: tokens, parents and each node's (branch, step)."""
    tokens, parents, origin = [], [], []
    for branch, row in enumerate(drafted.tokens):
        parent = -1
        for step, token in enumerate(row):
            tokens.append(token)
            parents.append(parent)
            origin.append((branch, step))
            parent = len(tokens) - 1
    return tokens, parents, origin


@dataclass(frozen=True)
class WorkerPair:
    drafter: WorkerClient
    verifier: WorkerClient
    arena: Arena
    draft_slot: int  # where the drafter writes its probability rows
    verify_slot: int  # where the verifier writes the tree's logits
    # whether the verifier, decoding alone, computes on the drafter's cores too
    cores: SpareCoreChoice = field(default_factory=SpareCoreChoice)
    # ... and whether it does while it verifies a plain round's draft (the drafter waits)
    verify_cores: SpareCoreChoice = field(default_factory=SpareCoreChoice)


@dataclass(frozen=True)
class RoundOutcome:
    emitted: list[int]  # verified tokens, cut at EOS and max_tokens
    stopped: bool  # EOS reached


class SpeculativeDecoder:
    """One request's rounds; the controller is shared with other requests (costs persist)."""

    def __init__(
        self,
        request: GenerateRequest,
        pair: WorkerPair,
        controller: BudgetController,
        stats: SpeculativeStats,
        *,
        gamma: int | None = None,
    ) -> None:
        self.request = request
        self.gamma = gamma  # a fixed draft length; None: the controller chooses
        self.pair = pair
        self.controller = controller
        self.stats = stats
        self.params = request.sampling
        # The drafter seeds its own generator with the request's seed; verification must draw
        # from an independent stream: with the same stream a drafted token and the uniform
        # that judges it are correlated, and the output no longer follows the target.
        seed = None if request.seed is None else [request.seed, VERIFIER_STREAM]
        self.rng = np.random.default_rng(seed)
        self.eos = -1 if request.ignore_eos else pair.verifier.ready.vocab.eos
        self.pending_bonus = -1  # emitted, not yet evaluated by the verifier (set by _begin)
        self.alone_streak = 0  # rounds in a row without a draft, up to this one
        self.drafter_prefill: asyncio.Future | None = None  # started by the first need
        self._drafter_prompt: list[int] = []
        # What the last round decided, sent with the next round's commands (one round trip
        # per worker per round instead of two): the verifier's accepted path, and the
        # drafter's emitted tokens.
        self.verifier_keeps: list[int] = []
        self.verifier_tree: list[int] = []  # the tokens of the last tree the verifier evaluated
        self.drafter_appends: list[int] = []
        self.max_tokens = 0  # the request's token budget, known once the prompt is tokenized
        self.upcoming: Decision | None = None  # the next round's budget, chosen in advance

    async def prefill(self, result: GenerationResult) -> int:
        """Prefill both workers at once; returns the first token, chosen by the target from
        its prefill's logits, as soon as the verifier's prefill is done: the drafter's goes on
        (``self.drafter_prefill``) until the first draft needs it. So the first token waits
        for the target's prefill only, never for a draft, and rounds without a draft need not
        wait for a slow drafter's prefill at all (a torch drafter on the CPU took longer over
        a prompt than the llama.cpp target over its first tokens).

        Where the target may compute on the drafter's cores (both on the CPU) it prefills
        on them too, and the drafter's prefill waits for the first draft: the first token
        then comes as fast as from the target alone (prefilled side by side, each on half
        the box, TTFT was ~1.5x the target alone's on 2 cores), and a demo-size draft
        prefills in a few milliseconds before its first draft. While the controller has the
        target decode alone the drafter's prefill waits in any case."""
        drafter, verifier = self.pair.drafter, self.pair.verifier
        started = time.perf_counter()
        text = self.request.prompt
        tokenized, _ = await verifier.call(m.Tokenize(request=verifier.next_request(), text=text))
        prompt = tokenized.tokens
        context = min(drafter.ready.context, verifier.ready.context)
        room = self.controller.max_width + 1
        self.max_tokens = token_budget(self.request, len(prompt), context, room)
        seed, slot = self.request.seed, self.pair.verify_slot
        self._drafter_prompt = prompt
        decodes_alone = self.gamma is None and self.controller.decodes_alone()
        wide = bool(verifier.spec.spare_cores) and self.pair.cores.preferred()
        if not (wide or decodes_alone):
            self._start_drafter_prefill()
        try:
            # the verifier samples by itself in rounds without a draft: its own stream, so
            # its draws are independent of the drafter's
            own = None if seed is None else seed ^ 0x7A26E7
            command = m.Prefill(request=verifier.next_request(), tokens=prompt, out=slot,
                                seed=own, spare_cores=wide)  # fmt: skip
            prefilled, _ = await verifier.call(command)
        except BaseException:
            if self.drafter_prefill is not None:
                self.drafter_prefill.cancel()
            raise
        result.prompt_tokens = len(prompt)
        result.prompt_ms = (time.perf_counter() - started) * 1000
        return first_token(self.pair.arena.view(prefilled.logits), self.params, self.rng)

    def _start_drafter_prefill(self) -> asyncio.Future:
        if self.drafter_prefill is None:
            drafter = self.pair.drafter
            command = m.Prefill(request=drafter.next_request(), tokens=self._drafter_prompt,
                                seed=self.request.seed)  # fmt: skip
            self.drafter_prefill = asyncio.ensure_future(drafter.call(command))
        return self.drafter_prefill

    def _drafter_idle(self) -> bool:
        return self.drafter_prefill is None or self.drafter_prefill.done()

    def _begin(self, first: int) -> None:
        """The first token is emitted; the verifier evaluates it with the first draft, the
        drafter drafts after it."""
        self.pending_bonus = first
        self.drafter_appends = [first]

    def _verdict(self, tokens, parents, logits, draft_rows) -> Verdict:
        """Which drafted tokens the target accepts, and its own next token."""
        if self.params.greedy:
            return verify_greedy(tokens, parents, logits)
        target_rows = distribution(logits, self.params)
        return verify_sampling(tokens, parents, draft_rows(), target_rows, self.rng)

    def _judge(self, tokens, parents, logits, draft_rows, remaining):
        """Verify a round's draft; see ``_settle``."""
        verdict = self._verdict(tokens, parents, logits, draft_rows)
        return (verdict, *self._settle(verdict, tokens, remaining))

    def _settle(self, verdict: Verdict, tokens, remaining: int) -> tuple[list[int], bool]:
        """The tokens to emit (cut at EOS and ``remaining``) and whether EOS came; sets what
        the next round tells the verifier."""
        emitted = verdict.tokens(np.asarray(tokens))
        stopped = self.eos in emitted
        emitted = emitted[: emitted.index(self.eos)] if stopped else emitted
        self.verifier_keeps = [0, *(node + 1 for node in verdict.path)]  # the bonus, the path
        self.pending_bonus = verdict.bonus
        return emitted[:remaining], stopped

    def _budget(self, remaining: int) -> tuple[int, int, bool]:
        """(gamma, branches, drafted by the uncertainty rule) for this round."""
        if self.gamma:
            dynamic = self.request.dynamic
            branches = self.request.branches or (self.controller.max_branches if dynamic else 1)
            return min(self.gamma, remaining), branches, dynamic
        decision = self._decision()
        return min(decision.gamma, remaining), decision.branches, decision.dynamic

    def _decision(self) -> Decision:
        """The controller's budget for this round: chosen while the last round's calls were
        in flight where it could be (``_choose_ahead``), else now."""
        decision, self.upcoming = self.upcoming, None
        return decision or self.controller.choose()

    async def _choosing_meanwhile(self, call):
        """Await a worker call, choosing the next round's budget while it runs."""
        task = asyncio.ensure_future(call)
        try:
            await self._choose_ahead()
            return await task
        except BaseException:
            task.cancel()
            raise

    async def _choose_ahead(self) -> None:
        """Choose the next round's budget while this round's calls are in flight. Weighing
        every candidate takes the controller ~0.3 ms on a busy 2-vCPU VM, 5-10% of a round
        when done between rounds; the daemon only waits meanwhile. Its data then lacks this
        round, which changes little (costs are medians over two dozen rounds, acceptance
        decays over dozens). The calls' commands go out first."""
        if self.gamma is None and self.upcoming is None:
            await asyncio.sleep(0)
            self.upcoming = self.controller.choose()

    async def round(self, remaining: int) -> RoundOutcome:
        return await self._sequential_round(remaining, *self._budget(remaining))

    def _rule_would_pick(self, probs: np.ndarray) -> int | None:
        """The k DuoDecoding's rule would pick for a chain drafted from these probability
        rows (it needs two), so the controller learns what the rule is worth on this text."""
        controller = self.controller
        if len(probs) < 2 or not controller.dynamic or controller.max_branches < 2:
            return None
        return uncertainty_branches(probs[0], float(probs[1].max()), controller.max_branches,
                                    controller.dynamic_scale)  # fmt: skip

    async def _sequential_round(
        self, remaining: int, gamma: int, branches: int, dynamic: bool = False
    ) -> RoundOutcome:
        """Draft (``branches`` x ``gamma``, or by the uncertainty rule with budget ``gamma``),
        then verify: one worker computes at a time. With gamma 0 the target decodes one token
        alone (where drafting does not pay, e.g. a slow drafter) and the drafter catches up
        whenever drafting resumes."""
        if gamma == 0:
            return await self._target_alone_round(remaining)
        self.alone_streak = 0
        arena = self.pair.arena
        round_start = time.perf_counter()
        drafted, draft_s = await self._draft(gamma, branches, self.drafter_appends, dynamic)
        tokens, parents, origin = _draft_tree(drafted)
        rule_k = None
        if dynamic:  # the shape the rule chose
            branches, gamma = len(drafted.tokens), len(drafted.tokens[0])
        elif branches == 1:
            rule_k = self._rule_would_pick(arena.view(drafted.probs)[0])
        start = time.perf_counter()
        wide = self.pair.verify_cores.choose()  # the drafter's call is done: it idles
        verified, _ = await self._choosing_meanwhile(self._verify(tokens, parents, wide=wide))
        verify_s = time.perf_counter() - start
        self.pair.verify_cores.record(wide, verified.elapsed_ms / 1000 / (len(tokens) + 1))
        logits = arena.view(verified.logits)  # row 0: the distribution the draft grows from

        def draft_rows() -> np.ndarray:
            probs = arena.view(drafted.probs)
            return np.stack([probs[b, s] for b, s in origin])

        verdict, emitted, stopped = self._judge(tokens, parents, logits, draft_rows, remaining)
        self.drafter_appends = emitted  # the drafter caught up with the rest in this draft
        round_s = time.perf_counter() - round_start
        self._record(
            gamma,
            branches,
            len(verdict.path),
            len(tokens) + 1,  # the tree: the pending bonus and the draft
            draft_s=draft_s,
            verify_s=verify_s,
            round_s=round_s,
            dynamic=dynamic,
            rule_k=rule_k,
        )
        return RoundOutcome(emitted, stopped)

    async def _target_alone_round(self, remaining: int) -> RoundOutcome:
        """No draft: the target decodes a few tokens (``alone_tokens``) by itself, drawing them
        in its own process as autoregressive mode does (``Decode``: the logits need not
        travel through the daemon, which made these rounds 25% slower than autoregressive
        decoding). It commits the last round's path and every token it draws but the last,
        which becomes the pending bonus. The drafter falls behind by the tokens and catches
        up when drafting resumes."""
        verifier = self.pair.verifier
        start = time.perf_counter()
        kept = [self.verifier_tree[node] for node in self.verifier_keeps]  # last round's path
        idle = self._drafter_idle()  # else the drafter prefills: the target stays on its own
        wide = idle and self.pair.cores.choose()
        steps = alone_tokens(self.controller.target_alone_s(),
                             trial=idle and self.pair.cores.exploring)  # fmt: skip
        decoded, _ = await self._choosing_meanwhile(verifier.call(
            m.Decode(
                request=verifier.next_request(),
                steps=min(steps, remaining),
                sampling=self.params,
                append=[*kept, self.pending_bonus],
                spare_cores=wide,
            )
        ))  # fmt: skip
        tokens = decoded.tokens
        self.verifier_tree, self.verifier_keeps = [], []  # nothing pending
        self.pending_bonus = tokens[-1]
        stopped = self.eos in tokens
        emitted = tokens[: tokens.index(self.eos)] if stopped else tokens[:remaining]
        self.drafter_appends = self.drafter_appends + emitted
        round_s = time.perf_counter() - start
        compute_s = decoded.elapsed_ms / 1000  # per token, below: what the controller wants
        if idle:
            self.pair.cores.record(wide, compute_s / len(tokens))
        # The first round without a draft is a transition: it evaluates the last round's
        # bonus and moves the worker onto the spare cores; its time is not what decoding
        # alone costs (taken for it, a one-round trial priced the target alone 2.5x too dear).
        steady, self.alone_streak = self.alone_streak > 0, self.alone_streak + 1
        self._record(0, 1, 0, 1, draft_s=0.0, verify_s=compute_s / len(tokens),
                     round_s=round_s / len(tokens) if steady else 0.0, dynamic=False,
                     rule_k=None)  # fmt: skip
        return RoundOutcome(emitted, stopped)

    def _verify(self, tokens: list[int], parents: list[int], *, wide: bool = False):
        """The verifier's call for a draft tree below the pending bonus (row 0 of the logits:
        after the bonus, where the draft grows from), committing the last round's path; on
        the drafter's cores too when ``wide`` (only while the drafter waits: moving a
        worker's threads costs ~0.5 ms on a 2-vCPU VM, more than a demo-target verification
        gains, far less than a heavy one's, so ``verify_cores`` measures which pays)."""
        verifier = self.pair.verifier
        self.verifier_tree = [self.pending_bonus, *tokens]
        return verifier.call(
            m.VerifyTree(
                request=verifier.next_request(),
                tokens=self.verifier_tree,
                parents=[-1, *(p + 1 for p in parents)],
                out=self.pair.verify_slot,
                commit=self.verifier_keeps,
                spare_cores=wide,
            )
        )

    async def _draft(
        self, gamma: int, branches: int, append: list[int], dynamic: bool = False
    ) -> tuple:
        """Draft after catching up with ``append``; returns the reply and the call's seconds,
        and records the cost of one draft step. The catch-up's forward yields the first
        token's distribution, so gamma tokens cost gamma forwards; but a long catch-up (after
        rounds without a draft) is not a step, so then the step is timed from the others.
        ``dynamic``: the rule shares a budget of ``gamma`` among up to ``branches``."""
        await self._start_drafter_prefill()
        drafter = self.pair.drafter
        start = time.perf_counter()
        drafted, _ = await drafter.call(
            m.Draft(
                request=drafter.next_request(),
                steps=gamma,
                sampling=self.params,
                out=self.pair.draft_slot,
                branches=branches,
                append=append,
                dynamic=self.controller.dynamic_scale if dynamic else None,
            )
        )
        seconds = time.perf_counter() - start
        branches, steps = len(drafted.tokens), len(drafted.tokens[0])
        if dynamic and branches > 1:
            steps += 1  # the rule's look at the top sequence's second token
        worker_s = drafted.elapsed_ms / 1000
        self.controller.record_draft_latency(seconds - worker_s)
        if len(append) <= 2:
            self.controller.record_draft(steps, branches, worker_s)
        elif steps >= 2:
            self.controller.record_draft(steps - 1, branches, worker_s - drafted.append_ms / 1000)
        return drafted, seconds

    def _record(
        self, gamma, branches, accepted, width, *, draft_s, verify_s, round_s, dynamic, rule_k
    ) -> None:
        if gamma == 0:
            self.controller.record_target_alone(round_s, compute_s=verify_s)
        else:
            self.controller.record_verify(width, verify_s)
            self.controller.record_overhead(round_s - draft_s - verify_s)
        self.controller.record_round(gamma, branches, accepted, dynamic=dynamic, rule_k=rule_k)
        self.stats.rule_rounds += dynamic
        self._count(
            gamma * branches,
            accepted,
            draft_s=draft_s,
            verify_s=verify_s,
            gamma=gamma,
            branches=branches,
        )

    def _count(self, drafted, accepted, *, draft_s, verify_s, gamma=None, branches=1) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += accepted
        stats.gammas.append(gamma or drafted)
        stats.branches.append(branches)
        stats.draft_ms += draft_s * 1000
        stats.verify_ms += verify_s * 1000
        stats.accepted_by_depth += [0] * (accepted - len(stats.accepted_by_depth))
        for depth in range(accepted):
            stats.accepted_by_depth[depth] += 1

    async def stream(self, result: GenerationResult) -> AsyncIterator[str]:
        """Yield text pieces of verified tokens only; ``result`` fills in as it goes."""
        first = await self.prefill(result)
        decode_start = time.perf_counter()
        output = TextOutput(self.pair.verifier.ready.token_bytes, self.request.stops)
        try:
            self._begin(first)
            outcome = RoundOutcome([], True) if first == self.eos else RoundOutcome([first], False)
            while True:
                pieces = []  # one write per round, not per token
                for token in outcome.emitted:
                    result.add(token)
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
            tail = output.flush()
            if tail:
                yield tail
        finally:
            result.decode_ms = (time.perf_counter() - decode_start) * 1000
            prefill = self.drafter_prefill
            if prefill is None:  # never needed: nothing was drafted
                pass
            elif not prefill.done():  # the request ended before any draft
                prefill.cancel()
            elif not prefill.cancelled():
                prefill.exception()  # retrieved: raised above if it mattered


async def _timed(call):
    """A call's reply and its seconds until the reply was in (not until it was awaited)."""
    start = time.perf_counter()
    reply = await call
    return reply, time.perf_counter() - start


@dataclass
class _Unverified:
    """A draft the verifier has not seen yet, as the drafter's pending tree holds it."""

    tokens: list[int]
    probs: np.ndarray  # (len(tokens), vocab): the distribution each token was drawn from
    last_parent: int  # the drafter's pending node the last (unevaluated) token hangs from


class OverlappedDecoder(SpeculativeDecoder):
    """Parallel and adaptive modes: while the verifier checks round k, the drafter drafts
    round k + 1.

    In adaptive mode the controller decides each round whether to overlap at all: where the
    two workers slow each other down (cores that share execution resources), a plain round
    (which may also draft several branches) can be the faster choice.

    The drafter runs ahead optimistically: it assumes every token of round k is accepted,
    guesses the target's bonus token itself, and drafts on from there, keeping everything in
    its pending tree. If the verifier accepts the whole draft and its bonus equals the guess,
    the run-ahead becomes the next draft at no waiting; otherwise it is dropped and the next
    draft starts from the verified tokens (the drafter catches up by appending them, which
    reuses what matched). The run-ahead's tokens are drawn given the guessed bonus, so when
    the guess holds they are exactly as valid a proposal as a fresh draft: output stays lossless.
    """

    MAX_RUN_AHEAD = 48  # emitted tokens the drafter may hold pending before it must catch up

    def __init__(self, request, pair: WorkerPair, controller, stats, *, gamma=None) -> None:
        super().__init__(request, pair, controller, stats, gamma=gamma)
        self.unverified: _Unverified | None = None
        self.behind: list[int] = []  # emitted tokens the drafter holds only as pending nodes

    def _begin(self, first: int) -> None:
        self.pending_bonus = first
        self.behind = [first]

    def _plan(self, remaining: int) -> tuple[int, int, bool, bool]:
        """(gamma, branches, overlap, dynamic) for this round: fixed (parallel mode: always
        overlap), or the controller's choice (adaptive mode: it overlaps only where that pays
        on this box; gamma 0, the target alone, and rule-drafted rounds are never overlapped)."""
        if self.gamma:
            return max(1, min(self.gamma, remaining)), 1, True, False
        d = self._decision()
        return min(d.gamma, remaining), d.branches, d.overlap, d.dynamic

    async def _draft_afresh(self, gamma: int) -> None:
        drafted, _ = await self._draft(gamma, 1, self.behind)
        self.behind = []
        self.unverified = self._unverified(drafted, skip=0)

    def _second_opinion(self, verdict: Verdict, guessed: m.Drafted, last_logits) -> tuple:
        """The whole draft was accepted; the run-ahead's first token guessed the bonus. Greedy:
        the guess holds if it is the target's argmax. Sampling: the guess is a token drawn from
        the drafter, so it is judged like one (kept with probability min(1, p/q), else the
        bonus is redrawn from the residual): the bonus still follows the target exactly, and
        the run-ahead is used far more often than if it had to equal an independent draw."""
        guess = guessed.tokens[0][0]
        if self.params.greedy:
            return verdict, guess == verdict.bonus
        target = distribution(last_logits, self.params)[0]
        draft = self.pair.arena.view(guessed.probs)[0, 0]
        held, bonus = accept_token(guess, draft, target, self.rng)
        return Verdict(verdict.path, bonus), held

    def _unverified(self, drafted: m.Drafted, skip: int) -> _Unverified:
        nodes = drafted.nodes[0]
        last_parent = nodes[-2] if len(nodes) >= 2 else drafted.root
        probs = self.pair.arena.view(drafted.probs)[0, skip:].copy()
        return _Unverified(drafted.tokens[0][skip:], probs, last_parent)

    def _run_ahead(self, draft: _Unverified, gamma: int) -> asyncio.Future | None:
        """Draft the next round below the draft under verification: the guessed bonus, then
        ``gamma`` tokens. None when the drafter holds too much unverified already."""
        if len(self.behind) + len(draft.tokens) >= self.MAX_RUN_AHEAD:
            return None
        drafter = self.pair.drafter
        command = m.Draft(
            request=drafter.next_request(),
            steps=gamma + 1,
            sampling=self.params,
            out=self.pair.draft_slot,  # the rows under verification were copied
            after=(draft.last_parent, draft.tokens[-1]),
        )
        return asyncio.ensure_future(_timed(drafter.call(command)))

    async def _take_run_ahead(self, ahead, gamma, verdict, tokens, logits):
        """Wait for the run-ahead; it becomes the next draft (``self.unverified``) when the
        whole draft was accepted and its guess of the bonus holds. Returns the verdict and
        the seconds the run-ahead's reply took."""
        (guessed, _), seconds = await ahead
        self.stats.run_ahead += 1
        self.stats.draft_ms += guessed.elapsed_ms
        worker_s = guessed.elapsed_ms / 1000
        self.controller.record_draft(gamma + 1, 1, worker_s, overlapped=True)
        self.controller.record_draft_latency(seconds - worker_s, overlapped=True)
        if len(verdict.path) == len(tokens):  # all accepted: does the guessed bonus hold?
            verdict, held = self._second_opinion(verdict, guessed, logits[-1:])
            if held:
                self.unverified = self._unverified(guessed, skip=1)
        return verdict, seconds

    async def round(self, remaining: int) -> RoundOutcome:
        gamma, branches, overlap, dynamic = self._plan(remaining)
        if self.unverified is None and not overlap:  # a plain round (branches allowed)
            self.drafter_appends, self.behind = self.behind, []
            outcome = await self._sequential_round(remaining, gamma, branches, dynamic)
            self.behind = list(self.drafter_appends)
            return outcome
        arena = self.pair.arena
        round_start = time.perf_counter()
        self.alone_streak = 0
        if self.unverified is None:
            await self._draft_afresh(gamma)
        fresh_s = time.perf_counter() - round_start  # the drafter catching up after a miss
        draft = self.unverified
        tokens = draft.tokens
        parents = list(range(-1, len(tokens) - 1))
        verify_start = time.perf_counter()
        verify = asyncio.ensure_future(self._verify(tokens, parents))
        ahead_gamma = max(1, min(gamma, remaining - len(tokens)))
        ahead = self._run_ahead(draft, ahead_gamma) if overlap else None
        try:
            await self._choose_ahead()
            verified, _ = await verify
        except BaseException:
            verify.cancel()
            if ahead is not None:
                ahead.cancel()
            raise
        verify_s = time.perf_counter() - verify_start
        logits = arena.view(verified.logits)
        verdict = self._verdict(tokens, parents, logits, lambda: draft.probs)
        self.unverified = None
        ahead_s = 0.0  # until the run-ahead's reply (sent with the verification)
        if ahead is not None:
            verdict, ahead_s = await self._take_run_ahead(
                ahead, ahead_gamma, verdict, tokens, logits
            )
        emitted, stopped = self._settle(verdict, tokens, remaining)
        self.behind += emitted
        if self.unverified is not None and (stopped or len(emitted) >= remaining):
            self.unverified = None  # the request ends here
        self.stats.run_ahead_held += self.unverified is not None
        round_s = time.perf_counter() - round_start
        self.controller.record_verify(len(tokens) + 1, verify_s, overlapped=ahead is not None)
        self.controller.record_overhead(round_s - fresh_s - max(verify_s, ahead_s))
        rule_k = self._rule_would_pick(draft.probs)
        self.controller.record_round(len(tokens), 1, len(verdict.path), rule_k=rule_k)
        self._count(len(tokens), len(verdict.path), draft_s=fresh_s, verify_s=verify_s)
        return RoundOutcome(emitted, stopped)
