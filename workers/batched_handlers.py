"""Several sequences' commands in one forward: ``VerifyTree``s (and ``Decode``s) of different
sequences, taken together from the command reader's backlog (``CommandReader.take_along``),
evaluated in one forward a step where the runtime has multi-sequence forwards
(``evaluate_together``: the native runtime's).

Contract: ``leads(command)`` says whether a command taken may gather others to run with it,
``joins(first, queued)`` whether a queued one may join it: the plain cases only (a tree's
logits to the arena, ``argmax_only`` or a sampled ``walk``, with ``commit``, ``root_row`` and
``extend``; decoding alone with no grammar and no features; a prompt of at most
``PREFILL_JOINS_UP_TO`` tokens with no features and no prompt log-probabilities), in a worker
serving several sequences on a runtime that evaluates them together; anything else runs on
its own. A prompt rides in the batch's steps ``PREFILL_BESIDE`` tokens a step while other
sequences' work shares the forward (so the others' decodings never stop for it), in the
runtime's own chunks where it is alone.
``run_together`` runs such commands and returns one result a command, in their order: its
``(reply, arrays)``, or the exception it failed with (the loop answers ``Failed``). Each reply
holds exactly what its command answers run alone (the kernels' rows are bit for bit those of a
forward of one sequence; decoding draws with ``DecodeSteps``, as ``TreeRuntime.decode`` does);
a refusal before a forward (one sequence's context full, a bad tree) runs that step's work
sequence by sequence instead, each with its own answer. Plain chain ``Draft``s of several
sequences batch among themselves (``batched_drafts.py``). ``together`` counts the batches run,
by command and size.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import TokenLogprob
from hetspec.workers.batched_drafts import draft_together, plain_draft
from hetspec.workers.compute_handlers import ComputeHandlers, Verification
from hetspec.workers.runtimes.decode_steps import DecodeSteps
from hetspec.workers.runtimes.sequence_work import Chunk, Tree

Result = tuple | Exception  # a command's (reply, arrays), or why it failed

# a prompt's tokens a step while other sequences' work shares the forward: a step's time is
# the others' token time, so a chunk this size costs them about three tokens' forwards (the
# native kernels, T(16) ~ 4x T(3) on a small CPU model) rather than the whole prompt's wait
PREFILL_BESIDE = 16
# longer prompts run alone, in the runtime's own chunks (and stop between them if cancelled:
# commands run together do not stop for a Cancel)
PREFILL_JOINS_UP_TO = 1024


@dataclass(eq=False)
class _Decoding:
    """One ``Decode`` of a batch: its engine, its draws, and the token it waits to have
    evaluated (None: its logits are ``logits``)."""

    index: int
    command: m.Decode
    engine: object
    steps: DecodeSteps
    logprobs: list[TokenLogprob] | None
    token: int | None = None
    logits: np.ndarray | Exception | None = None


@dataclass(eq=False)
class _Prefilling:
    """One ``Prefill`` of a batch: its engine, the tokens it reused and those still to
    evaluate."""

    index: int
    command: m.Prefill
    engine: object
    reused: int
    rest: list[int]


@dataclass(eq=False)
class _Batch:
    """What a batch holds between its steps: a result and a joining time per command, the
    verifications whose trees go in the next forward, the decodings and the prompts going."""

    results: list
    joined: list[float]
    pending: list[tuple[int, Verification]] = field(default_factory=list)
    running: list[_Decoding] = field(default_factory=list)
    prompts: list[_Prefilling] = field(default_factory=list)


class BatchedHandlers(ComputeHandlers):
    """``ComputeHandlers`` that also run several sequences' commands in one forward."""

    def __init__(self, spare) -> None:
        super().__init__(spare)
        self.together: Counter[tuple[str, int]] = Counter()  # (command, how many): batches

    def leads(self, command: msgspec.Struct) -> bool:
        """Whether ``command`` may run beside queued commands of other sequences."""
        return (
            len(self.sequences) > 1
            and hasattr(self.runtime, "evaluate_together")
            and (self._plain(command) or self._plain_draft(command))
        )

    def joins(self, first: msgspec.Struct, queued: msgspec.Struct) -> bool:
        """Whether ``queued`` may run in ``first``'s batch: verifications and decodings alone
        mix (a verification's tree rides in the first step's forward); drafts go with drafts."""
        if isinstance(first, m.Draft):
            return self._plain_draft(first) and self._plain_draft(queued)
        return self._plain(first) and self._plain(queued)

    def _plain_draft(self, command: msgspec.Struct) -> bool:
        return plain_draft(command) and 0 <= command.sequence < len(self.sequences)

    def _plain(self, command: msgspec.Struct) -> bool:
        if not 0 <= getattr(command, "sequence", -1) < len(self.sequences):
            return False  # answered on its own: Failed, naming the sequence
        if isinstance(command, m.VerifyTree):
            return command.features_out < 0
        if isinstance(command, m.Decode):  # (a refused step count: refused as alone)
            return command.grammar is None and not command.report_features and command.steps > 0
        if isinstance(command, m.Prefill):
            return (
                command.prompt_logprobs is None
                and command.features is None
                and not command.report_features
                and 0 < len(command.tokens) <= PREFILL_JOINS_UP_TO
            )
        return False

    def run_together(
        self,
        commands: list[msgspec.Struct],
        early: Callable[[int, Result], None] | None = None,
        more: Callable[[set[int]], list[msgspec.Struct]] | None = None,
    ) -> list[Result]:
        """One result a command of ``commands`` (all ``joins`` the first), in their order.
        The verifications' trees go in the first step's forward, beside each decoding's first
        token; the decodings then step on, one forward a step holding each still running
        sequence's token, each stopping at its own ``steps`` or end token. ``more(busy)``,
        where given, is asked before each later step for commands queued since, of sequences
        not in ``busy``: they join the batch (appended to ``commands``), a verification's
        tree in that step's forward, a decoding from that step on, so that no request waits
        for the others' decodings to end. ``early(index, result)``, where given, has each
        verification's result once its tree is evaluated (its reply need not wait for the
        decodings' later steps), and each prompt's once its last chunk is (a prompt rides
        PREFILL_BESIDE tokens a step beside other work); the list holds them too. A reply's
        ``elapsed_ms`` is the time from its joining to its own result, and a verification's
        ``batch_rows`` the rows of the forward that evaluated it: the daemon's controller
        prices a round by what it waited for."""
        kinds = sorted({type(command).__name__ for command in commands})
        self.together[" + ".join(kinds), len(commands)] += 1
        # lent where any command was sent with them: the batch's forward is the long call,
        # and the drafter's short drafts beside it cost less than the core it leaves idle
        self.spare.use(any(c.spare_cores for c in commands), self._set_extra_threads)
        if isinstance(commands[0], m.Draft):
            results = draft_together(commands, self._sequence, self._slot, self._evaluate, early)
            if any(c.spare_cores for c in commands):
                self.spare.use(False, self._set_extra_threads)
            return results
        start = time.perf_counter()
        batch = _Batch([None] * len(commands), [start] * len(commands))
        self._join(commands, range(len(commands)), batch)
        done: list[_Decoding] = []
        while batch.pending or batch.running or batch.prompts:
            waiting = [run for run in batch.running if run.token is not None]
            chunks = [Chunk(run.engine, [run.token]) for run in waiting]
            trees = [Tree(job.state.engine, *_tree(job.command)) for _, job in batch.pending]
            beside = len(trees) + len(chunks) + len(batch.prompts) > 1
            parts = [
                Chunk(p.engine, p.rest[: PREFILL_BESIDE if beside else p.engine.default_chunk])
                for p in batch.prompts
            ]
            outputs = self._evaluate([*trees, *chunks, *parts])
            first, after = len(trees), len(trees) + len(chunks)
            if batch.pending:
                width = sum(len(item.tokens) for item in (*trees, *parts)) + len(chunks)
                self._verify_done(
                    batch.pending, outputs[:first], batch.results, batch.joined, early, width=width
                )
                batch.pending = []
            for run, logits in zip(waiting, outputs[first:after], strict=True):
                run.token, run.logits = None, logits
            batch.running = self._step(batch.running, batch.results, done)
            batch.prompts = self._prefill_step(batch, parts, outputs[after:], early)
            if more is not None and (batch.running or batch.prompts):
                busy = {command.sequence for command in commands}
                late = [c for c in more(busy) if self.joins(commands[0], c)]
                if late:
                    indices = range(len(commands), len(commands) + len(late))
                    commands.extend(late)
                    batch.results.extend([None] * len(late))
                    batch.joined.extend([time.perf_counter()] * len(late))
                    self.together["joined " + type(late[0]).__name__, len(late)] += 1
                    self._join(commands, indices, batch)
        if any(c.spare_cores for c in commands):  # give the drafter its cores back
            self.spare.use(False, self._set_extra_threads)
        end = time.perf_counter()
        for run in done:
            elapsed = (end - batch.joined[run.index]) * 1000
            reply = m.Decoded(run.command.request, run.steps.drawn, elapsed, run.logprobs or [])
            batch.results[run.index] = (reply, ())
        return batch.results

    def _join(self, commands, indices, batch: _Batch) -> None:
        """The commands at ``indices`` into the batch: a verification's checks (its tree to
        the next forward), a decoding's start, a prompt's common prefix kept (the rest to
        evaluate in the next steps); a refusal is that command's result."""
        for index in indices:
            command = commands[index]
            try:
                if isinstance(command, m.VerifyTree):
                    state = self._sequence(command.sequence)
                    batch.pending.append((index, self._verify_start(command, state)))
                elif isinstance(command, m.Prefill):
                    engine = self._sequence(command.sequence).engine
                    reused, rest = engine.start_prefill(command.tokens)
                    batch.prompts.append(_Prefilling(index, command, engine, reused, rest))
                else:
                    batch.running.append(self._decoding(index, command))
            except Exception as error:  # answered as Failed, as the loop answers any command
                batch.results[index] = error

    def _prefill_step(self, batch: _Batch, parts, outputs, early) -> list[_Prefilling]:
        """Each prompt's chunk evaluated (``parts``, ``outputs``): those with tokens left;
        a finished one's reply (``prefill``'s: its sampler started, the last logits to its
        slot) or error is its result, handed to ``early``."""
        going = []
        for prompt, part, logits in zip(batch.prompts, parts, outputs, strict=True):
            command = prompt.command
            try:
                if isinstance(logits, Exception):
                    raise logits
                prompt.rest = prompt.rest[len(part.tokens) :]
                if prompt.rest:
                    going.append(prompt)
                    continue
                start = batch.joined[prompt.index]
                reply = self._prefilled(command, prompt.engine, prompt.reused, logits, start)
                batch.results[prompt.index] = (reply, ())
            except Exception as error:
                batch.results[prompt.index] = error
            if early is not None:
                early(prompt.index, batch.results[prompt.index])
        return going

    def _verify_done(self, jobs, rows_by_job, results, joined, early, *, width: int) -> None:
        """Each verification's reply (or error) from its tree's rows, handed to ``early``;
        ``width``: the forward's rows, every sequence's."""
        for (index, job), rows in zip(jobs, rows_by_job, strict=True):
            try:
                if isinstance(rows, Exception):
                    raise rows
                self._verify_rows(job, rows)
            except Exception as error:
                results[index] = error
        now = time.perf_counter()
        for index, job in jobs:
            if results[index] is None:
                elapsed = (now - joined[index]) * 1000
                results[index] = (self._verified(job, elapsed, batch_rows=width), ())
            if early is not None:
                early(index, results[index])

    @staticmethod
    def _step(running: list[_Decoding], results: list, done: list[_Decoding]) -> list[_Decoding]:
        """Each decoding's draw from its logits: those still going (their next token to
        evaluate), the finished ones added to ``done``, a failure into ``results``."""
        going = []
        for run in running:
            try:
                if isinstance(run.logits, Exception):
                    raise run.logits
                more = run.steps.draw(run.logits, run.engine.committed)
            except Exception as error:
                results[run.index] = error
                continue
            if more:
                run.token = run.steps.drawn[-1]
                going.append(run)
            else:
                done.append(run)
        return going

    def _decoding(self, index: int, command: m.Decode) -> _Decoding:
        """A ``Decode``'s start, as ``decode`` makes it: ``append`` made to follow (all but
        the last token it evaluates, which waits for the batch's first forward)."""
        state = self._sequence(command.sequence)
        engine = state.engine
        logprobs = [] if command.logprobs is not None else None
        steps = DecodeSteps(
            command.steps,
            command.sampling,
            state.sampler,
            logprobs=logprobs,
            top=command.logprobs or 0,
            ends=frozenset(command.ends),
        )
        run = _Decoding(index, command, engine, steps, logprobs)
        run.token = engine.catch_up(command.append) if command.append else None
        if run.token is None:
            engine.discard_pending()
            run.logits = engine.last_logits()
        return run

    # ------------------------------------------------------------ shared

    def _evaluate(self, work: list[Tree | Chunk]) -> list[np.ndarray | Exception]:
        """Each item's logits (a ``Tree``'s rows, a ``Chunk``'s last row) from one forward;
        where the runtime refuses the forward (refusals come before it: nothing evaluated),
        each item on its own, with its own answer or error."""
        if not work:
            return []
        try:
            return self.runtime.evaluate_together(work)
        except ValueError:  # RuntimeUsageError, TreeError: one sequence's, before the forward
            return [_alone(item) for item in work]


def _tree(command: m.VerifyTree) -> tuple:
    return command.tokens, command.parents, command.extend


def _alone(item: Tree | Chunk) -> np.ndarray | Exception:
    """What ``evaluate_together`` gives for ``item``, from its sequence's engine alone, or
    the exception it raised there."""
    engine = item.sequence
    try:
        if isinstance(item, Tree):
            return engine.evaluate_tree(item.tokens, item.parents, extend=item.extend)
        engine.append(item.tokens)
        return engine.last_logits()
    except Exception as error:  # that item's own answer: Failed
        return error
