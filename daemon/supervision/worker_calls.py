"""The calls in flight to one worker: each awaits its reply, fails when its command or reply
was lost, and, once cancelled, is still counted until the worker is done with its command.

Contract:
- ``calls``: request id -> the call awaiting that reply; ``answer`` resolves it with the
  reply and its frames, or fails it with ``WorkerError`` for ``Failed``; a reply nobody waits
  for is logged, unless it answers a cancelled call;
- ``abandoned``: cancelled calls the worker has not answered: it may still run their
  commands, writing the arena slots they name;
- ``note_idle``: a heartbeat said the worker computes nothing while calls are pending; after
  ``LOST_AFTER_IDLE_BEATS`` such beats a pending call fails (kind ``lost``) rather than wait
  for ``call_timeout_s``, and an abandoned one is over;
- ``settled`` resolves once every call in flight now, awaited or cancelled, is over
  (answered, failed, given up as lost, or the worker gone), so that a slot is lent again only
  then; ``after_replies`` re-checks that after each batch of replies, ``wake_settled`` at any
  time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import structlog

from hetspec.daemon.supervision.worker_errors import WorkerError
from hetspec.protocol import worker_messages as m

log = structlog.get_logger("hetspec.daemon.worker")

# Idle heartbeats received while a call is pending before the call counts as lost. The first
# may have been sent before the command arrived, and a reply may trail the beat that followed
# it by a moment (they travel on different connections): three span at least two intervals.
LOST_AFTER_IDLE_BEATS = 3


@dataclass
class PendingCall:
    future: asyncio.Future
    command: str
    idle_beats: int = 0  # heartbeats saying the worker is idle since this was sent


class PendingCalls:
    """The calls in flight to worker ``worker``, whose ``died`` resolves once it is gone."""

    def __init__(self, worker: str, died: asyncio.Future) -> None:
        self.worker = worker
        self.died = died
        self.calls: dict[int, PendingCall] = {}
        # cancelled calls the worker has not answered: it may still run them
        self.abandoned: dict[int, PendingCall] = {}
        self._settling: list[tuple[set[int], asyncio.Future]] = []  # see settled()

    def awaiting(self) -> bool:
        """Whether a call awaits its reply."""
        return bool(self.calls)

    def answer(self, request: int | None, reply: msgspec.Struct, frames: list[bytes]) -> None:
        """``reply`` (and its ``frames``) answers the call ``request``."""
        call = self.calls.pop(request, None) if request is not None else None
        if call is None:
            if self.abandoned.pop(request, None) is None:  # else: a cancelled call's answer
                log.warning(
                    "reply nobody waits for",
                    worker=self.worker,
                    op=type(reply).__name__,
                    request=request,
                )
            return
        if call.future.done():
            return
        if isinstance(reply, m.Failed):
            call.future.set_exception(WorkerError(self.worker, reply.kind, reply.message))
        else:
            call.future.set_result((reply, frames))

    def note_idle(self) -> None:
        """The worker says it computes nothing while calls are pending: after enough such
        beats their commands (or replies) were lost; fail them instead of waiting for
        ``call_timeout_s``."""
        lost = []
        for request, call in self.calls.items():
            call.idle_beats += 1
            if call.idle_beats >= LOST_AFTER_IDLE_BEATS:
                lost.append(request)
        for request in lost:
            call = self.calls.pop(request)
            log.error(
                "command lost: the worker is idle and never answered",
                op=call.command,
                worker=self.worker,
                request=request,
            )
            if not call.future.done():
                call.future.set_exception(
                    WorkerError(
                        self.worker,
                        "lost",
                        f"no answer to {call.command}: the worker is idle, "
                        "so the command or its reply was lost",
                    )
                )
        # a cancelled command the idle worker never answered is not running either
        for request, call in list(self.abandoned.items()):
            call.idle_beats += 1
            if call.idle_beats >= LOST_AFTER_IDLE_BEATS:
                del self.abandoned[request]

    def fail_all(self, error_for) -> None:
        """Fail every pending call with ``error_for(call)``."""
        calls, self.calls = self.calls, {}
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(error_for(call))

    def settled(self) -> asyncio.Future:
        """A future that resolves once the worker is done with every call in flight now,
        awaited or cancelled: each answered, failed, given up as lost, or the worker gone.
        Until then a cancelled call's command may still run and write the slot it names."""
        future = asyncio.get_running_loop().create_future()
        waiting = self.calls.keys() | self.abandoned.keys()
        if waiting and not self.died.done():
            self._settling.append((waiting, future))
        else:
            future.set_result(None)
        return future

    def after_replies(self) -> None:
        """Replies came: resolve what ``settled`` gave out that they settle."""
        if self._settling:
            self.wake_settled()

    def wake_settled(self) -> None:
        outstanding = self.calls.keys() | self.abandoned.keys()
        waiting = []
        for requests, future in self._settling:
            if future.done():  # given up by whoever waited
                continue
            if self.died.done() or not requests & outstanding:  # ids are never reused
                future.set_result(None)
            else:
                waiting.append((requests, future))
        self._settling = waiting
