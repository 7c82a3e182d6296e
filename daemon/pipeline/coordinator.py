"""The coordinator's side of FlowSpec's pipeline: stage processes (``hetspec-stage``) reached
over ZeroMQ on TCP with CURVE, fed segments of the draft tree and told its commits.

``PipelineClient`` owns the transport: one CURVE client socket per stage, one CURVE server
socket where the last stage's outputs (and every stage's replies) arrive, allowed only for
the stages' public keys. ``pipeline_decode`` runs FlowSpec's loop over it: keep the pipeline
full with the best-scored segments, advance the tree as outputs arrive, tell every stage each
commit, ask the drafter for more below the live tree. A stage that stops answering fails the
request within ``timeout_s`` (``PipelineError``), never hangs it.
"""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from hetspec.protocol.curve_keys import KnownKeys, load_public, load_secret
from hetspec.protocol.frames import Codec, MessageError, frame_array, frame_ref
from hetspec.protocol.pipeline_messages import (
    PIPELINE_PROTOCOL_VERSION,
    Commit,
    Output,
    Ready,
    Reset,
    Rows,
    StageFailed,
    ToCoordinator,
)
from hetspec.speculative.flow.flow_tree import FlowTree
from hetspec.speculative.flow.layer_split import format_range
from hetspec.speculative.flow.pipeline_clock import PipelineClock
from hetspec.speculative.verify.distributions import SamplingParams, distribution
from hetspec.speculative.verify.samplers import Sampler, pick

# How long the stages' first answer may take (at the pipeline's start: new CURVE connections
# to the coordinator, a remote stage still loading); later Resets wait ``timeout_s``.
FIRST_ANSWER_S = 10.0


class PipelineError(RuntimeError):
    """The pipeline cannot serve this request: a stage failed, is unreachable or silent."""


class StagesSilent(PipelineError):
    """No answer in time: a stage is dead, hung or unreachable. ``silent``: the stages that
    did not answer a ``Reset`` (empty where it is not known which)."""

    def __init__(self, message: str, silent: list[int] | None = None) -> None:
        super().__init__(message)
        self.silent = silent or []


@dataclass(frozen=True)
class StageAddress:
    endpoint: str  # e.g. tcp://10.0.0.2:5601
    public_key: Path  # the stage's NAME.key


@dataclass
class PipelineStats:
    segments: int = 0
    nodes_sent: int = 0
    nodes_back: int = 0  # outputs of nodes still live when they arrived
    commits: int = 0
    drafted_final: int = 0  # final tokens that had been drafted (accepted drafts)


# A drafter: given the tree and the final tokens so far (the root's last), add nodes below
# the tree's live nodes (FlowTree.add), at once or as a coroutine; called after every
# output, so it drafts from the freshest context.
Drafter = Callable[[FlowTree, list[int]], Awaitable[None] | None]


def no_draft(tree: FlowTree, final: list[int]) -> None:
    """The drafter of the plain pipeline: the target alone, one token at a time."""
    return None


# An expander: add nodes below the live tree while the pipeline has room and nothing to send;
# whether it added any.
Expander = Callable[[FlowTree], Awaitable[bool]]


