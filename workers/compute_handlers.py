"""What each command does to the engine and the arena: the worker's handlers.

Contract: a handler takes a command and its frames and returns ``(reply, arrays)``: the reply
to send and the arrays to send with it as frames. A compute command acts on its ``sequence``'s
state alone (``SequenceState``: its engine, with its own KV cache, committed tokens and pending
tree; the sampler its Prefill's seed set; its grammar); a sequence the worker does not serve is
a ``RuntimeUsageError`` naming both numbers. Tokenize and the load-level calls use sequence 0's
engine; the spare cores are lent to the whole worker. Outputs too big for a frame (probability
rows, logits, features for the drafter) go to the arena slot the command names, and the reply
says where. A handler raises instead of answering where the command cannot be done
(``RuntimeUsageError``, ``ArenaError``, ``LoadError`` with no model loaded, ...); the
worker's loop (``worker.Worker``) turns that into ``Failed``. Handlers never send: one reply
a command, sent by the loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from hetspec.protocol import Arena, ArenaError, MessageError, frame_array, frame_ref
from hetspec.protocol import worker_messages as m
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler, Sampler, sampler_for
from hetspec.speculative.verify.verdicts import RowsOnDemand, Verdict, verify_sampled
from hetspec.workers.runtimes.loading import LoadError, sequence_engines
from hetspec.workers.runtimes.spare_cores import SpareCores
from hetspec.workers.runtimes.tree_runtime import RuntimeUsageError, TreeDraftResult
from hetspec.workers.worker_grammar import GrammarTable, WorkerGrammar


@dataclass
class SequenceState:
    """One sequence a worker serves: its engine (a runtime, or one of its ``siblings``), the
    sampler of the request on it (from its Prefill's seed) and that request's grammar."""

    engine: object
    grammar: WorkerGrammar
    sampler: Sampler = field(default_factory=DrawnSampler)


@dataclass
class Verification:
    """A ``VerifyTree`` between its start (its checks, commit and root row) and its reply."""

    command: m.VerifyTree
    state: SequenceState
    first: int  # the arena row of the tree's first node: 1 after a root row, else 0
    out: np.ndarray | None = None  # the arena's rows, where the logits go there
    argmax: list[int] = field(default_factory=list)
    verdict: Verdict | None = None  # a sampled walk's


class ComputeHandlers:
    """The sequences (``sequences``, once loaded; ``runtime`` is sequence 0's engine), the
    arena, and a handler for each command that computes or reads them."""

    def __init__(self, spare: SpareCores) -> None:
        self.spare = spare
        self.sequences: list[SequenceState] = []
        self.arena: Arena | None = None
        # whether the daemon cancelled the command running now (see Worker.serve)
        self.cancelled: Callable[[], bool] = lambda: False
        self._grammar_table = GrammarTable()  # the vocabulary's, for every sequence's grammar

    @property
    def runtime(self):
        """Sequence 0's engine (the loaded runtime itself), or None before a load."""
        return self.sequences[0].engine if self.sequences else None

    @runtime.setter
    def runtime(self, runtime) -> None:
        self.serve_engines(sequence_engines(runtime) if runtime is not None else [])

    def serve_engines(self, engines: list) -> None:
        """Serve one sequence an engine (none: nothing loaded), each with a fresh sampler and
        grammar."""
        self.sequences = [
            SequenceState(engine, WorkerGrammar(lambda: self.runtime, self._grammar_table))
            for engine in engines
        ]

    def _sequence(self, sequence: int) -> SequenceState:
        """The state of ``sequence``: ``LoadError`` before a load, ``RuntimeUsageError`` for a
        sequence this worker does not serve."""
        if not self.sequences:
            raise LoadError("no model is loaded")
        if not 0 <= sequence < len(self.sequences):
            raise RuntimeUsageError(
                f"sequence {sequence} is not served here: this worker serves "
                f"{len(self.sequences)} (0..{len(self.sequences) - 1})"
            )
        return self.sequences[sequence]

    def _engine(self, state: SequenceState, spare_cores: bool | None = None):
        """``state``'s engine, computing on the spare cores too when a compute command says
        so (None: light work, which leaves the cores as they are)."""
        if spare_cores is not None:
            self.spare.use(spare_cores, self._set_extra_threads)
        return state.engine

    def _set_extra_threads(self, extra: int) -> None:
        """The spare cores are the worker's: every sequence's engine computes on them."""
        for state in self.sequences:
            state.engine.set_extra_threads(extra)

    def _slot(self, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        if self.arena is None:
            raise ArenaError("no shared-memory arena was given at load")
        return self.arena.empty(slot, shape)

    def _features_in(self, engine, ref: m.ArrayRef, frames) -> np.ndarray:
        if not hasattr(engine, "provide_features"):
            raise RuntimeUsageError("this worker drafts without the target's features")
        if ref.frame < 1:
            raise MessageError("input features travel in a frame")
        return frame_array(ref, frames)

    @contextlib.contextmanager
    def _reporting(self, engine, wanted: bool):
        """Collect the features of what is evaluated inside the block, when ``wanted``."""
        if not wanted:
            yield None
            return
        with engine.features_captured() as sink:
            yield sink

    @staticmethod
    def _stacked(engine, sink: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(sink) if sink else np.zeros((0, engine.feature_size), np.float32)

    def _reported(self, reply, engine, sink: list[np.ndarray] | None) -> tuple:
        """``reply`` with the features ``sink`` collected, ending at the committed end, in a
        frame (none asked: as it is)."""
        if sink is None:
            return reply, ()
        rows = self._stacked(engine, sink)
        reply = msgspec.structs.replace(
            reply, features=frame_ref(rows, 1), features_start=engine.committed - len(rows)
        )
        return reply, (rows,)

    def prefill(self, command: m.Prefill, frames) -> tuple:
        start = time.perf_counter()
        state = self._sequence(command.sequence)
        engine = self._engine(state, command.spare_cores)
        engine.interrupt = self.cancelled  # a long prompt stops between chunks when cancelled
        prompt_logprobs = []
        try:
            with self._reporting(engine, command.report_features) as sink:
                if command.prompt_logprobs is not None:  # every position's row: nothing reused
                    prompt_logprobs = engine.prompt_logprobs(
                        command.tokens, command.prompt_logprobs
                    )
                    reused = 0
                elif command.features is not None:
                    features = self._features_in(engine, command.features, frames)
                    reused = engine.prefill(
                        command.tokens, features=features, start=command.features_start
                    )
                else:
                    reused = engine.prefill(command.tokens)
        finally:
            engine.interrupt = None
        reply = self._prefilled(command, engine, reused, engine.last_logits(), start)
        reply = msgspec.structs.replace(reply, prompt_logprobs=prompt_logprobs)
        return self._reported(reply, engine, sink)

    def _prefilled(
        self, command: m.Prefill, engine, reused: int, logits: np.ndarray, start: float
    ) -> m.Prefilled:
        """A prompt's end, alone or in a batch: its sequence's sampler started (the seed's),
        ``logits`` (the next token's) to the command's slot, the reply timed from ``start``."""
        self._sequence(command.sequence).sampler = sampler_for(command.seed)
        ref = None
        if command.out >= 0:
            row = self._slot(command.out, (1, engine.vocab_size))
            row[0] = logits
            ref = m.ArrayRef(row.dtype.str, row.shape, slot=command.out)
        elapsed = (time.perf_counter() - start) * 1000
        return m.Prefilled(command.request, reused, engine.committed, elapsed, ref)

    def draft(self, command: m.Draft, frames) -> tuple:
        start = time.perf_counter()
        state = self._sequence(command.sequence)
        engine, shape = self._engine(state, command.spare_cores), command.shape
        if isinstance(shape, m.RunAhead) and command.append:
            raise RuntimeUsageError("a run-ahead continues a pending draft: it appends nothing")
        one_chain = (
            isinstance(shape, m.Chains)
            and command.grammar is None
            and engine.chains_in_one_call(command.sampling, shape.branches, None)
        )
        first = self._catch_up(engine, command, frames, one_chain)
        grammar = state.grammar.at(command.grammar, engine.tokens)
        append_ms = (time.perf_counter() - start) * 1000
        forwards = engine.forwards
        result = engine.draft_shape(
            shape,
            command.sampling,
            state.sampler,
            rows=lambda rows: self._slot(command.out, rows),
            first=first,
            grammar=grammar,
        )
        if isinstance(result, TreeDraftResult):
            probs = m.ArrayRef("<f4", (1, 0, engine.vocab_size), slot=command.out)
            reply = m.Drafted(
                command.request,
                [result.tokens.tolist()],
                [result.nodes.tolist()],
                probs,
                (time.perf_counter() - start) * 1000,
                append_ms,
                engine.forwards - forwards,
                parents=result.parents.tolist(),
                acceptance=result.acceptance.tolist(),
            )
            return reply, ()
        out = self._slot(command.out, result.probs.shape)
        if isinstance(shape, m.RuleBranches):  # its rows are the result's own: copied here
            np.copyto(out, result.probs)
        probs = m.ArrayRef(out.dtype.str, out.shape, slot=command.out)
        elapsed = (time.perf_counter() - start) * 1000
        reply = m.Drafted(
            command.request,
            result.tokens.tolist(),
            result.nodes.tolist(),
            probs,
            elapsed,
            append_ms,
            engine.forwards - forwards,
            result.root,
            grammar=state.grammar.cost(),
        )
        return reply, ()

    def _catch_up(self, engine, command: m.Draft, frames, one_chain: bool) -> int | None:
        """Make ``command.append`` follow the committed sequence: with a head's features, or
        all but its last token where a one-chain draft evaluates that one in its own call
        (returned, the draft's first forward), else all of it in one forward."""
        if command.features is not None:
            features = self._features_in(engine, command.features, frames)
            if len(features) != len(command.append):
                raise RuntimeUsageError(
                    f"{len(command.append)} tokens to append but {len(features)} feature rows"
                )
            engine.append_after_features(command.append, features)
            return None
        if command.append and one_chain:
            return engine.catch_up(command.append)
        if command.append:
            engine.append(command.append)  # what is new in one forward (llama.cpp: a batch)
        return None

    def decode(self, command: m.Decode, frames) -> tuple:
        start = time.perf_counter()
        state = self._sequence(command.sequence)
        engine = self._engine(state, command.spare_cores)
        logprobs = [] if command.logprobs is not None else None
        with self._reporting(engine, command.report_features) as sink:
            if command.append:
                engine.append(command.append)
            tokens = engine.decode(
                command.steps,
                command.sampling,
                state.sampler,
                logprobs=logprobs,
                top=command.logprobs or 0,
                grammar=state.grammar.at(command.grammar, engine.tokens),
                ends=frozenset(command.ends),
            )
        elapsed = (time.perf_counter() - start) * 1000
        reply = m.Decoded(
            command.request, tokens, elapsed, logprobs or [], grammar=state.grammar.cost()
        )
        return self._reported(reply, engine, sink)

    def verify(self, command: m.VerifyTree, frames) -> tuple:
        start = time.perf_counter()
        state = self._sequence(command.sequence)
        engine = self._engine(state, command.spare_cores)
        job = self._verify_start(command, state)
        with self._reporting(engine, command.features_out >= 0) as sink:
            tree = (command.tokens, command.parents)
            if command.walk is not None:
                rows = engine.evaluate_rows(*tree, extend=command.extend)
                job.verdict = self._walk(state, command.walk, *tree, rows)
            elif job.out is None:
                job.argmax.extend(engine.evaluate_argmax(*tree, extend=command.extend))
            else:
                engine.evaluate_tree(*tree, extend=command.extend, out=job.out[job.first :])
        if command.spare_cores:  # give the drafter its cores back before it drafts
            self.spare.use(False, self._set_extra_threads)
        features = None
        if sink is not None:
            rows = self._stacked(engine, sink)
            target = self._slot(command.features_out, rows.shape)
            np.copyto(target, rows)
            features = m.ArrayRef(rows.dtype.str, rows.shape, slot=command.features_out)
        return self._verified(job, (time.perf_counter() - start) * 1000, features), ()

    def _verify_start(self, command: m.VerifyTree, state: SequenceState) -> Verification:
        """A verification's checks, its arena rows, its ``commit`` and its root row: all
        before its tree is evaluated."""
        engine = state.engine
        job = Verification(command, state, 1 if command.root_row else 0)
        if command.walk is not None and (command.argmax_only or command.root_row):
            raise RuntimeUsageError("a sampled walk takes neither argmax_only nor root_row")
        if not command.argmax_only and command.walk is None:
            shape = (job.first + len(command.tokens), engine.vocab_size)
            job.out = self._slot(command.out, shape)
        if command.commit:
            engine.commit(command.commit)
        if command.root_row:
            root = engine.last_logits()
            if job.out is None:
                job.argmax.append(int(np.argmax(root)))
            else:
                job.out[0] = root
        return job

    def _verify_rows(self, job: Verification, rows: np.ndarray) -> None:
        """What ``verify`` makes of its tree's logits, from ``rows`` evaluated elsewhere
        (a forward of several sequences): the same values, bit for bit."""
        command = job.command
        if command.walk is not None:
            job.verdict = self._walk(job.state, command.walk, command.tokens, command.parents, rows)
        elif job.out is None:
            job.argmax.extend(rows.argmax(axis=-1).tolist())
        else:
            np.copyto(job.out[job.first :], rows)

    @staticmethod
    def _verified(
        job: Verification,
        elapsed: float,
        features: m.ArrayRef | None = None,
        batch_rows: int = 0,
    ):
        logits = None
        if job.out is not None:
            logits = m.ArrayRef(job.out.dtype.str, job.out.shape, slot=job.command.out)
        verdict = job.verdict
        path, bonus = (verdict.path, verdict.bonus) if verdict is not None else ([], -1)
        request = job.command.request
        return m.Verified(request, logits, elapsed, features, job.argmax, path, bonus, batch_rows)

    def _walk(
        self, state: SequenceState, walk: m.SampledWalk, tokens: list[int], parents: list[int], rows
    ) -> Verdict:
        """The verdict of ``walk`` over the draft below node 0 (the last round's bonus), with
        ``state``'s sampler where it is keyed."""
        if not parents or parents[0] != -1 or -1 in parents[1:]:
            raise RuntimeUsageError("a sampled walk needs one tree below its first node")
        draft_tokens, draft_parents = tokens[1:], [parent - 1 for parent in parents[1:]]
        if walk.keyed:
            if not isinstance(state.sampler, KeyedSampler):
                raise RuntimeUsageError("a keyed walk needs the request's Prefill with a seed")
            return verify_sampled(
                draft_tokens,
                draft_parents,
                rows,
                walk.sampling,
                position=walk.position,
                keyed=state.sampler,
            )
        if walk.draft is None or len(walk.draft_rows) != len(draft_tokens):
            raise RuntimeUsageError(
                f"a drawn walk over {len(draft_tokens)} drafted nodes needs "
                f"as many draft rows, not {len(walk.draft_rows)}"
            )
        if self.arena is None:
            raise ArenaError("no shared-memory arena was given at load")
        drafted = self.arena.view(walk.draft)
        drafted = drafted.reshape(-1, drafted.shape[-1])
        if not all(0 <= row < len(drafted) for row in walk.draft_rows):
            raise RuntimeUsageError(
                f"draft rows {walk.draft_rows} outside the draft's {len(drafted)}"
            )
        return verify_sampled(
            draft_tokens,
            draft_parents,
            rows,
            walk.sampling,
            position=walk.position,
            rng=np.random.default_rng(walk.seed),
            draft=RowsOnDemand.at(drafted, walk.draft_rows),
        )

    def commit(self, command: m.Commit, frames) -> tuple:
        start = time.perf_counter()
        engine = self._sequence(command.sequence).engine
        engine.commit(command.nodes)
        if command.tokens:
            engine.append(command.tokens)
        elapsed = (time.perf_counter() - start) * 1000
        return m.Committed(command.request, engine.committed, elapsed), ()

    def rollback(self, command: m.Rollback, frames) -> tuple:
        start = time.perf_counter()
        engine = self._sequence(command.sequence).engine
        engine.rollback(command.length)
        elapsed = (time.perf_counter() - start) * 1000
        return m.Committed(command.request, engine.committed, elapsed), ()

    def tokenize(self, command: m.Tokenize, frames) -> tuple:
        tokens = self._sequence(0).engine.tokenize(command.text, add_special=command.add_special)
        return m.Tokenized(command.request, tokens), ()

    def echo(self, command: m.Echo, frames) -> tuple:
        """Copy the array back: into slot ``out``, or as a frame when ``out`` is -1, after
        computing ``hold_us`` (a busy wait)."""
        until = time.perf_counter() + min(max(command.hold_us, 0.0), 1e6) / 1e6  # <= 1 s
        while time.perf_counter() < until:
            pass
        if command.data.frame >= 1:
            data = frame_array(command.data, frames)
        else:
            if self.arena is None:
                raise ArenaError("no shared-memory arena was given at load")
            data = self.arena.view(command.data)
        if command.out < 0:
            return m.Echoed(command.request, frame_ref(data, 1)), (data,)
        target = self._slot(command.out, data.shape)
        np.copyto(target, data, casting="no")
        return m.Echoed(
            command.request, m.ArrayRef(data.dtype.str, data.shape, slot=command.out)
        ), ()
