"""A shared-memory arena: one segment cut into equal slots that hold large arrays.

Probability rows and logits are too large to copy through sockets on every round (a 32k-token
vocabulary is 128 KB per row). The daemon creates one segment per instance; workers map it
and write their rows straight into the slot a command names, and whoever reads the reply views
the slot in place. Which slot belongs to whom is the daemon's business (it lends a slot with a
command and takes it back after reading the reply); this module only maps memory.

The segment is a file under /dev/shm (what ``shm_open`` uses on Linux), created 0600 with
O_EXCL, and named after the daemon instance so that a restarted daemon can find and remove
what an earlier, killed instance left behind. Its pages are allocated when it is created: a
/dev/shm too small for it is a clear error then, not a SIGBUS in a worker later.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import stat
from pathlib import Path

import msgspec
import numpy as np

SHM_DIR = Path("/dev/shm")
ALIGNMENT = 64  # slot starts on cache-line boundaries


class ArenaError(RuntimeError):
    """The arena cannot be created or mapped, or a reference does not fit in it."""


class ArenaExistsError(ArenaError):
    """``create`` found its path taken (a new name may succeed)."""


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
        # math.prod, not numpy's: this runs several times a round trip (~5 us each in numpy)
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


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
        """A new segment at ``path`` (never an existing file: ``ArenaExistsError``), its pages
        allocated; ``ArenaError`` naming the size needed and the free space if they do not fit."""
        if slots < 1 or slot_bytes < 1:
            raise ArenaError(f"an arena needs slots and bytes, not {slots} x {slot_bytes}")
        layout = ArenaLayout(str(path), slots, slot_size(slot_bytes))
        folder = Path(path).parent
        free = _free_bytes(folder)
        if free is not None and free < layout.size:  # say so before taking any of it
            raise ArenaError(_too_small(layout.size, folder, free))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as error:
            raise ArenaExistsError(
                f"cannot create the shared-memory arena {path}: {error.strerror}"
            ) from None
        except OSError as error:
            raise ArenaError(f"cannot create the shared-memory arena {path}: {error}") from None
        try:
            # allocated, not sparse: a full /dev/shm fails here rather than as a SIGBUS later
            os.posix_fallocate(fd, 0, layout.size)
        except OSError as error:
            os.close(fd)
            unlink_quietly(path)
            if error.errno == errno.ENOSPC:
                raise ArenaError(_too_small(layout.size, folder, _free_bytes(folder))) from None
            raise ArenaError(
                f"cannot allocate the arena {path} ({layout.size} bytes): {error.strerror}"
            ) from None
        return cls(layout, fd, owner=True)

    @classmethod
    def attach(cls, layout: ArenaLayout) -> Arena:
        """Map the segment ``layout`` names: only a regular file of our own user (never through
        a symlink) of exactly ``layout.size`` bytes, else ``ArenaError``."""
        # O_NONBLOCK: opening a FIFO planted there must not hang the worker
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(layout.path, flags)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise ArenaError(f"arena {layout.path} is a symbolic link; refusing it") from None
            raise ArenaError(f"cannot open the shared-memory arena: {error}") from None
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.geteuid():
            problem = f"belongs to uid {info.st_uid}, not to this process's ({os.geteuid()})"
        elif info.st_size != layout.size:
            problem = f"has {info.st_size} bytes, expected {layout.size}"
        if problem is not None:
            os.close(fd)
            raise ArenaError(f"arena {layout.path} {problem}")
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

    def memory(self) -> np.ndarray:
        """The whole segment as bytes (e.g. to register it with a GPU driver)."""
        if self._buffer is None:
            raise ArenaError("the arena is closed")
        return self._buffer

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


def _free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged user may still allocate in ``folder``'s file system."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return None  # the open below reports a missing folder
    return info.f_bavail * info.f_frsize


def _too_small(size: int, folder: Path, free: int | None) -> str:
    have = "?" if free is None else f"{free / 2**20:.1f}"
    return (
        f"the shared-memory arena needs {size / 2**20:.1f} MiB but {folder} has {have} MiB "
        "free: make it larger, or the arena smaller (arena_slots, max_tree_nodes)"
    )
