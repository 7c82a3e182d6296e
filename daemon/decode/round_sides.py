"""The state each worker carries between speculative rounds, owned by one object per side.

The verifier keeps the last tree it evaluated until the next call says which path of it to
commit, and the bonus token (the target's own token after the accepted path) is emitted before
the verifier has evaluated it: it becomes the root of the next tree. The drafter learns the
emitted tokens only with its next draft (appending them reuses the nodes it drafted that were
accepted), and may hold a run-ahead: a draft of the next round made while this one was verified.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from hetspec.daemon.decode.batch_board import BatchBoard
from hetspec.daemon.decode.core_lending import CoreLending
from hetspec.daemon.decode.prompt_input import prefill
from hetspec.daemon.supervision.worker_client import WorkerClient
from hetspec.protocol import Arena, frame_ref
from hetspec.protocol import worker_messages as m
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.control.core_choice import SpareCoreChoice
from hetspec.speculative.control.rounds import DraftCall
from hetspec.speculative.verify.verdicts import Verdict


@dataclass(frozen=True)
class WorkerPair:
    drafter: WorkerClient | None  # None: no draft model (the target alone, model-free drafts)
    verifier: WorkerClient
    arena: Arena
    draft_slot: int  # where the drafter writes its probability rows
    verify_slot: int  # where the verifier writes the tree's logits
    # whether the target, decoding alone, also computes on the drafter's cores
    alone_cores: SpareCoreChoice | CoreLending = field(default_factory=SpareCoreChoice)
    # ... and whether it does while it verifies a plain round's draft (the drafter waits)
    verify_cores: SpareCoreChoice | CoreLending = field(default_factory=SpareCoreChoice)
    # >= 0: the drafter is a draft head; the verifier writes its features to this slot
    feature_slot: int = -1
    sequence: int = 0  # the request's sequence in both workers (its admission seat)
    # > 0: prompts prefilled this many tokens a call (others decode beside this request)
    prefill_chunk: int = 0
    board: BatchBoard | None = None  # the requests decoding at once (None: this one only)

    @property
    def head(self) -> bool:
        return self.feature_slot >= 0

    @property
    def verifier_on_cpu(self) -> bool:
        """Whether the verifier computes on the CPU (its device as its worker reported it),
        where the daemon's own work beside a verification takes cycles from it."""
        return self.verifier.ready.device.startswith("cpu")


class FeatureBook:
    """The target's features (rows by sequence position) the drafter has not been given."""

    def __init__(self) -> None:
        self._rows: dict[int, np.ndarray] = {}

    def add(self, start: int, rows: np.ndarray) -> None:
        for offset, row in enumerate(np.array(rows, np.float32)):  # a copy: slots are reused
            self._rows[start + offset] = row

    def take(self, first: int, count: int) -> np.ndarray | None:
        """Rows of positions first..first+count-1, or None when one is missing; rows before
        first + count are dropped either way."""
        rows = [self._rows.get(position) for position in range(first, first + count)]
        self._rows = {p: row for p, row in self._rows.items() if p >= first + count}
        if not rows or any(row is None for row in rows):
            return None
        return np.stack(rows)


@dataclass
class Unverified:
    """A draft the verifier has not seen, as the drafter's pending tree holds it."""

    tokens: list[int]
    probs: np.ndarray  # (len(tokens), vocab): the distribution each token was drawn from
    last_parent: int  # the drafter's pending node the last (unevaluated) token hangs from

    @classmethod
    def of(cls, drafted: m.Drafted, arena: Arena, skip: int = 0) -> Unverified:
        nodes = drafted.nodes[0]
        last_parent = nodes[-2] if len(nodes) >= 2 else drafted.root
        probs = arena.view(drafted.probs)[0, skip:].copy()  # the slot is reused next round
        return cls(drafted.tokens[0][skip:], probs, last_parent)


