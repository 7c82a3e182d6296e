"""An in-process worker for engine tests: a numpy model behind the worker's own handlers.

``TableModel`` is a ``TreeRuntime`` whose next-token logits depend on the last two tokens and
the last one's position, so a token the engine loses, repeats or misplaces changes what
follows, and greedy output is checked against the model's own decoding. ``InProcessWorker``
runs the real command handlers of ``hetspec.workers.process.Worker`` on it, with a real
shared-memory arena, behind the ``WorkerClient`` call interface the engine uses; it can
fail a chosen command, and counts the commands it ran.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import numpy as np

from hetspec.daemon.supervision.prompt_bound import PromptBound
from hetspec.daemon.supervision.worker_client import WorkerError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import Arena
from hetspec.protocol.sampling import SamplingParams
from hetspec.protocol.vocab import VocabInfo
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.process import Worker
from hetspec.workers.runtimes.spare_cores import SpareCores
from hetspec.workers.runtimes.tree_runtime import TreeRuntime

VOCAB = 32
PERIOD = 8  # positions the logits tell apart


class TableModel(TreeRuntime):
    feature_size = 2  # a position's "feature": (its position, its token)

    def __init__(
        self,
        tables: tuple[np.ndarray, np.ndarray, np.ndarray],
        eos: int = VOCAB - 1,
        capacity: int = 512,
    ) -> None:
        super().__init__(VOCAB, capacity)
        self.last_table, self.prev_table, self.position_table = tables
        self.eos, self.threads = eos, 1

    @classmethod
    def pair(cls, seed: int = 0, noise: float = 1.0, eos_bias: float = -4.0):
        """A target and a draft whose logits differ by ``noise`` x N(0, 1) per entry."""
        rng = np.random.default_rng(seed)
        tables = (
            rng.normal(0, 3, (VOCAB, VOCAB)),
            rng.normal(0, 1, (VOCAB, VOCAB)),
            rng.normal(0, 1, (PERIOD, VOCAB)),
        )
        for table in tables[:1]:
            table[:, VOCAB - 1] += eos_bias  # EOS is rare, not absent
        draft = tuple(t + noise * rng.normal(0, 1, t.shape) for t in tables)
        return cls(tables), cls(draft)

    def _logits(self, prev: int, last: int, position: int) -> np.ndarray:
        row = self.last_table[last] + self.prev_table[prev] + self.position_table[position % PERIOD]
        return row.astype(np.float32)

    def _before(self) -> int:
        return self.tokens[-1] if self.tokens else 0

    def _run(self, tokens, parents, positions, rows):
        known = np.concatenate([self._pending_tokens, tokens])
        start = len(self._pending_tokens)
        out = np.empty((len(tokens), VOCAB), np.float32)
        for i, (parent, position) in enumerate(zip(parents, positions, strict=True)):
            prev = int(known[parent]) if parent >= 0 else self._before()
            out[i] = self._logits(prev, int(known[start + i]), int(position))
        self._capture(np.stack([positions, tokens], axis=1))
        return out

    def _node_logits(self, output, index):
        return output[index]

    def _step_logits(self, output):
        return output

    def _keep_path(self, path):
        pass  # no keys/values: the logits are computed from tokens alone

    def _drop_pending_kv(self):
        pass

    def _truncate_kv(self, length):
        pass

    def _extend_committed(self, tokens):
        self._capture(np.stack([self.committed + np.arange(len(tokens)), tokens], axis=1))
        prev = int(tokens[-2]) if len(tokens) > 1 else self._before()
        return self._logits(prev, int(tokens[-1]), self.committed + len(tokens) - 1)

    def set_extra_threads(self, extra: int) -> None:
        pass

    def vocab_info(self) -> VocabInfo:
        return VocabInfo("table", VOCAB, VOCAB, 0, self.eos, False, "table")

    def token_bytes(self, token: int) -> bytes:
        return bytes([ord("a") + token % 26]) if token < 26 else f"<{token}>".encode()

    def special_tokens(self) -> list[int]:
        return []

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return [ord(char) % 26 for char in text]

    def greedy(self, prompt: str, count: int) -> list[int]:
        """The model's own greedy continuation of ``prompt``."""
        self.prefill(self.tokenize(prompt))
        return self.decode(count, SamplingParams(), DrawnSampler(0))


