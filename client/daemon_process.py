"""A ``hetspecd`` this process starts, waits for and stops: the one launcher behind ``hetspec
bench`` and the test suite's daemons."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hetspec.client.clients import Client
from hetspec.client.types import DaemonUnreachable, HetspecError


class DaemonProcess:
    """``hetspecd *args`` serving ``folder/hetspecd.sock`` from the runtime directory
    ``folder/run``, its stdout and stderr in ``log`` (default ``folder/hetspecd.log``).
    ``env``: its whole environment (None: this process's); ``launcher``: a command prefix to run
    it under (a umask, a limit); ``pass_fds``: descriptors it inherits."""

    def __init__(
        self,
        folder: Path,
        *args: str,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        launcher: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.socket = folder / "hetspecd.sock"
        self.runtime_dir = folder / "run"
        self.log = log or folder / "hetspecd.log"
        argv = [
            *launcher,
            sys.executable,
            "-m",
            "hetspec.daemon",
            "--socket",
            str(self.socket),
            "--runtime-dir",
            str(self.runtime_dir),
            *args,
        ]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=out, env=env, pass_fds=tuple(pass_fds)
            )

    def log_end(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float) -> dict:
        """Its /health once ready; ``HetspecError``, with the end of its log, if it exits or
        drains first or is not ready within ``timeout_s`` (a daemon that measures its
        runtimes at its first start takes minutes)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        # socket: where clients connect (reassigned where systemd passed one)
        with Client(f"unix://{self.socket}") as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    last = f"it exited with {self.process.returncode}"
                    break
                try:
                    health = client.health()
                except DaemonUnreachable:
                    pass  # not listening yet
                else:
                    if health["status"] == "ready":
                        return health
                    last = f"status {health['status']}"
                    if health["status"] != "loading":  # draining: it will never be ready
                        break
                time.sleep(0.1)
            else:
                last += f" after {timeout_s:g} s"
        raise HetspecError(
            f"hetspecd did not become ready ({last}); its log ends:\n{self.log_end()}"
        )

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (it drains), then its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)
