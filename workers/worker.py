"""The worker's command loop: one engine, one command at a time, one reply each.

Contract: ``Worker.serve`` takes commands from a ``CommandReader`` until ``Shutdown``, marks
the watchdog busy with each one's request while it runs, and sends exactly one reply a
command: the handler's, or ``Failed`` with a kind the daemon acts on (``load``,
``cancelled``, ``usage``, or ``internal`` with the place it failed). A verification (or a
decoding alone) taken while others of other sequences are queued takes them along
(``CommandReader.take_along``, ``BatchedHandlers``): a verification's reply goes out once its
tree is evaluated, the others' once the batch is done; each sequence's in the order its
commands came. Replies go through the
replies mailbox where the link has one, else (or when it is full) the socket. ``load``
replaces the engine and the arena; every other command goes to ``ComputeHandlers``.
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog
import zmq

from hetspec.protocol import Arena, ArenaError, Codec, MessageError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import SHM_DIR
from hetspec.protocol.mailbox import Mailbox, MailboxFull
from hetspec.protocol.sampling import SamplingError
from hetspec.workers.batched_handlers import BatchedHandlers
from hetspec.workers.command_reader import CommandReader
from hetspec.workers.runtimes.loading import LoadError, load_runtime
from hetspec.workers.runtimes.spare_cores import SpareCores
from hetspec.workers.runtimes.tree_runtime import Interrupted, RuntimeUsageError
from hetspec.workers.watchdog import Watchdog

log = structlog.get_logger("hetspec.worker")

# A verification (or decoding) of one sequence waits for the others' commands at most
# GATHER_S, and at most GATHER_SHARE of the last batch's time, where they were busy within
# BUSY_S (a sequence idle longer has no request decoding)
GATHER_S = 0.003
GATHER_SHARE = 0.1
BUSY_S = 0.5


class Worker(BatchedHandlers):
    """The compute side: the sequences' engines, the arena, and the handlers for each
    command (several sequences' verifications run together where they can)."""

    def __init__(
        self,
        kind: str,
        replies: zmq.Socket,
        watchdog: Watchdog,
        spare: SpareCores,
        outbox: Mailbox | None = None,
    ) -> None:
        super().__init__(spare)
        self.kind = kind
        self.replies = replies
        self.outbox = outbox  # replies go here when the link uses mailboxes
        self.watchdog = watchdog
        self.codec = Codec(m.Command)
        self.handlers: dict[type, Callable] = {
            m.Load: self.load,
            m.Prefill: self.prefill,
            m.Draft: self.draft,
            m.Decode: self.decode,
            m.VerifyTree: self.verify,
            m.Commit: self.commit,
            m.Rollback: self.rollback,
            m.Tokenize: self.tokenize,
            m.Echo: self.echo,
        }
        self._seen: dict[int, float] = {}  # when each sequence's last command was taken
        self._batch_s = 0.0  # how long the last verification or decoding took, with its batch

    def send(self, message: msgspec.Struct, arrays=()) -> None:
        frames = self.codec.encode(message, arrays)
        if self.outbox is not None:
            # replies are matched by request, not order: one too big for the ring (or one
            # the daemon has no room for yet) may overtake others by the socket
            with contextlib.suppress(MailboxFull):
                if self.outbox.post(frames):
                    self.outbox.ring()
                    return
        # zero-copy only pays for big frames; pyzmq's zero-copy path costs more for small ones
        self.replies.send_multipart(frames, copy=not arrays)

    def serve(self, commands: CommandReader) -> None:
        self.cancelled = commands.running_cancelled
        while True:
            command, frames = commands.next()
            if isinstance(command, m.Shutdown):
                return
            if (sequence := getattr(command, "sequence", None)) is not None:
                self._seen[sequence] = time.perf_counter()
            along, leads = [], self.leads(command)
            if leads:  # other sequences' commands queued: one forward for all
                self._gather(commands, command)
                along = commands.take_along(command, functools.partial(self.joins, command))
            self.watchdog.busy = getattr(command, "request", None)
            sent: set[int] = set()
            began = time.perf_counter()
            try:
                if along:
                    batch = [command, *(queued for queued, _ in along)]

                    def early(index: int, answer, batch=batch, sent=sent) -> None:
                        self._answer(batch[index], answer)
                        sent.add(index)

                    def more(busy: set[int], first=command) -> list[msgspec.Struct]:
                        joins = functools.partial(self.joins, first)
                        taken = [queued for queued, _ in commands.take_along(first, joins, busy)]
                        now = time.perf_counter()
                        self._seen.update((queued.sequence, now) for queued in taken)
                        return taken

                    answers = list(zip(batch, self._together(batch, early, more), strict=True))
                else:
                    answers = [(command, self._alone(command, frames))]
            finally:
                self.watchdog.busy = None
            if leads:
                self._batch_s = time.perf_counter() - began
            for index, (ran, answer) in enumerate(answers):  # one reply a command
                if index not in sent:
                    self._answer(ran, answer)

    def _gather(self, commands: CommandReader, command: msgspec.Struct) -> None:
        """Wait a little for the sequences that were busy lately and have no command queued:
        their drafts, made one after the other, end a few milliseconds apart, and a forward
        that left them out would make them wait for the next one."""
        now = time.perf_counter()
        busy = {s for s, at in self._seen.items() if now - at < BUSY_S} - {command.sequence}
        if busy:
            commands.gather(busy, min(GATHER_S, GATHER_SHARE * self._batch_s))

    def _answer(self, command: msgspec.Struct, answer: tuple | Exception) -> None:
        if isinstance(answer, Exception):
            self.send(self.failure(command, answer))
        else:
            self.send(*answer)

    def _alone(self, command: msgspec.Struct, frames) -> tuple | Exception:
        try:
            return self.handlers[type(command)](command, frames)
        except Exception as error:
            return error

    def _together(self, batch: list[msgspec.Struct], early, more) -> list[tuple | Exception]:
        try:
            return self.run_together(batch, early, more)
        except Exception as error:  # a fault of the batch itself: every command's answer
            return [error] * len(batch)

    def failure(self, command: msgspec.Struct, error: Exception) -> m.Failed:
        request = getattr(command, "request", None)
        if isinstance(error, LoadError):
            return m.Failed(request=request, kind="load", message=str(error))
        if isinstance(error, Interrupted):
            return m.Failed(request=request, kind="cancelled", message=str(error))
        if isinstance(error, RuntimeUsageError | SamplingError | ArenaError | MessageError):
            return m.Failed(request=request, kind="usage", message=str(error))
        where = traceback.extract_tb(error.__traceback__)[-1]
        log.error("command failed", op=type(command).__name__, exc_info=error)
        message = f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})"
        return m.Failed(request=request, kind="internal", message=message)

    def load(self, command: m.Load, frames) -> tuple:
        start = time.perf_counter()
        if self.runtime is not None:
            self.spare.use(False, self._set_extra_threads)
            getattr(self.runtime, "close", lambda: None)()  # its siblings' too
            self.runtime = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if command.arena is not None:
            # only a shared-memory object: never a file elsewhere the command happens to name
            if Path(command.arena.path).parent != SHM_DIR:
                raise LoadError(
                    f"the arena must be a shared-memory object in {SHM_DIR}, not "
                    f"{command.arena.path}"
                )
            self.arena = Arena.attach(command.arena)
        runtime, device = load_runtime(
            self.kind, command.model, command.settings, command.sequences
        )
        self.runtime = runtime  # and its siblings: a sequence an engine
        if self.arena is not None:  # the widest tree a verification can send (warmed once:
            # every sequence computes with the same kernels)
            runtime.warm_up(self.arena.layout.slot_bytes // (runtime.vocab_size * 4))
            runtime.pin_host_memory(self.arena.memory())  # logits straight into the arena
        ready = m.Ready(
            model=command.model,
            device=device,
            vocab=runtime.vocab_info(),
            context=runtime.capacity,
            threads=runtime.threads,
            load_ms=(time.perf_counter() - start) * 1000,
            token_bytes=[runtime.token_bytes(i) for i in range(runtime.vocab_size)],
            special_tokens=runtime.special_tokens(),
            sequences=len(self.sequences),
        )
        log.info(
            "model loaded",
            model=command.model,
            device=device,
            sequences=ready.sequences,
            ms=round(ready.load_ms),
        )
        return ready, ()
