"""One daemon instance per runtime directory: its lock, its name, and what it leaves behind.

Several daemons may run side by side without root (tests do), each with its own runtime
directory. The instance name is derived from that directory, so an instance restarted on the
same directory finds the shared-memory segments and sockets of an earlier, killed incarnation
(they carry its name) and removes them before creating its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

import structlog

from hetspec.protocol.arena import SHM_DIR, Arena, unlink_quietly

log = structlog.get_logger("hetspec.daemon")


class InstanceError(RuntimeError):
    pass


class Instance:
    def __init__(self, runtime_dir: str | Path) -> None:
        self.runtime_dir = Path(runtime_dir).absolute()
        digest = hashlib.sha256(str(self.runtime_dir).encode()).hexdigest()[:12]
        self.name = f"hetspec-{digest}"
        self._lock_fd: int | None = None

    def acquire(self) -> None:
        """Create the runtime directory (0700), take its lock, clean up after a dead instance."""
        try:
            self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.runtime_dir / "hetspecd.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise InstanceError(
                f"cannot use runtime directory {self.runtime_dir}: {error}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = (self.runtime_dir / "hetspecd.lock").read_text().strip() or "?"
            raise InstanceError(
                f"another hetspecd (pid {holder}) already uses {self.runtime_dir}; give this one "
                "its own --runtime-dir and --socket"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self.remove_leftovers()

    def remove_leftovers(self) -> list[str]:
        """Segments and endpoints an earlier instance on this directory did not remove."""
        removed = []
        endpoints = [
            *self.runtime_dir.glob("*-commands.sock"),
            *self.runtime_dir.glob("*-replies.sock"),
        ]
        for path in [*SHM_DIR.glob(f"{self.name}-*"), *endpoints]:
            unlink_quietly(path)
            removed.append(str(path))
        if removed:
            log.warning("removed leftovers of an earlier instance", paths=removed)
        return removed

    def create_arena(self, slots: int, slot_bytes: int) -> Arena:
        return Arena.create(SHM_DIR / f"{self.name}-{os.getpid()}-arena", slots, slot_bytes)

    def release(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = None
