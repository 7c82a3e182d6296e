"""The systemd side: the unit files (checked by systemd's own tools), sd_notify on real datagram
sockets, the watchdog loop, and socket activation with a real passed fd in a child process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from hetspec.daemon.config import DaemonConfig
from hetspec.daemon.systemd import Notifier, activated_sockets, watchdog_loop

UNITS = Path(__file__).resolve().parents[1] / "systemd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
MAX_EXPOSURE = 4.0  # systemd-analyze security: 0 is locked down, 10 is fully exposed


def unit_settings(path: Path) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit file, by key (keys may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@pytest.fixture
def units(tmp_path) -> Path:
    """The units in a folder of their own, ExecStart pointing at an executable that exists here
    (verify checks it): the venv's hetspecd, else this Python."""
    hetspecd = Path(sys.executable).with_name("hetspecd")
    executable = hetspecd if hetspecd.exists() else Path(sys.executable)
    folder = tmp_path / "units"
    folder.mkdir()
    service = (UNITS / "hetspecd.service").read_text()
    service, count = re.subn(
        r"(?m)^ExecStart=/usr/bin/hetspecd$", f"ExecStart={executable}", service
    )
    assert count == 1
    (folder / "hetspecd.service").write_text(service)
    shutil.copy(UNITS / "hetspecd.socket", folder)
    rpc = (UNITS / "hetspec-rpc-server.service").read_text()
    rpc, count = re.subn(
        r"(?m)^ExecStart=/usr/bin/hetspec-rpc-server ", f"ExecStart={executable} ", rpc
    )
    assert count == 1
    (folder / "hetspec-rpc-server.service").write_text(rpc)
    stage = (UNITS / "hetspec-stage.service").read_text()
    stage, count = re.subn(
        r"(?m)^ExecStart=/usr/bin/hetspec-stage ", f"ExecStart={executable} ", stage
    )
    assert count == 1
    (folder / "hetspec-stage.service").write_text(stage)
    return folder


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, "--no-pager", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.process
@needs_analyze
def test_units_verify_without_a_word(units) -> None:
    result = analyze(
        "verify",
        str(units / "hetspecd.service"),
        str(units / "hetspecd.socket"),
        str(units / "hetspec-rpc-server.service"),
        str(units / "hetspec-stage.service"),
    )
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.process
@needs_analyze
def test_verify_does_complain_here(units) -> None:
    """The check above means something: verify does report a bad unit in this environment."""
    broken = units / "hetspecd.service"
    broken.write_text(broken.read_text().replace("[Service]", "[Service]\nNoSuchSetting=1"))
    assert "NoSuchSetting" in analyze("verify", str(broken)).stderr


@pytest.mark.process
@needs_analyze
@pytest.mark.parametrize(
    "unit", ["hetspecd.service", "hetspec-rpc-server.service", "hetspec-stage.service"]
)
def test_service_exposure_is_low(units, unit) -> None:
    result = analyze("security", "--offline=true", str(units / unit))
    found = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    score = float(found[1])
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE}:\n{result.stdout}"


def test_hardening_leaves_the_gpu_and_cpu_information_reachable() -> None:
    service = unit_settings(UNITS / "hetspecd.service")
    # PrivateDevices hides /dev/nvidia*; ProcSubset=pid hides /proc/cpuinfo (llama.cpp, torch);
    # MemoryDenyWriteExecute breaks oneDNN's JIT and ctypes callbacks.
    for key in ("PrivateDevices", "ProcSubset", "MemoryDenyWriteExecute"):
        assert key not in service
    assert service["DeviceAllow"] == ["char-nvidia* rw"]
    assert (service["Type"], service["NotifyAccess"]) == (["notify"], ["main"])


def test_units_agree_with_the_daemon_defaults() -> None:
    config = DaemonConfig()
    socket_unit = unit_settings(UNITS / "hetspecd.socket")
    service = unit_settings(UNITS / "hetspecd.service")
    assert socket_unit["ListenStream"] == [config.socket]
    assert [f"/run/{name}" for name in service["RuntimeDirectory"]] == [config.runtime_dir]
    assert socket_unit["Service"] == ["hetspecd.service"]


