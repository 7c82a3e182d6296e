"""A mailbox: one direction of the daemon-worker link, in shared memory with an eventfd bell.

A ZeroMQ message between two processes passes through each side's I/O thread: three thread
wake-ups per hop, ~100 us a round trip on a quiet box and several times that when the cores
are busy (docs/architecture.md, "The worker link"). A mailbox is a single-producer,
single-consumer ring of messages in a memfd both processes map, plus an eventfd: the
producer copies the frames in, publishes them by advancing its counter, then rings the bell
(one ``write``, which wakes a consumer blocked on it and costs ~1 us otherwise). A consumer
that spins finds the message without any system call; one that sleeps polls the bell.

Publishing relies on the processor keeping stores in program order (the frames are written
before the counter that publishes them), which x86-64 guarantees and Python cannot enforce on
weaker memory models: ``supported()`` is False elsewhere, and the link stays ZeroMQ there.

Ring layout: the producer's counter (bytes ever written) at byte 0 and its announcements
(``announce``) at byte 8, the consumer's counter (bytes ever read) at byte 64, each side's
on its own cache line, then ``capacity`` bytes of records. A
record is ``<u32 count, u32 size>`` (size: the whole record, 8-byte aligned), ``count`` u32
frame lengths, then the frames. Two counts are markers: WRAP (the rest of the ring is unused,
the next record is at its start) and DIVERTED (the next message is on the ZeroMQ socket: one
too big for the ring, kept in order with the ones around it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

WRAP = 0xFFFFFFFF
DIVERTED = 0xFFFFFFFE
HEADER = 128  # two counters, a cache line each
DEFAULT_CAPACITY = 1 << 20
_RECORD = struct.Struct("<II")


class MailboxFull(RuntimeError):
    """The consumer has not read what is in the ring; nothing was written."""


class Diverted:
    """What ``take`` returns for a DIVERTED marker: read the next message from the socket."""


DIVERTED_MESSAGE = Diverted()


def supported() -> bool:
    """Whether mailboxes may carry the link here: Linux (memfd, eventfd) on x86-64 (stores
    become visible in program order)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(os, "memfd_create")
        and hasattr(os, "eventfd")
    )


def _aligned(size: int) -> int:
    return (size + 7) & ~7


class Mailbox:
    """One end of a ring: ``post``/``ring`` on the producer's, ``take``/``clear`` on the
    consumer's. Not thread-safe: one thread posts and one (other process's) thread takes."""

    def __init__(self, memory_fd: int, bell_fd: int, capacity: int) -> None:
        if capacity < 4096 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two >= 4096, not {capacity}")
        self.memory_fd, self.bell_fd, self.capacity = memory_fd, bell_fd, capacity
        self._map = mmap.mmap(memory_fd, HEADER + capacity)
        counters = np.frombuffer(self._map, np.uint64, HEADER // 8)
        self._written, self._announced, self._read = counters[0:1], counters[1:2], counters[8:9]
        self._data = memoryview(self._map)[HEADER:]
        self._mask = capacity - 1
        self._closed = False

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY) -> Mailbox:
        """A new, empty mailbox (its descriptors close on exec unless passed on)."""
        opened: list[int] = []
        try:
            opened.append(os.memfd_create("hetspec-mailbox", os.MFD_CLOEXEC))
            os.ftruncate(opened[0], HEADER + capacity)
            opened.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            return cls(*opened, capacity)
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise

    @classmethod
    def attach(cls, memory_fd: int, bell_fd: int) -> Mailbox:
        """The mailbox whose descriptors this process inherited."""
        size = os.fstat(memory_fd).st_size
        return cls(memory_fd, bell_fd, size - HEADER)

    @property
    def fds(self) -> tuple[int, int]:
        return self.memory_fd, self.bell_fd

    # ------------------------------------------------------------ producer

    def post(self, frames: Sequence[Any]) -> bool:
        """Copy ``frames`` (bytes or C-contiguous buffers) in as one message; False if it is
        too big for the ring (send it another way, after ``divert``). Raises ``MailboxFull``
        if the consumer has left too little room."""
        views = [memoryview(frame).cast("B") for frame in frames]
        lengths = 4 * len(views)
        size = _aligned(_RECORD.size + lengths + sum(view.nbytes for view in views))
        if size > self.capacity // 2:
            return False
        offset, skip = self._reserve(size)
        _RECORD.pack_into(self._data, offset, len(views), size)
        struct.pack_into(
            f"<{len(views)}I", self._data, offset + _RECORD.size, *(view.nbytes for view in views)
        )
        position = offset + _RECORD.size + lengths
        for view in views:
            self._data[position : position + view.nbytes] = view
            position += view.nbytes
        self._publish(skip + size)
        return True

    def divert(self) -> None:
        """Mark where the next message goes by the socket instead, keeping the order."""
        offset, skip = self._reserve(_RECORD.size)
        _RECORD.pack_into(self._data, offset, DIVERTED, _RECORD.size)
        self._publish(skip + _RECORD.size)

    def ring(self) -> None:
        os.eventfd_write(self.bell_fd, 1)

    def announce(self) -> None:
        """Say a message is coming soon and wake the consumer, so that it is awake (polling)
        when the message comes instead of waking then."""
        self._announced[0] = int(self._announced[0]) + 1
        self.ring()

    def _reserve(self, size: int) -> tuple[int, int]:
        """(offset, bytes skipped): where a record of ``size`` bytes goes, after a WRAP
        marker if it would cross the ring's end (published with the record)."""
        written = int(self._written[0])
        offset = written & self._mask
        skip = self.capacity - offset if offset + size > self.capacity else 0
        if written + skip + size - int(self._read[0]) > self.capacity:
            raise MailboxFull(f"the mailbox is full ({self.capacity} bytes unread)")
        if skip:
            _RECORD.pack_into(self._data, offset, WRAP, skip)
        return (0 if skip else offset), skip

    def _publish(self, size: int) -> None:
        # the frames are in place before the counter says so (x86-64 keeps store order)
        self._written[0] = int(self._written[0]) + size

    # ------------------------------------------------------------ consumer

    def take(self) -> list[bytes] | Diverted | None:
        """The next message's frames (copies), ``DIVERTED_MESSAGE``, or None when empty."""
        read = int(self._read[0])
        if read == int(self._written[0]):
            return None
        offset = read & self._mask
        count, size = _RECORD.unpack_from(self._data, offset)
        if count == WRAP:
            read += size
            offset = 0
            count, size = _RECORD.unpack_from(self._data, 0)
        if count == DIVERTED:
            message: list[bytes] | Diverted = DIVERTED_MESSAGE
        else:
            lengths = struct.unpack_from(f"<{count}I", self._data, offset + _RECORD.size)
            position = offset + _RECORD.size + 4 * count
            message = []
            for length in lengths:
                message.append(bytes(self._data[position : position + length]))
                position += length
        self._read[0] = read + size
        return message

    def announcements(self) -> int:
        """How many times the producer announced a message (``announce``): a consumer that
        remembers the count at each message it takes knows whether a wake-up announced
        one still to come."""
        return int(self._announced[0])

    def clear(self) -> None:
        """Reset the bell before draining, so that a message posted after the drain rings it
        again."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.bell_fd)

    # ------------------------------------------------------------ both

    def close(self) -> None:
        """Unmap and close this process's descriptors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._data.release()
        del self._written, self._announced, self._read
        with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps
            self._map.close()
        for fd in (self.memory_fd, self.bell_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
