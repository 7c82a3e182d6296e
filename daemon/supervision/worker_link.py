"""The transport between the daemon and one worker incarnation: two ZeroMQ endpoints, and two
shared-memory mailboxes where they work.

Each incarnation gets two fresh endpoints in the runtime directory (commands: our PUSH -> the
worker's PULL; replies: its PUSH -> our PULL), so nothing queued for a dead incarnation can
reach the next one. With mailboxes (``protocol/mailbox.py``: x86-64 Linux) commands and
replies go through shared memory and a bell instead; a message too big for a ring goes by the
socket, and a marker in the ring says where it went.

Contract:
- the endpoints are created with mode 0600 whatever the umask (``bind_private``): whoever can
  connect to them can take the worker's commands;
- ``send`` never blocks the event loop, and the worker reads commands in the order sent; a
  worker that stopped reading makes it raise ``WorkerError`` (kind ``overloaded``);
- every message received, by the socket or by the mailbox, goes to ``on_frames`` as it is
  read, and ``after_replies`` runs after each batch; for ``reply_spin_us`` after a call is
  sent (``start_polling``) the replies mailbox is read on every pass of the event loop while
  ``awaiting()`` says a reply is still due;
- ``close`` releases whatever ``bind``, ``create_mailboxes`` and ``listen`` got, however far
  they got, and removes the endpoint files.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from hetspec.daemon.supervision.worker_errors import WorkerError, WorkerStartError
from hetspec.protocol.mailbox import Mailbox, MailboxFull
from hetspec.protocol.mailbox import supported as mailboxes_supported


def bind_private(sock: zmq.Socket, endpoint: str) -> None:
    """Bind an ``ipc://`` endpoint that only this user can connect to, whatever the umask.

    libzmq creates the socket file inside ``bind`` in this thread, so a restrictive umask
    around it leaves no moment in which the file is open to others; the chmod repeats it in
    case the file system ignored the umask. (The umask is process-wide: the daemon's event
    loop is single-threaded and nothing else creates files while this runs.)
    """
    previous = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(previous)
    os.chmod(endpoint.removeprefix("ipc://"), 0o600)


class WorkerLink:
    """The endpoints and mailboxes of worker ``name``'s incarnation ``generation``."""

    def __init__(
        self,
        runtime_dir: Path,
        name: str,
        generation: int,
        died: asyncio.Future,
        *,
        reply_spin_us: float,
        on_frames: Callable[[list[bytes]], None],
        after_replies: Callable[[], None],
        awaiting: Callable[[], bool],
    ) -> None:
        self.runtime_dir, self.name, self.generation = runtime_dir, name, generation
        self.reply_spin_us = reply_spin_us
        self._died = died  # resolves once the worker is gone
        self._on_frames = on_frames
        self._after_replies = after_replies
        self._awaiting = awaiting
        self._context = zmq.Context.instance()
        self.commands: zmq.Socket | None = None
        self.replies: zmq.Socket | None = None
        self.outbox: Mailbox | None = None  # commands, when the link uses mailboxes
        self.inbox: Mailbox | None = None  # replies from the compute thread
        self.polling_until: float | None = None  # perf_counter; None: not polling
        self._reading = False  # the replies socket is registered with the event loop

    def endpoint(self, role: str) -> str:
        return f"ipc://{self.runtime_dir}/{self.name}-{self.generation}-{role}.sock"

    def bind(self) -> None:
        """Both endpoints, the owner's alone."""
        self.commands = self._context.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.LINGER, 0)
        bind_private(self.commands, self.endpoint("commands"))
        self.replies = self._context.socket(zmq.PULL)
        self.replies.setsockopt(zmq.LINGER, 0)
        bind_private(self.replies, self.endpoint("replies"))

    def create_mailboxes(self, wanted: bool) -> list[int]:
        """Both mailboxes, where ``wanted`` and they work here: the descriptors the worker
        inherits (the commands' then the replies'); none without."""
        if not (wanted and mailboxes_supported()):
            return []
        self.outbox = Mailbox.create()
        self.inbox = Mailbox.create()
        return [*self.outbox.fds, *self.inbox.fds]

    def listen(self) -> None:
        """Read replies as they come from now on, and whatever arrived before."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.replies.FD, self.on_readable)
        if self.inbox is not None:
            loop.add_reader(self.inbox.bell_fd, self.on_bell)
        self._reading = True
        self.on_readable()  # anything that arrived before the reader was registered

    def close(self) -> None:
        """Close what ``bind``, ``create_mailboxes`` and ``listen`` got so far, however far
        they got, and remove the endpoint files."""
        replies = self.replies
        if self._reading and not replies.closed:
            asyncio.get_running_loop().remove_reader(replies.FD)
            if self.inbox is not None:
                asyncio.get_running_loop().remove_reader(self.inbox.bell_fd)
            self._reading = False
        for box in (self.outbox, self.inbox):
            if box is not None:
                box.close()
        self.outbox = self.inbox = None
        for sock in (self.commands, self.replies):
            if sock is not None:
                sock.close(linger=0)
        for role in ("commands", "replies"):
            with contextlib.suppress(OSError):  # never bound, or not ours to remove
                os.unlink(self.endpoint(role).removeprefix("ipc://"))

    # ------------------------------------------------------------ receiving

    def on_readable(self) -> None:
        """The replies socket's FD fired. ZeroMQ signals edges, so drain until it is empty.

        A plain socket with a reader callback, rather than zmq.asyncio: each reply then costs
        one callback instead of several futures and task switches (~100 us less a round trip).
        """
        while self.replies.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_frames(self.replies.recv_multipart(zmq.NOBLOCK))
        self._after_replies()

    def on_bell(self) -> None:
        """The replies mailbox's bell rang: reset it, then read every reply posted."""
        self.inbox.clear()
        self._read_inbox()

    def _read_inbox(self) -> None:
        while (frames := self.inbox.take()) is not None:
            if isinstance(frames, list):  # the worker never diverts: big replies just use zmq
                self._on_frames(frames)
        self._after_replies()

    def _poll_replies(self) -> None:
        """Read the replies mailbox, and again on the event loop's next pass while a call is
        pending and the poll lasts: the loop then never sleeps, so a reply is read without
        waiting to be woken. Its bell still rings; ``on_bell`` then finds nothing new."""
        until = self.polling_until
        if self.inbox is None or until is None:
            self.polling_until = None
            return
        self._read_inbox()
        if self._awaiting() and time.perf_counter() < until and not self._died.done():
            asyncio.get_running_loop().call_soon(self._poll_replies)
        else:
            self.polling_until = None

    def start_polling(self) -> None:
        """Poll the replies mailbox for ``reply_spin_us`` from now (``_poll_replies``)."""
        if self.inbox is None or self.reply_spin_us <= 0:
            return
        polling = self.polling_until is not None
        self.polling_until = time.perf_counter() + self.reply_spin_us / 1e6
        if not polling:
            asyncio.get_running_loop().call_soon(self._poll_replies)

    # ------------------------------------------------------------ sending

    async def send_first(self, frames: list, timeout_s: float) -> None:
        """The first command: the worker's commands connection may still be in its handshake
        when its Hello arrives (a different socket), and until then PUSH has nowhere to send.
        A mailbox is there from the start."""
        if self.outbox is not None:
            self.send(frames)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.commands.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() > deadline or self._died.done():
                    raise WorkerStartError(
                        f"{self.name} worker never connected its command socket"
                    ) from None
                await asyncio.sleep(0.001)

    def send(self, frames: list, copy: bool = True) -> None:
        """Queue frames for the worker; zero-copy only for big arrays (pyzmq's zero-copy path
        costs more than a copy for small frames). Never blocks the event loop.

        With mailboxes, a message too big for the ring goes by the socket, and a marker in
        the ring says where it was, so that the worker reads commands in the order sent."""
        try:
            if self.outbox is None:
                self.commands.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                return
            if not self.outbox.post(frames):
                self.commands.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                self.outbox.divert()
            self.outbox.ring()
        except (zmq.Again, MailboxFull):
            raise WorkerError(
                self.name, "overloaded", "its command queue is full (it stopped reading)"
            ) from None

    def announce(self) -> None:
        """Wake the worker to wait awake for a command about to be sent (the mailbox's
        ``announce``; nothing over ZeroMQ alone)."""
        if self.outbox is not None and not self._died.done():
            with contextlib.suppress(OSError):  # a bell gone with the worker: nothing to wake
                self.outbox.announce()
