"""systemd integration with the standard library: sd_notify messages, the watchdog, and
socket activation. Outside systemd (no NOTIFY_SOCKET, no LISTEN_FDS) all of it is inert."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger("hetspec.daemon.systemd")

FIRST_PASSED_FD = 3  # SD_LISTEN_FDS_START


class Notifier:
    """Sends sd_notify datagrams; a failed send is logged once, never raised (the daemon
    keeps serving if the manager goes away)."""

    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        if address and address.startswith("@"):  # the abstract namespace
            address = "\0" + address[1:]
        self.address = address
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec else None
        self._failed = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        watchdog = int(usec) if usec.isdigit() and (not pid or pid == str(os.getpid())) else None
        return cls(environ.get("NOTIFY_SOCKET") or None, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, message: str) -> None:
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(message.encode(), self.address)
        except OSError as error:
            if not self._failed:
                log.warning("cannot notify systemd", error=str(error), message=message)
            self._failed = True

    def ready(self, status: str = "") -> None:
        self.send(f"READY=1\nMAINPID={os.getpid()}" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=draining")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


async def watchdog_loop(notifier: Notifier, healthy: Callable[[], bool]) -> None:
    """Ping the watchdog at half its timeout, but only while ``healthy()``: a daemon whose
    workers stopped beating gets restarted by systemd instead of looking alive."""
    interval = notifier.watchdog_interval_s
    if interval is None or not notifier.enabled:
        return
    while True:
        if healthy():
            notifier.watchdog()
        await asyncio.sleep(interval)


def activated_sockets(environ: dict[str, str] | None = None) -> list[socket.socket]:
    """The listening sockets systemd passed (socket activation), or none. The variables are
    removed from our environment so that worker processes do not inherit them."""
    env = os.environ if environ is None else environ
    pid, count = env.get("LISTEN_PID", ""), env.get("LISTEN_FDS", "")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(name, None)
    if pid != str(os.getpid()) or not count.isdigit():
        return []
    sockets = []
    for fd in range(FIRST_PASSED_FD, FIRST_PASSED_FD + int(count)):
        flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        sockets.append(socket.socket(fileno=fd))
    return sockets
