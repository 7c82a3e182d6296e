"""hetspecd under systemd, with this test playing systemd: sd_notify on a real datagram
socket (READY, STATUS, the watchdog, STOPPING) and socket activation with a real passed fd."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from test_daemon import CONTEXT, Daemon, native, request
from tiny_models import write_tiny_gguf_llama

pytestmark = pytest.mark.process

WATCHDOG_USEC = 400_000  # pings every 0.2 s


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {
        "target": write_tiny_gguf_llama(root / "target", seed=0, layers=2, context=CONTEXT),
        "draft": write_tiny_gguf_llama(root / "draft", seed=1, layers=1, context=CONTEXT),
    }


class FakeSystemd:
    """Receives sd_notify datagrams on a socket, with when each arrived."""

    def __init__(self, path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def wait_for(self, line: str, timeout_s: float = 120) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, seen in list(self.messages):
                if seen == line:
                    return at
            time.sleep(0.05)
        raise AssertionError(f"no {line!r} within {timeout_s} s: {self.lines()}")

    def pings(self, start: float, end: float) -> int:
        return sum(1 for at, line in self.messages if line == "WATCHDOG=1" and start <= at < end)

    def lines(self) -> list[str]:
        return [line for _, line in self.messages]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_notify_ready_watchdog_tied_to_worker_heartbeats_and_stopping(tmp_path, models) -> None:
    systemd = FakeSystemd(tmp_path / "notify.sock")
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    daemon = Daemon(
        tmp_path / "d",
        models["target"],
        models["draft"],
        "--set",
        "heartbeat_s=0.2",
        "--set",
        "heartbeat_timeout_s=4",
        env=env,
    )
    try:
        ready_at = systemd.wait_for("READY=1")
        assert "STATUS=loading the models" in systemd.lines()[: systemd.lines().index("READY=1")]
        assert f"MAINPID={daemon.process.pid}" in systemd.lines()
        assert request(daemon.socket, "GET", "/health")[0] == 200  # ready means serving
        time.sleep(1.2)
        assert systemd.pings(ready_at, ready_at + 1.2) >= 4

        gpu = daemon.health()["workers"]["gpu"]["pid"]
        os.kill(gpu, signal.SIGSTOP)  # the worker hangs: its heartbeats stop
        hung_at = time.monotonic()
        time.sleep(3)
        # stale after three 0.2 s beats; no ping from then until the supervisor kills it (4 s)
        assert systemd.pings(hung_at + 1.0, hung_at + 3) == 0, systemd.lines()[-20:]
        deadline = time.monotonic() + 60  # killed, restarted, beating again: pings resume
        while (
            systemd.pings(hung_at + 4, time.monotonic()) < 3
            or daemon.health()["workers"]["gpu"]["restarts"] != 1
        ):
            assert time.monotonic() < deadline, "no restart, or the pings did not resume"
            time.sleep(0.2)

        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(timeout=60) == 0
        systemd.wait_for("STOPPING=1", timeout_s=5)
    finally:
        daemon.stop()
        systemd.close()


def test_socket_activation_serves_on_the_passed_socket(tmp_path, models) -> None:
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    # systemd's part: the socket as fd 3, LISTEN_PID naming the process that execs hetspecd
    launcher = [
        sys.executable,
        "-c",
        "import os, sys; os.dup2(int(sys.argv[1]), 3); "
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', "
        "LISTEN_FDNAMES='hetspecd.socket'); os.execv(sys.argv[2], sys.argv[2:])",
        str(listener.fileno()),
    ]
    daemon = Daemon(
        tmp_path / "d",
        models["target"],
        models["draft"],
        launcher=launcher,
        pass_fds=(listener.fileno(),),
    )
    listener.close()  # the daemon holds it now
    try:
        daemon.socket = path  # where clients connect: the activated socket
        health = daemon.wait_ready()
        assert health["status"] == "ready"
        assert not (tmp_path / "d" / "hetspecd.sock").exists()  # it did not bind its own
        status, body = request(path, "POST", "/api/generate", native("def f(x):", max_tokens=4))
        assert status == 200, body
        assert len(body["tokens"]) <= 4
        workers = [w["pid"] for w in health["workers"].values()]
        for pid in workers:  # the workers did not inherit the activation variables
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not any(item.startswith(b"LISTEN_") for item in environ)
    finally:
        assert daemon.stop() == 0
    assert path.exists()  # systemd's socket file is systemd's to remove


@pytest.fixture(autouse=True)
def _no_inherited_notify(monkeypatch) -> None:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
        monkeypatch.delenv(name, raising=False)
