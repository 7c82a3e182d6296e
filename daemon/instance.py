"""One daemon instance per runtime directory and per socket: its locks, its name, and what it
leaves behind.

Several daemons may run side by side without root (tests do), each with its own runtime
directory and socket. The instance name is derived from that directory, so an instance
restarted on the same directory finds the shared-memory segments and sockets of an earlier,
killed incarnation (they carry its name) and removes them before creating its own.

What other local users can plant is never trusted: the runtime directory must be ours and
writable by nobody else, lock files are opened without following symlinks, and of the
entries in /dev/shm (writable by everyone) only our own regular files are removed. Lock files
stay in place when the daemon stops (only their pid is cleared): unlinking a lock another
process may be opening would let two processes hold "the" lock at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import socket
import stat
from pathlib import Path

import structlog

from hetspec.protocol.arena import SHM_DIR, Arena, ArenaError, ArenaExistsError

log = structlog.get_logger("hetspec.daemon")

LOCK_NAME = "hetspecd.lock"
RUNTIME_DIR_MODE = 0o750  # group members reach the socket kept here, nobody else anything
ARENA_NAME_TRIES = 8


class InstanceError(RuntimeError):
    pass


class _Held(Exception):
    """The lock is held by a live process; ``holder`` is the pid it wrote (or "?")."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class Instance:
    def __init__(self, runtime_dir: str | Path) -> None:
        self.runtime_dir = Path(runtime_dir).absolute()
        digest = hashlib.sha256(str(self.runtime_dir).encode()).hexdigest()[:12]
        self.name = f"hetspec-{digest}"
        self._lock_fd: int | None = None
        self._socket_lock_fd: int | None = None

    def acquire(self) -> None:
        """Create the runtime directory (0750) or check an existing one is ours alone, take
        its lock, clean up after a dead instance. ``InstanceError`` says what is wrong."""
        self._prepare_runtime_dir()
        lock = self.runtime_dir / LOCK_NAME
        try:
            self._lock_fd = _take_lock(lock)
        except _Held as held:
            raise InstanceError(
                f"another hetspecd (pid {held.holder}) already uses {self.runtime_dir}; give "
                "this one its own --runtime-dir and --socket"
            ) from None
        self.remove_leftovers()

    def _prepare_runtime_dir(self) -> None:
        path = self.runtime_dir
        missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
        try:
            for folder in reversed(missing):  # modes set explicitly: never the umask's
                with contextlib.suppress(FileExistsError):  # made meanwhile: checked below
                    os.mkdir(folder, 0o700)
                    os.chmod(folder, RUNTIME_DIR_MODE if folder == path else 0o755)
            link, info = os.lstat(path), os.stat(path)
        except OSError as error:
            raise InstanceError(f"cannot use runtime directory {path}: {error.strerror}") from None
        me = os.geteuid()
        problem = None
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
            problem = f"is a symlink of another user (uid {link.st_uid})"
        elif not stat.S_ISDIR(info.st_mode):
            problem = "is not a directory"
        elif info.st_uid != me:
            problem = f"belongs to another user (uid {info.st_uid}, we are {me})"
        elif info.st_mode & 0o022:
            problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
        if problem is not None:
            raise InstanceError(
                f"refusing to run in runtime directory {path}: it {problem}; give hetspecd a "
                "directory of its own user that only it may write (e.g. mode 0750)"
            )

    def claim_socket(self, path: Path) -> None:
        """Make sure no other daemon serves on the socket at ``path`` before it is replaced:
        take ``<socket>.lock`` (whatever runtime directory each daemon has, both lock the same
        file beside the socket) and refuse if something still listens there."""
        lock = path.with_name(f"{path.name}.lock")
        try:
            self._socket_lock_fd = _take_lock(lock)
        except _Held as held:
            raise InstanceError(f"another hetspecd (pid {held.holder}) serves {path}") from None
        if _listening(path):  # e.g. systemd's socket, or a daemon without this lock
            raise InstanceError(f"something already listens on {path}; refusing to replace it")

    def remove_leftovers(self) -> list[str]:
        """Segments and endpoints an earlier instance on this directory did not remove. Only
        our own regular files in /dev/shm are removed, and nothing left over stops us."""
        removed, kept = [], []
        me = os.geteuid()
        for path in SHM_DIR.glob(f"{self.name}-*"):
            try:
                info = os.lstat(path)
            except OSError:  # gone meanwhile
                continue
            if not stat.S_ISREG(info.st_mode) or info.st_uid != me:
                kept.append(str(path))  # another user's, or a planted directory or link
            elif _unlink(path):
                removed.append(str(path))
            else:
                kept.append(str(path))
        # the runtime directory is ours alone (checked in acquire): whatever is there is ours
        for path in [
            *self.runtime_dir.glob("*-commands.sock"),
            *self.runtime_dir.glob("*-replies.sock"),
        ]:
            (removed if _unlink(path) else kept).append(str(path))
        if removed:
            log.warning("removed leftovers of an earlier instance", paths=removed)
        if kept:
            log.warning("left alone: not our own regular files, or not removable", paths=kept)
        return removed

    def create_arena(self, slots: int, slot_bytes: int) -> Arena:
        """The arena, under a name nobody could have taken in advance (a random part; a taken
        name is retried)."""
        for _ in range(ARENA_NAME_TRIES):
            name = f"{self.name}-{os.getpid()}-{secrets.token_hex(4)}-arena"
            with contextlib.suppress(ArenaExistsError):
                return Arena.create(SHM_DIR / name, slots, slot_bytes)
        raise ArenaError(f"cannot create the arena: {ARENA_NAME_TRIES} names in {SHM_DIR} taken")

    def release(self) -> None:
        for fd in (self._socket_lock_fd, self._lock_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                os.close(fd)
        self._lock_fd = self._socket_lock_fd = None


def _take_lock(path: Path) -> int:
    """Lock ``path`` (created 0600; never through a symlink, only a regular file of ours) and
    write our pid into it; the returned fd holds the lock. ``_Held`` when a live process holds
    it, ``InstanceError`` when the file cannot be used."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as error:
        why = "it is a symbolic link" if error.errno == errno.ELOOP else error.strerror
        raise InstanceError(f"cannot use the lock file {path}: {why}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise InstanceError(f"cannot use the lock file {path}: not a regular file of our user")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise _Held(holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at ``path`` (non-blocking: a
    full backlog counts as listening)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(str(path))
    except BlockingIOError:
        return True
    except OSError:  # not there, nobody listening, not a socket: a stale file at most
        return False
    finally:
        probe.close()
    return True


def _unlink(path: Path) -> bool:
    """Remove ``path``; False (never an exception) when it cannot be."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