class DrafterSide:
    """The drafter's prefill (started when first needed), the emitted tokens it has not seen
    yet (``unseen``), and a run-ahead kept as the next draft (``run_ahead``)."""

    MAX_UNSEEN = 48  # emitted tokens it may hold only as pending nodes before it must catch up

    def __init__(self, pair: WorkerPair, prompt: list[int], seed: int | None) -> None:
        self.client, self.arena, self.slot = pair.drafter, pair.arena, pair.draft_slot
        self.sequence, self.prefill_chunk = pair.sequence, pair.prefill_chunk
        self._prompt, self._seed = prompt, seed
        self.prefill: asyncio.Future | None = None
        self.unseen: list[int] = []  # the sequence's last tokens, emitted since its last draft
        self.run_ahead: Unverified | None = None
        # a draft head's: the prompt's features (from the verifier's prefill), then the rest
        self.prompt_features: tuple[int, np.ndarray] | None = None
        self.features = FeatureBook() if pair.head else None
        self.grammar: m.GrammarAt | None = None  # the request's: its drafts keep to it

    def start_prefill(self) -> asyncio.Future:
        if self.prefill is None:
            command = m.Prefill(
                request=self.client.next_request(),
                tokens=self._prompt,
                seed=self._seed,
                sequence=self.sequence,
            )
            arrays = ()
            if self.prompt_features is not None:
                start, rows = self.prompt_features
                command = msgspec.structs.replace(
                    command, features=frame_ref(rows, 1), features_start=start
                )
                arrays = (rows,)
            call = prefill(self.client, command, self.prefill_chunk, arrays)
            self.prefill = asyncio.ensure_future(call)
        return self.prefill

    def _appended_features(self, length: int) -> tuple[m.ArrayRef | None, tuple]:
        """The features before each unseen token (the last of ``length`` emitted), where the
        verifier reported them all."""
        if self.features is None or not self.unseen:
            return None, ()
        rows = self.features.take(length - len(self.unseen) - 1, len(self.unseen))
        return (None, ()) if rows is None else (frame_ref(rows, 1), (rows,))

    def idle(self) -> bool:
        return self.prefill is None or self.prefill.done()

    async def draft(
        self, shape: m.DraftShape, params: SamplingParams, *, length: int
    ) -> tuple[m.Drafted, DraftCall, float]:
        """Draft ``shape`` after appending what it has not seen (the sequence being
        ``length`` tokens long); the reply, its cost and the call's seconds. The append's
        last forward yields the first token's distribution, so gamma tokens cost gamma
        forwards (a tree: the append's, then one per layer below the first)."""
        waited = await self._prefilled()
        return await self.post(shape, params, length=length, waited=waited)

    def can_post(self) -> bool:
        """Whether a draft's command may be sent at once: the drafter's prefill went out and
        succeeded, so nothing must precede it."""
        prefill = self.prefill
        return (
            prefill is not None
            and prefill.done()
            and not prefill.cancelled()
            and prefill.exception() is None
        )

    def announce(self) -> None:
        """Wake the drafter to wait awake for a draft about to be posted."""
        self.client.announce()

    def post(self, shape: m.DraftShape, params: SamplingParams, *, length: int, waited=0.0):
        """``draft``'s command, sent now (only where ``can_post``): a coroutine for its
        result, to await or wrap in a task."""
        cost_branches = shape.top_k if isinstance(shape, m.DynamicTree) else None
        return self._post(shape, params, length, waited, cost_branches)

    async def _prefilled(self) -> float:
        """Wait for the drafter's prefill (starting it if it was not): the seconds waited."""
        waiting = time.perf_counter()
        await self.start_prefill()
        return time.perf_counter() - waiting

    def _post(
        self,
        shape: m.DraftShape,
        params: SamplingParams,
        length: int,
        waited: float,
        cost_branches: int | None,
    ):
        """Send a ``Draft`` of ``shape`` that first appends the unseen tokens (with their
        features for a head); a coroutine for the reply, its cost (of ``cost_branches``, else
        as many as drafted) and the call's seconds, ``waited`` for the prefill included."""
        start = time.perf_counter()
        features, arrays = self._appended_features(length)
        command = m.Draft(
            request=self.client.next_request(),
            shape=shape,
            sampling=params,
            out=self.slot,
            append=self.unseen,
            features=features,
            grammar=self.grammar,
            sequence=self.sequence,
        )
        reply = self.client.post(command, arrays)
        self.unseen = []
        return self._costed(reply, start, waited, cost_branches)

    @staticmethod
    async def _costed(reply, start: float, waited: float, cost_branches: int | None):
        drafted, _ = await reply
        seconds = time.perf_counter() - start
        cost = _cost(drafted, cost_branches or len(drafted.tokens), seconds, waited=waited)
        return drafted, cost, seconds + waited

    def start_run_ahead(
        self, draft: Unverified, gamma: int, params: SamplingParams
    ) -> asyncio.Future | None:
        """Draft the next round below ``draft`` while it is verified: a guess of the bonus,
        then ``gamma`` tokens. None when the drafter holds too much unverified already."""
        if len(self.unseen) + len(draft.tokens) >= self.MAX_UNSEEN:
            return None
        command = m.Draft(
            request=self.client.next_request(),
            shape=m.RunAhead(draft.last_parent, draft.tokens[-1], gamma + 1),
            sampling=params,
            out=self.slot,
            sequence=self.sequence,
        )
        return asyncio.ensure_future(_timed(self.client.call(command)))

    def close(self) -> None:
        prefill = self.prefill
        if prefill is None:
            return
        if not prefill.done():  # the request ended before any draft
            prefill.cancel()
        elif not prefill.cancelled():
            prefill.exception()  # retrieved: raised where it mattered


