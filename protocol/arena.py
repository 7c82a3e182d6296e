"""A shared-memory arena: one segment cut into equal slots that hold large arrays.

Probability rows and logits are too large to copy through sockets on every round (a 32k-token
vocabulary is 128 KB per row). The daemon creates one segment per instance; workers map it
and write their rows straight into the slot a command names, and whoever reads the reply views
the slot in place. Which slot belongs to whom is the daemon's business (it lends a slot with a
command and takes it back after reading the reply); this module only maps memory.

The segment is a file under /dev/shm (what ``shm_open`` uses on Linux), created 0600 with
O_EXCL, and named after the daemon instance so that a restarted daemon can find and remove
what an earlier, killed instance left behind.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import msgspec
import numpy as np

SHM_DIR = Path("/dev/shm")
ALIGNMENT = 64  # slot starts on cache-line boundaries


class ArenaError(RuntimeError):
    """The arena cannot be created or mapped, or a reference does not fit in it."""


class ArenaLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str  # the file backing the segment
    slots: int
    slot_bytes: int

    @property
    def size(self) -> int:
        return self.slots * self.slot_bytes


class ArrayRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where an array of a message lies: an extra frame of the message, or an arena slot."""

    dtype: str  # numpy dtype string, e.g. "<f4"
    shape: tuple[int, ...]
    frame: int = -1  # >= 1: index of the message frame holding the bytes
    slot: int = -1  # >= 0: the arena slot holding them (from its first byte)

    def __post_init__(self) -> None:
        if (self.frame >= 1) == (self.slot >= 0):
            raise ValueError("an array lies either in one frame (>= 1) or in one slot (>= 0)")
        if any(extent < 0 for extent in self.shape):
            raise ValueError(f"negative extent in shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def slot_size(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class Arena:
    """A mapped segment: ``create`` makes it (and unlinks it on close), ``attach`` maps it."""

    def __init__(self, layout: ArenaLayout, fd: int, owner: bool) -> None:
        self.layout = layout
        self.owner = owner
        try:
            self._map = mmap.mmap(fd, layout.size)
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, path: str | Path, slots: int, slot_bytes: int) -> Arena:
        if slots < 1 or slot_bytes < 1:
            raise ArenaError(f"an arena needs slots and bytes, not {slots} x {slot_bytes}")
        layout = ArenaLayout(str(path), slots, slot_size(slot_bytes))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise ArenaError(f"cannot create the shared-memory arena {path}: {error}") from None
        try:
            os.ftruncate(fd, layout.size)
        except OSError as error:
            os.close(fd)
            os.unlink(path)
            raise ArenaError(
                f"cannot size the arena {path} to {layout.size} bytes: {error}"
            ) from None
        return cls(layout, fd, owner=True)

    @classmethod
    def attach(cls, layout: ArenaLayout) -> Arena:
        try:
            fd = os.open(layout.path, os.O_RDWR)
        except OSError as error:
            raise ArenaError(f"cannot open the shared-memory arena: {error}") from None
        size = os.fstat(fd).st_size
        if size != layout.size:
            os.close(fd)
            raise ArenaError(f"arena {layout.path} has {size} bytes, expected {layout.size}")
        return cls(layout, fd, owner=False)

    def view(self, ref: ArrayRef) -> np.ndarray:
        """The array ``ref`` points at, in place (writable)."""
        if not 0 <= ref.slot < self.layout.slots:
            raise ArenaError(f"slot {ref.slot} outside the arena's {self.layout.slots} slots")
        if ref.nbytes > self.layout.slot_bytes:
            raise ArenaError(
                f"a {ref.shape} {ref.dtype} array ({ref.nbytes} bytes) does not fit in a "
                f"{self.layout.slot_bytes}-byte slot"
            )
        start = ref.slot * self.layout.slot_bytes
        raw = self._buffer[start : start + ref.nbytes]
        return raw.view(np.dtype(ref.dtype)).reshape(ref.shape)

    def empty(self, slot: int, shape: tuple[int, ...], dtype: str = "<f4") -> np.ndarray:
        """An uninitialised array in ``slot``, for a writer to fill in place."""
        return self.view(ArrayRef(np.dtype(dtype).str, tuple(shape), slot=slot))

    def close(self) -> None:
        """Unmap (and, for the creator, unlink) the segment."""
        self._buffer = None
        with contextlib.suppress(BufferError):  # views still alive: unmapped when they go
            self._map.close()
        if self.owner:
            unlink_quietly(self.layout.path)
            self.owner = False

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def unlink_quietly(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