class FeatureCheckingDraft(TableModel):
    """A draft head's stand-in: it checks every target feature it is given, which must be
    (the position before each appended token, the token there), and counts them."""

    def __init__(self, tables, **kwargs) -> None:
        super().__init__(tables, **kwargs)
        self.features_checked = 0

    def _check(self, start: int, rows: np.ndarray, sequence: list[int]) -> None:
        expected = [(start + i, sequence[start + i]) for i in range(len(rows)) if start + i >= 0]
        got = [tuple(int(v) for v in row) for i, row in enumerate(rows) if start + i >= 0]
        assert got == expected, f"features {got} where {expected} belong"
        self.features_checked += len(got)

    def provide_features(self, start: int, rows: np.ndarray) -> None:
        raise AssertionError("the worker feeds features only through prefill and appends")

    def prefill(self, prompt, chunk_size=None, *, features=None, start=0):
        if features is not None:
            self._check(start, features, list(prompt))
        return super().prefill(prompt, chunk_size)

    def append_after_features(self, tokens, features) -> None:
        self._check(self.committed - 1, features, self.tokens + [int(t) for t in tokens])
        self.append(tokens)


@dataclass
class _Spec:
    name: str
    spare_cores: tuple[int, ...] = ()


@dataclass
class InProcessWorker:
    """The engine's view of a worker (``call``, ``post``, ``announce``, ``next_request``,
    ``ready``, ``prompt_bound``, ``spec``)."""

    name: str
    model: TableModel
    arena: Arena
    fail_on: type | None = None  # a command type answered with Failed ...
    fail_after: int = 0  # ... after this many of that type succeeded
    delays: dict = field(default_factory=dict)  # command type -> seconds its reply takes
    ran: list[str] = field(default_factory=list)
    commands: list = field(default_factory=list)
    announced: list[int] = field(default_factory=list)  # len(commands) at each announce

    def __post_init__(self) -> None:
        self.spec = _Spec(self.name)
        self._ids = itertools.count(1)
        self._worker = Worker("table", None, None, SpareCores((), ()))
        self._worker.runtime, self._worker.arena = self.model, self.arena
        self.ready = m.Ready(
            model=self.name,
            device="cpu",
            vocab=self.model.vocab_info(),
            context=self.model.capacity,
            threads=1,
            load_ms=0.0,
            token_bytes=[self.model.token_bytes(i) for i in range(VOCAB)],
        )
        self.prompt_bound = PromptBound.of(self.ready.token_bytes, self.ready.special_tokens)

    def next_request(self) -> int:
        return next(self._ids)

    def announce(self) -> None:
        """The engine's word that a command follows (a worker process waits awake for it)."""
        self.announced.append(len(self.commands))

    async def call(self, command, arrays=()):
        # a reply never comes in the same step as its command
        await asyncio.sleep(self.delays.get(type(command), 0))
        return self._run(command, arrays)

    def post(self, command, arrays=()):
        """``call`` with its command run now, as a worker process starts on a command once
        sent; the coroutine gives its reply (or failure) after the command's delay."""
        try:
            reply, failure = self._run(command, arrays), None
        except WorkerError as error:
            reply, failure = None, error

        async def answer():
            await asyncio.sleep(self.delays.get(type(command), 0))
            if failure is not None:
                raise failure
            return reply

        return answer()

    def _run(self, command, arrays):
        kind = type(command)
        if kind is self.fail_on:
            if self.fail_after <= 0:
                raise WorkerError(self.name, "internal", f"{kind.__name__} failed on purpose")
            self.fail_after -= 1
        try:  # frame 0 would be the message; arrays follow it
            reply, out = self._worker.handlers[kind](command, [b"", *arrays])
        except Exception as error:  # as the worker process answers it: Failed
            failed = self._worker.failure(command, error)
            raise WorkerError(self.name, failed.kind, failed.message) from None
        self.ran.append(kind.__name__)
        self.commands.append(command)
        return reply, [b"", *out]
