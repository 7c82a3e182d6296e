"""Issue 18, part A: what another local user can plant in /dev/shm, the runtime directory and
beside the socket, a second daemon on a live daemon's socket, a /dev/shm too small for the
arena, and a Load naming a file that is not our shared-memory arena. Real daemons, real
workers and real files; what needs root (files of another user) skips without it."""

from __future__ import annotations

import os
import pwd
import socket
import stat
from pathlib import Path

import pytest
from test_daemon import CONTEXT, STARTUP_TIMEOUT, Daemon, request, segments
from test_worker_process import LOAD_TIMEOUT, spec
from tiny_models import write_tiny_gguf_llama, write_tiny_pair

from hetspec.daemon.config import DaemonConfig
from hetspec.daemon.instance import Instance
from hetspec.daemon.service import RUN_SLOTS
from hetspec.daemon.supervision.supervisor import config_number_of
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerStartError
from hetspec.protocol.arena import SHM_DIR, Arena, ArenaError, ArenaLayout

pytestmark = pytest.mark.process

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="planting another user's files needs root")
UMASK_000 = ["sh", "-c", 'umask 000 && exec "$@"', "sh"]


def other_user() -> tuple[int, int]:
    """A user that is not us: nobody, which every Linux box has."""
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("models"), CONTEXT)


def refused(daemon: Daemon) -> str:
    """The log of a daemon that had to exit 1 before serving, checked to be one clear line."""
    assert daemon.process.wait(timeout=STARTUP_TIMEOUT) == 1, daemon.log.read_text()
    log = daemon.log.read_text()
    assert "Traceback" not in log, log
    return log


# ------------------------------------------------------------ 1: leftovers in /dev/shm


def test_entries_others_planted_in_dev_shm_neither_stop_the_daemon_nor_are_removed(
    tmp_path, models
) -> None:
    runtime_dir = tmp_path / "run"
    name = Instance(runtime_dir).name
    planted = [SHM_DIR / f"{name}-x"]
    planted[0].mkdir()  # made a root daemon exit 1: "Is a directory"
    if ROOT:  # another user's file: an unprivileged daemon exited 1, a root one removed it
        planted.append(SHM_DIR / f"{name}-theirs")
        planted[1].write_bytes(b"not yours")
        os.chown(planted[1], *other_user())
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    # the arena name the daemon used to pick (its pid), taken before it gets there
    planted.append(SHM_DIR / f"{name}-{daemon.process.pid}-arena")
    planted[-1].mkdir(exist_ok=True)
    try:
        daemon.wait_ready()
        assert all(path.exists() for path in planted)
        assert "left alone" in daemon.log.read_text()
        (arena,) = [path for path in segments(runtime_dir) if path not in planted]
        info = arena.stat()
        assert info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_blocks * 512 >= info.st_size  # allocated, not sparse (item 6)
        assert daemon.stop() == 0
        assert not arena.exists()
    finally:
        daemon.stop()
        for path in planted:
            path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)


# ------------------------------------------------------------ 4: one daemon per socket


def test_a_second_daemon_with_another_runtime_dir_leaves_a_live_daemons_socket_alone(
    tmp_path, models
) -> None:
    first = Daemon(tmp_path / "first", models["target"], models["draft"])
    try:
        first.wait_ready()
        second = Daemon(
            tmp_path / "second", models["target"], models["draft"], "--socket", str(first.socket)
        )
        log = refused(second)
        assert f"another hetspecd (pid {first.process.pid}) serves {first.socket}" in log
        assert request(first.socket, "GET", "/health")[0] == 200  # still reachable
    finally:
        assert first.stop() == 0
    assert not first.socket.exists()
    # the lock stays (unlinking it would race a daemon opening it), its pid cleared
    assert first.socket.with_name("hetspecd.sock.lock").read_text() == ""


def test_a_socket_another_process_listens_on_is_not_replaced(tmp_path, models) -> None:
    path = tmp_path / "taken.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    try:
        daemon = Daemon(tmp_path, models["target"], models["draft"], "--socket", str(path))
        assert f"something already listens on {path}" in refused(daemon)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))  # still the listener's socket
        client.close()
    finally:
        listener.close()


# ------------------------------------------------------------ 5: the runtime directory