def _cost(drafted: m.Drafted, branches: int, seconds: float, *, waited: float) -> DraftCall:
    """A draft call's cost: the forwards the drafter timed after its catch-up (the append:
    all of it, or all but its last new token where that one is the draft's first forward;
    see ``Drafted``), the catch-up, and the call's time beyond the drafter's own."""
    compute_s = (drafted.elapsed_ms - drafted.append_ms) / 1000
    latency_s = seconds - drafted.elapsed_ms / 1000
    return DraftCall(
        drafted.forwards,
        branches,
        compute_s,
        latency_s,
        prefill_wait_s=waited,
        catch_up_s=drafted.append_ms / 1000,
    )


async def _timed(call):
    """A call's reply and its seconds until the reply was in (not until it was awaited)."""
    start = time.perf_counter()
    reply, _ = await call
    return reply, time.perf_counter() - start


class NoDrafter:
    """The drafter's side where there is no draft model: nothing drafts, nothing is pending,
    and the sequence's tokens need not be told to anyone."""

    unseen: list[int]
    run_ahead = None
    features = None
    prompt_features = None
    grammar = None

    def __init__(self) -> None:
        self.unseen = []

    def idle(self) -> bool:
        return True

    def can_post(self) -> bool:
        return False

    def start_prefill(self) -> None:
        pass

    def announce(self) -> None:
        pass

    def close(self) -> None:
        pass


class VerifierSide:
    """The bonus token emitted but not evaluated, the last tree evaluated, and which of its
    nodes the next call commits."""

    def __init__(self, pair: WorkerPair) -> None:
        self.client, self.slot = pair.verifier, pair.verify_slot
        self.feature_slot, self.sequence = pair.feature_slot, pair.sequence
        self.bonus = -1
        self._tree: list[int] = []  # the tokens of the last tree evaluated: [bonus, *draft]
        self._keep: list[int] = []  # its nodes to commit: the bonus and the accepted path

    def verify(
        self,
        tokens: list[int],
        parents: list[int],
        *,
        spare_cores: bool = False,
        argmax_only: bool = False,
        walk: m.SampledWalk | None = None,
    ):
        """The call evaluating a draft tree below the bonus (logits row 0: after the bonus,
        where the draft grows from), committing the last round's path first; on the
        drafter's cores too when ``spare_cores``; each row's argmax alone with
        ``argmax_only``; the verdict itself with ``walk``. The command is sent now: the
        coroutine awaits its reply."""
        self._tree = [self.bonus, *tokens]
        return self.client.post(
            m.VerifyTree(
                request=self.client.next_request(),
                tokens=self._tree,
                parents=[-1, *(p + 1 for p in parents)],
                out=self.slot,
                commit=self._keep,
                spare_cores=spare_cores,
                features_out=self.feature_slot,
                argmax_only=argmax_only,
                walk=walk,
                sequence=self.sequence,
            )
        )

    def kept_features(self, verified: m.Verified, arena: Arena) -> np.ndarray | None:
        """The features of the bonus and the accepted path (after ``accepted``), in order."""
        if verified.features is None:
            return None
        return arena.view(verified.features)[self._keep]

    def accepted(self, verdict: Verdict) -> None:
        self._keep = [0, *(node + 1 for node in verdict.path)]
        self.bonus = verdict.bonus

    def decode(
        self,
        steps: int,
        params: SamplingParams,
        *,
        spare_cores: bool,
        logprobs: int | None = None,
        grammar: m.GrammarAt | None = None,
        ends: frozenset[int] = frozenset(),
    ):
        """The call decoding ``steps`` tokens alone after committing the last round's path
        and evaluating the bonus (each token kept to ``grammar``); see ``decoded``."""
        kept = [self._tree[node] for node in self._keep]
        return self.client.call(
            m.Decode(
                request=self.client.next_request(),
                steps=steps,
                sampling=params,
                append=[*kept, self.bonus],
                spare_cores=spare_cores,
                logprobs=logprobs,
                report_features=self.feature_slot >= 0,
                grammar=grammar,
                ends=sorted(ends),
                sequence=self.sequence,
            )
        )

    def decoded(self, tokens: list[int]) -> None:
        """It committed every token it drew but the last, the new bonus."""
        self._tree, self._keep = [], []
        self.bonus = tokens[-1]