@pytest.mark.process
@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="systemd-sysusers or systemd-tmpfiles is not installed",
)
def test_sysusers_and_tmpfiles_create_the_user_and_directories(tmp_path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    sysusers = subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(UNITS / "sysusers.d" / "hetspec.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert sysusers.returncode == 0, sysusers.stderr
    user = next(
        line.split(":")
        for line in (root / "etc" / "passwd").read_text().splitlines()
        if line.startswith("hetspec:")
    )
    assert user[6] == "/usr/sbin/nologin"
    assert "hetspec:" in (root / "etc" / "group").read_text()

    # tmpfiles resolves the names from the root's /etc/passwd and /etc/group, just written
    tmpfiles = subprocess.run(
        [
            "systemd-tmpfiles",
            f"--root={root}",
            "--create",
            str(UNITS / "tmpfiles.d" / "hetspec.conf"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    uid, gid = int(user[2]), int(user[3])
    run, etc = (root / "run" / "hetspec").stat(), (root / "etc" / "hetspec").stat()
    assert (run.st_mode & 0o7777, etc.st_mode & 0o7777) == (0o750, 0o750)
    if os.geteuid() == 0:
        assert tmpfiles.returncode == 0, tmpfiles.stderr
        assert (run.st_uid, run.st_gid, etc.st_uid, etc.st_gid) == (uid, gid, 0, gid)
    else:  # only root may give the directories away; everything else must have worked
        lines = tmpfiles.stderr.splitlines()
        assert lines, "expected chown failures when not root"
        assert all("Operation not permitted" in line for line in lines), tmpfiles.stderr


# ---------------------------------------------------------------- sd_notify


@pytest.fixture
def receiver(tmp_path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket playing systemd's notify socket, and its NOTIFY_SOCKET value."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2)
        yield sock, str(path)


def drain(sock: socket.socket) -> list[str]:
    """Every datagram waiting on ``sock``, without blocking."""
    messages = []
    sock.setblocking(False)
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        return messages
    finally:
        sock.settimeout(2)


def test_messages_arrive_exactly(receiver) -> None:
    sock, address = receiver
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.watchdog_interval_s is None
    notifier.status("loading the models")
    notifier.ready()
    notifier.ready("serving")
    notifier.watchdog()
    notifier.stopping()
    received = [sock.recv(4096).decode() for _ in range(5)]
    pid = os.getpid()
    assert received == [
        "STATUS=loading the models",
        f"READY=1\nMAINPID={pid}",
        f"READY=1\nMAINPID={pid}\nSTATUS=serving",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=draining",
    ]


def test_abstract_socket() -> None:
    name = f"hetspec-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        Notifier.from_environment({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096).decode() == f"READY=1\nMAINPID={os.getpid()}"


@pytest.mark.parametrize(
    ("watchdog_pid", "interval"),
    [(None, 0.1), ("own", 0.1), ("other", None), ("", 0.1)],
)
def test_watchdog_only_for_this_process(watchdog_pid, interval) -> None:
    environ = {"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "200000"}
    if watchdog_pid is not None:
        pids = {"own": str(os.getpid()), "other": str(os.getpid() + 1), "": ""}
        environ["WATCHDOG_PID"] = pids[watchdog_pid]
    assert Notifier.from_environment(environ).watchdog_interval_s == interval


def test_without_notify_socket_nothing_is_sent(monkeypatch) -> None:
    def no_socket(*args, **kwargs):
        raise AssertionError("a socket was opened")

    notifier = Notifier.from_environment({"WATCHDOG_USEC": "200000"})
    monkeypatch.setattr(socket, "socket", no_socket)
    assert not notifier.enabled
    notifier.ready()
    notifier.status("x")
    notifier.watchdog()
    notifier.stopping()


def test_a_vanished_manager_is_logged_once_and_never_raised(tmp_path) -> None:
    path = tmp_path / "gone"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
    path.unlink()
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": str(path)})
    with structlog.testing.capture_logs() as logs:
        notifier.ready()
        notifier.watchdog()
        notifier.stopping()
    assert [entry["event"] for entry in logs] == ["cannot notify systemd"]


async def test_watchdog_pings_only_while_healthy(receiver) -> None:
    sock, address = receiver
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"})
    healthy = True
    task = asyncio.create_task(watchdog_loop(notifier, lambda: healthy))
    try:
        await asyncio.sleep(0.55)  # pings every 0.1 s
        assert 3 <= len(pings := drain(sock)) <= 7
        assert set(pings) == {"WATCHDOG=1"}
        healthy = False
        drain(sock)  # the loop does not run between these lines: nothing healthy is in flight
        await asyncio.sleep(0.55)
        assert drain(sock) == []
        healthy = True
        await asyncio.sleep(0.55)
        assert len(drain(sock)) >= 3
    finally:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watchdog_loop_returns_without_a_watchdog(receiver) -> None:
    _, address = receiver
    for environ in ({"NOTIFY_SOCKET": address}, {"WATCHDOG_USEC": "200000"}):
        await asyncio.wait_for(watchdog_loop(Notifier.from_environment(environ), lambda: True), 1)


# ---------------------------------------------------------------- socket activation

# What systemd does: the listening socket as fd 3, LISTEN_PID naming the process that execs
# the service (exec keeps the pid).
LAUNCHER = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); "
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', "
    "LISTEN_FDNAMES='hetspecd.socket'); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
# The service: takes the passed socket, reports, and echoes one connection.
SERVICE = """
import fcntl, json, os, socket
from hetspec.daemon.systemd import activated_sockets
sockets = activated_sockets()
print(json.dumps({
    "count": len(sockets),
    "fd": sockets[0].fileno(),
    "unix_stream": [sockets[0].family, sockets[0].type] == [socket.AF_UNIX, socket.SOCK_STREAM],
    "cloexec": bool(fcntl.fcntl(3, fcntl.F_GETFD) & fcntl.FD_CLOEXEC),
    "left": sorted(name for name in os.environ if name.startswith("LISTEN_")),
}), flush=True)
connection, _ = sockets[0].accept()
with connection:
    connection.sendall(connection.recv(100).upper())
"""


@pytest.mark.process
def test_activated_socket_serves_in_a_child(tmp_path) -> None:
    path = tmp_path / "activated.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        child = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(listener.fileno()), "-c", SERVICE],
            pass_fds=(listener.fileno(),),
            stdout=subprocess.PIPE,
            text=True,
        )
    try:
        assert child.stdout is not None
        report = json.loads(child.stdout.readline())
        assert report == {"count": 1, "fd": 3, "unix_stream": True, "cloexec": True, "left": []}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(str(path))
            client.sendall(b"hello")
            assert client.recv(100) == b"HELLO"
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("listen_pid", ["1", "", "x"])
def test_not_activated_when_the_variables_are_for_another_process(listen_pid) -> None:
    environ = {"LISTEN_PID": listen_pid, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "a", "PATH": "/"}
    assert activated_sockets(environ) == []
    assert environ == {"PATH": "/"}  # removed anyway: worker processes must not see them


def test_not_activated_without_variables() -> None:
    assert activated_sockets({}) == []