@needs_root
def test_a_runtime_dir_of_another_user_is_refused_and_its_lock_link_not_followed(
    tmp_path, models
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    runtime_dir = tmp_path / "theirs"
    runtime_dir.mkdir(mode=0o700)
    (runtime_dir / "hetspecd.lock").symlink_to(victim)
    uid, gid = other_user()
    os.lchown(runtime_dir / "hetspecd.lock", uid, gid)
    os.chown(runtime_dir, uid, gid)
    daemon = Daemon(tmp_path, models["target"], models["draft"], "--runtime-dir", str(runtime_dir))
    log = refused(daemon)
    assert f"refusing to run in runtime directory {runtime_dir}" in log
    assert f"belongs to another user (uid {uid}" in log
    assert victim.read_text() == "precious\n"


def test_a_lock_that_is_a_symlink_is_not_followed(tmp_path, models) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    (runtime_dir / "hetspecd.lock").symlink_to(victim)
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    log = refused(daemon)
    assert f"cannot use the lock file {runtime_dir / 'hetspecd.lock'}: it is a symbolic" in log
    assert victim.read_text() == "precious\n"


def test_a_runtime_dir_others_may_write_is_refused(tmp_path, models) -> None:
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir()
    runtime_dir.chmod(0o770)
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    assert "it is writable by group or others (mode 0770)" in refused(daemon)
    assert not (runtime_dir / "hetspecd.lock").exists()


def test_a_missing_runtime_dir_is_made_0750_and_its_parents_0755_whatever_the_umask(
    tmp_path, models
) -> None:
    runtime_dir = tmp_path / "a" / "b" / "run"
    daemon = Daemon(
        tmp_path,
        models["target"],
        models["draft"],
        "--runtime-dir",
        str(runtime_dir),
        launcher=UMASK_000,
    )
    try:
        daemon.wait_ready()
        modes = [stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a", runtime_dir.parent)]
        assert modes == [0o755, 0o755]
        assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o750
        assert stat.S_IMODE((runtime_dir / "hetspecd.lock").stat().st_mode) == 0o600
    finally:
        assert daemon.stop() == 0


# ------------------------------------------------------------ 6: the arena's pages


def test_a_dev_shm_too_small_for_the_arena_is_one_clear_line(tmp_path, models) -> None:
    vocab = max(config_number_of(str(models[name].parent)) for name in ("target", "draft"))
    slot_bytes = 64 * vocab * 4  # max_tree_nodes x vocabulary x float32
    info = os.statvfs(SHM_DIR)
    free = info.f_bavail * info.f_frsize
    slots = (free + (1 << 30)) // slot_bytes  # a GiB more than /dev/shm has free
    daemon = Daemon(tmp_path, models["target"], models["draft"], "--set", f"arena_slots={slots}")
    log = refused(daemon)
    # arena_slots for one request, and a request's slots for each further one at once
    slots += RUN_SLOTS * (DaemonConfig().max_parallel - 1)
    assert f"the shared-memory arena needs {slots * slot_bytes / 2**20:.1f} MiB but " in log
    assert "/dev/shm has " in log
    assert not segments(daemon.runtime_dir)


# ------------------------------------------------------------ 12: what a worker maps


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf_llama(tmp_path_factory.mktemp("tiny"))


async def test_a_worker_maps_no_file_outside_dev_shm_as_its_arena(gguf, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"\xaa" * 4 * 1024)
    client = WorkerClient(
        spec(gguf, "llama.cpp"), tmp_path, generation=1, arena=ArenaLayout(str(victim), 4, 1024)
    )
    with pytest.raises(WorkerStartError, match=r"must be a shared-memory object in /dev/shm"):
        await client.start(LOAD_TIMEOUT)
    assert victim.read_bytes() == b"\xaa" * 4 * 1024


async def test_a_worker_maps_no_symlink_in_dev_shm_as_its_arena(gguf, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"\xaa" * 4 * 1024)
    link = SHM_DIR / f"hetspec-test-{os.getpid()}-link"
    link.symlink_to(victim)
    try:
        client = WorkerClient(
            spec(gguf, "llama.cpp"), tmp_path, generation=1, arena=ArenaLayout(str(link), 4, 1024)
        )
        with pytest.raises(WorkerStartError, match=r"is a symbolic link; refusing it"):
            await client.start(LOAD_TIMEOUT)
    finally:
        link.unlink()
    assert victim.read_bytes() == b"\xaa" * 4 * 1024


def test_attach_maps_only_a_regular_file_of_ours_of_the_expected_size(tmp_path) -> None:
    path = SHM_DIR / f"hetspec-test-{os.getpid()}-attach"
    try:
        with Arena.create(path, slots=4, slot_bytes=1024) as arena:
            with pytest.raises(ArenaError, match=r"has 4096 bytes, expected 8192"):
                Arena.attach(ArenaLayout(str(path), 8, 1024))
            Arena.attach(arena.layout).close()
            if ROOT:
                os.chown(path, *other_user())
                with pytest.raises(ArenaError, match=r"belongs to uid \d+, not to this"):
                    Arena.attach(arena.layout)
        fifo = SHM_DIR / f"hetspec-test-{os.getpid()}-fifo"
        os.mkfifo(fifo, 0o600)
        try:  # never blocks opening it
            with pytest.raises(ArenaError, match=r"is not a regular file"):
                Arena.attach(ArenaLayout(str(fifo), 4, 1024))
        finally:
            fifo.unlink()
    finally:
        path.unlink(missing_ok=True)