class PipelineClient:
    def __init__(
        self, stages: list[StageAddress], key: Path, listen: str, timeout_s: float = 2.0
    ) -> None:
        """``key``: the coordinator's ``.key_secret``; ``listen``: where outputs arrive (a
        TCP endpoint the last stage can reach; port ``*``: any free one)."""
        if not stages:
            raise PipelineError("a pipeline needs at least one stage")
        self.stages = stages
        self.listen, self.timeout_s = listen, timeout_s
        self.public, self.secret = load_secret(key)
        self.stage_keys = [load_public(s.public_key) for s in stages]
        self.codec: Codec = Codec(ToCoordinator)
        self.context = zmq.asyncio.Context()
        # ZeroMQ's authentication handler, in a thread of its own on the same context (an
        # asyncio one would be bound to the event loop it was started on)
        self.auth = ThreadAuthenticator(zmq.Context.shadow(self.context.underlying))
        self.auth.start()
        self.auth.configure_curve_callback("*", KnownKeys(self.stage_keys))
        self.inbound = self.context.socket(zmq.PULL)
        self.inbound.curve_server = True
        self.inbound.curve_publickey, self.inbound.curve_secretkey = self.public, self.secret
        self.inbound.setsockopt(zmq.RCVHWM, 0)
        self.inbound.bind(listen)
        # "tcp://HOST:*" binds a free port: the stages are told the one it got
        self.listen = self.inbound.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.outbound = []
        for stage, server_key in zip(stages, self.stage_keys, strict=True):
            socket = self.context.socket(zmq.PUSH)
            socket.curve_publickey, socket.curve_secretkey = self.public, self.secret
            socket.curve_serverkey = server_key
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(stage.endpoint)
            self.outbound.append(socket)
        self.session = 0

    def close(self) -> None:
        self.auth.stop()
        for socket in [self.inbound, *self.outbound]:
            socket.close(linger=0)
        self.context.term()

    async def _receive(self, timeout_s: float | None = None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        while True:
            if not await self.inbound.poll(timeout_s * 1000):
                raise StagesSilent(
                    f"no stage answered within {timeout_s:g} s (a stage died, "
                    "or cannot reach the next one)"
                )
            frames = await self.inbound.recv_multipart(copy=False)
            try:
                message = self.codec.decode(frames)
            except MessageError as error:  # only admitted stages reach this socket
                raise PipelineError(
                    f"a stage sent a message this coordinator cannot read "
                    f"({error}): is every stage the same hetspec "
                    "version?"
                ) from None
            if message.session != self.session:
                continue  # left over from an earlier request
            if isinstance(message, StageFailed):
                raise PipelineError(f"stage {message.stage} failed: {message.message}")
            return message, frames

    async def reset(self, timeout_s: float | None = None) -> list[Ready]:
        """A new session on every stage; waits until each says it is ready. Session numbers
        are random: rows another coordinator (an earlier daemon) left queued at a stage can
        never pass for this one's."""
        self.session = secrets.randbits(63)
        coordinator_key = self.public.decode()
        for index, socket in enumerate(self.outbound):
            last = index + 1 == len(self.stages)
            next_endpoint = self.listen if last else self.stages[index + 1].endpoint
            next_key = coordinator_key if last else self.stage_keys[index + 1].decode()
            message = Reset(
                self.session, index, next_endpoint, next_key, self.listen, coordinator_key
            )
            await socket.send_multipart(self.codec.encode(message))
        ready: dict[int, Ready] = {}
        while len(ready) < len(self.stages):
            try:
                message, _ = await self._receive(timeout_s)
            except StagesSilent:
                silent = [i for i in range(len(self.stages)) if i not in ready]
                said = f"stage(s) {', '.join(map(str, silent))} did not answer within "
                raise StagesSilent(f"{said}{timeout_s or self.timeout_s:g} s", silent) from None
            if isinstance(message, Ready):
                if message.version != PIPELINE_PROTOCOL_VERSION:
                    raise PipelineError(
                        f"stage {message.stage} speaks pipeline protocol {message.version}, "
                        f"not {PIPELINE_PROTOCOL_VERSION}"
                    )
                ready[message.index] = message
        answers = [ready[i] for i in range(len(self.stages))]
        halves = [(r.first_half, r.end_half) for r in answers]
        starts, ends = [a for a, _ in halves], [b for _, b in halves]
        if starts != [0, *ends[:-1]] or ends[-1] != 2 * answers[0].layers:
            ranges = ", ".join(format_range(a, b) for a, b in halves)
            raise PipelineError(
                f"the stages' layers ({ranges}), in pipeline order, do not "
                f"cover the model's {answers[0].layers} layers once"
            )
        return answers

    async def prefill(self, tokens: list[int], root_id: int) -> tuple[np.ndarray, Output]:
        """Run the prompt through every stage; the logits after its last token, and the
        message (each stage's compute ms and rows)."""
        data = np.asarray(tokens, np.int64)
        message = Rows(self.session, frame_ref(data, 1), prefill=True, root=root_id)
        await self.outbound[0].send_multipart(self.codec.encode(message, [data]))
        while True:
            message, frames = await self._receive(self.timeout_s + 0.01 * len(tokens))
            if isinstance(message, Output) and message.prefill:
                return np.array(frame_array(message.logits, frames)[-1]), message

    async def send(self, segment) -> None:
        data = np.asarray(segment.tokens, np.int64)
        message = Rows(
            self.session,
            frame_ref(data, 1),
            segment.ids,
            segment.parents,
            segment.positions,
            segment.epoch,
        )
        await self.outbound[0].send_multipart(self.codec.encode(message, [data]))

    async def commit(self, epoch: int, accepted: list[int], root: int) -> None:
        frames = self.codec.encode(Commit(self.session, epoch, accepted, root))
        for socket in self.outbound:
            await socket.send_multipart(frames)

    async def output(self) -> tuple[list[int], np.ndarray, Output]:
        """The next segment's node ids, logits, and the message (each stage's compute ms and
        rows computed)."""
        while True:
            message, frames = await self._receive()
            if isinstance(message, Output) and not message.prefill:
                return message.ids, frame_array(message.logits, frames), message


async def pipeline_decode(
    client: PipelineClient,
    prompt: list[int],
    max_tokens: int,
    drafter: Drafter,
    *,
    params: SamplingParams | None = None,
    sampler: Sampler | None = None,
    segment_size: int = 4,
    in_flight: int | None = None,
    clock: PipelineClock | None = None,
    expand: Expander | None = None,
) -> tuple[list[int], PipelineStats]:
    """``max_tokens`` tokens of ``pipeline_tokens`` (its arguments), and the statistics."""
    stats = PipelineStats()
    final: list[int] = []
    stream = pipeline_tokens(
        client,
        prompt,
        drafter,
        params=params,
        sampler=sampler,
        segment_size=segment_size,
        in_flight=in_flight,
        clock=clock,
        expand=expand,
        stats=stats,
    )
    try:
        async for tokens in stream:
            final += tokens
            if len(final) >= max_tokens:
                break
    finally:
        await stream.aclose()
    return final[:max_tokens], stats  # what is still in flight belongs to a dead session


async def pipeline_tokens(
    client: PipelineClient,
    prompt: list[int],
    drafter: Drafter,
    *,
    params: SamplingParams | None = None,
    sampler: Sampler | None = None,
    segment_size: int = 4,
    in_flight: int | None = None,
    clock: PipelineClock | None = None,
    expand: Expander | None = None,
    stats: PipelineStats | None = None,
) -> AsyncIterator[list[int]]:
    """The tokens after ``prompt`` as the target alone would choose them (greedy: the same
    tokens; sampled with ``params`` by ``sampler``: keyed by position, or drawn, in both cases
    the target's own law, since a drafted token counts only where it equals the target's own
    choice), verified through the pipeline, yielded as they become final (the first: the
    prefill's) until the caller stops. FlowSpec's schedule: up to ``in_flight`` segments
    (default: one per stage) keep every stage busy; when every node is sent and a stage could
    take more, ``expand`` grows the tree (FlowSpec's expansion) until it adds nothing.
    ``clock`` records the run for ``PipelineClock.timeline``; ``stats`` counts it."""
    params = params or SamplingParams()
    if not params.greedy and sampler is None:
        raise ValueError("a sampled request needs a sampler")

    def choose(logits: np.ndarray, position: int) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        return int(pick(distribution(logits[None, :], params), params, sampler, position)[0])

    in_flight = in_flight or len(client.stages)
    stats = stats if stats is not None else PipelineStats()
    await client.reset()
    logits, reply = await client.prefill(prompt, root_id=0)
    if clock is not None:
        clock.sent()
        clock.returned(reply.costs_ms, reply.widths)
    tree = FlowTree(choose(logits, len(prompt)), len(prompt))
    final = [tree.nodes[tree.root].token]
    yield list(final)
    flying = 0
    while True:
        start = time.perf_counter()
        if inspect.isawaitable(drafted := drafter(tree, final)):
            await drafted
        if clock is not None:
            clock.spend(time.perf_counter() - start)
        flying += await _fill(
            client,
            tree,
            in_flight - flying,
            segment_size=segment_size,
            expand=expand,
            clock=clock,
            stats=stats,
        )
        if flying == 0:
            raise PipelineError("nothing to verify: the drafter left the root unsent")
        ids, rows, reply = await client.output()
        if clock is not None:
            clock.returned(reply.costs_ms, reply.widths)
        flying -= 1
        live = {
            i: choose(row, tree.nodes[i].position + 1)
            for i, row in zip(ids, rows, strict=True)
            if i in tree.nodes
        }
        stats.nodes_back += len(live)
        if (advance := tree.deliver(live)) is not None:
            stats.commits += 1
            stats.drafted_final += advance.drafted
            await client.commit(tree.epoch, advance.accepted, advance.root)
            final += advance.final_tokens
            yield advance.final_tokens


async def _fill(
    client: PipelineClient,
    tree: FlowTree,
    room: int,
    *,
    segment_size: int,
    expand: Expander | None,
    clock: PipelineClock | None,
    stats: PipelineStats,
) -> int:
    """Send up to ``room`` segments, best nodes first, expanding the tree when nothing is
    left to send; how many went."""
    sent = 0
    while sent < room:
        if (segment := tree.segment(segment_size)) is None:
            if expand is None:
                break
            start = time.perf_counter()
            grew = await expand(tree)
            if clock is not None:
                clock.spend(time.perf_counter() - start)
            if not grew:
                break
            continue
        await client.send(segment)
        if clock is not None:
            clock.sent()
        sent += 1
        stats.segments += 1
        stats.nodes_sent += len(segment.ids)
    return sent
