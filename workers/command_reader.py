"""The command socket (or mailbox), read by the worker's compute thread itself.

Contract: ``CommandReader.next`` returns the next command to run with its frames, in the
order the daemon sent them; a malformed one is answered (``Failed``, no request) and never
returned, a ``Cancel`` answers the queued command it names in its place, and
``running_cancelled`` says whether a command running now has been cancelled since it was
taken. ``take_along`` takes queued commands early, to run beside the one taken last (several
sequences' verifications in one forward): only commands of other sequences that no earlier
queued command of their sequence precedes, and never past a command of no sequence (a Load,
Shutdown, Tokenize or Echo), so each sequence still sees its commands in the order sent.
"""

from __future__ import annotations

import itertools
import select
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec
import zmq

from hetspec.protocol import Codec, MessageError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.mailbox import Mailbox


class CommandReader:
    """The command socket, read by the compute thread itself.

    A hand-off from a receiving thread would cost a thread wake-up per command, and on an idle
    (virtual) CPU a wake-up costs tens of microseconds; so the compute thread receives, and
    after each command it spins for ``spin_s`` before it blocks, because in a speculative
    round the next command follows within a fraction of a millisecond. Whatever arrived
    with a command is drained into the backlog too, so a ``Cancel`` read there stops a
    command still queued.

    A ``Cancel`` for a command running now (the one ``next`` took, or one ``take_along``
    took beside it) is remembered until the next one starts: a long one (a prompt's prefill)
    asks ``running_cancelled`` between its chunks; commands run together do not stop for it
    and are answered as computed (one reply a command either way). Any other ``Cancel`` for a
    command not in the backlog is dropped: the daemon sends a command before its ``Cancel``,
    on this one connection, so that command was answered already. Remembering such late
    cancels would grow without bound.

    With a ``mailbox`` the commands come through it (a socket message only where a marker in
    it says so), and spinning reads shared memory instead of asking ZeroMQ. A wake-up that
    announced a command (``Mailbox.announce``: the daemon knows the next draft follows a
    verification's verdict) but brought none is followed by a spin of ``ANNOUNCED_SPIN_S``,
    so that the command finds the reader awake.
    """

    ANNOUNCED_SPIN_S = 0.001  # the daemon posts the command ~0.1-0.5 ms after announcing it

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        spin_s: float,
        failed,
        mailbox: Mailbox | None = None,
    ) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.connect(endpoint)
        self.mailbox = mailbox
        self._bell = select.poll()  # where a sleeping reader waits for the mailbox's bell
        if mailbox is not None:
            self._bell.register(mailbox.bell_fd, select.POLLIN)
        self.spin_s = spin_s
        self.codec = Codec(m.Command)
        self.failed = failed  # how to answer a malformed or cancelled command
        self.backlog: deque[tuple[msgspec.Struct, list[bytes]]] = deque()
        self._announcements = 0  # announcements seen when the last command was taken
        self._running: set[int] = set()  # the requests of the commands running now
        self._running_cancelled = False

    def _take(self, frames: list[bytes]) -> None:
        try:
            command = self.codec.decode(frames)
        except MessageError as error:
            self.failed(m.Failed(request=None, kind="protocol", message=str(error)))
            return
        if isinstance(command, m.Cancel):
            self._cancel(command.request)
        else:
            self.backlog.append((command, frames))

    def _cancel(self, request: int) -> None:
        """Answer the queued command ``request`` as cancelled and drop it; none queued: it
        was answered already, and the Cancel has nothing left to do."""
        for entry in self.backlog:
            if getattr(entry[0], "request", None) == request:
                self.backlog.remove(entry)
                self.failed(m.Failed(request=request, kind="cancelled", message="cancelled"))
                return
        if request in self._running:
            self._running_cancelled = True

    def running_cancelled(self) -> bool:
        """Whether the daemon has cancelled a command running now (reads what came since)."""
        self._drain()
        return self._running_cancelled

    def _drain(self) -> None:
        if self.mailbox is not None:
            while (frames := self.mailbox.take()) is not None:
                # diverted: the daemon sent it on the socket before it posted the marker
                self._take(frames if isinstance(frames, list) else self.socket.recv_multipart())
            return
        while True:
            try:
                self._take(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _wait(self) -> None:
        """Sleep until a command may have come."""
        if self.mailbox is None:
            self._take(self.socket.recv_multipart())
            return
        self._bell.poll()
        self.mailbox.clear()  # before draining: a command posted after the drain rings again

    def next(self) -> tuple[msgspec.Struct, list[bytes]]:
        self._drain()  # a Cancel that came while the last command ran stops a queued one
        self._spin(self.spin_s)
        while not self.backlog:
            self._wait()
            self._drain()
            if not self.backlog and self._announced():
                self._spin(self.ANNOUNCED_SPIN_S)
        if self.mailbox is not None:  # announcements made before it are this command's
            self._announcements = self.mailbox.announcements()
        command = self.backlog.popleft()
        self._running = {getattr(command[0], "request", None)}
        self._running_cancelled = False
        return command

    def take_along(
        self,
        first: msgspec.Struct,
        joins: Callable[[msgspec.Struct], bool],
        busy: Iterable[int] = (),
    ) -> list[tuple[msgspec.Struct, list[bytes]]]:
        """The queued commands (with their frames) to run beside ``first``, the command
        ``next`` returned last, in the order they came: each one ``joins`` accepts whose
        sequence neither ``first``, nor ``busy`` (sequences already running beside it), nor
        a command taken, nor any command before it in the backlog names; the search stops at
        a command of no sequence. Reads what has come first (without waiting); the commands
        taken leave the backlog and run with ``first``."""
        self._drain()
        seen = {first.sequence, *busy}
        taken: list[tuple[msgspec.Struct, list[bytes]]] = []
        left: list[tuple[msgspec.Struct, list[bytes]]] = []
        for index, entry in enumerate(self.backlog):
            sequence = getattr(entry[0], "sequence", None)
            if sequence is None:  # a Load, Shutdown, Tokenize or Echo: nothing passes it
                left.extend(itertools.islice(self.backlog, index, None))
                break
            (taken if sequence not in seen and joins(entry[0]) else left).append(entry)
            seen.add(sequence)
        if taken:
            self.backlog = deque(left)
            self._running.update(command.request for command, _ in taken)
        return taken

    def gather(self, sequences: set[int], seconds: float) -> None:
        """Read what comes for up to ``seconds``, until the backlog holds a command of each
        of ``sequences``: the commands about to come that could run beside the one taken."""
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            self._drain()
            if sequences <= {getattr(c, "sequence", None) for c, _ in self.backlog}:
                return

    def _spin(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        while not self.backlog and time.perf_counter() < deadline:
            self._drain()

    def _announced(self) -> bool:
        """Whether a command was announced since the last one was taken."""
        return self.mailbox is not None and self.mailbox.announcements() != self._announcements
