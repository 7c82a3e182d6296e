"""The worker's side of liveness: heartbeats to the daemon, and death with the daemon.

Contract: ``die_with_parent`` asks Linux to SIGKILL this process when the daemon dies (or
exits at once if it already has); the ``Watchdog`` thread sends a ``Heartbeat`` every
``--heartbeat`` seconds on a socket of its own (no socket is shared between threads), saying
which request the compute thread runs (``busy``, written by that thread), and exits the
process when the death pipe reaches EOF. Neither depends on compute: torch and llama.cpp
release the GIL while they compute, so heartbeats flow during long work.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import threading
import time

import zmq

from hetspec.protocol import Codec
from hetspec.protocol import worker_messages as m

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL us when the daemon dies (a second guard besides the death pipe)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the death pipe alone guards
    if os.getppid() != parent:  # the daemon died before prctl took effect
        os._exit(1)


class Watchdog(threading.Thread):
    """Sends heartbeats and exits the process when the daemon dies, whatever compute is doing."""

    def __init__(self, context: zmq.Context, args: argparse.Namespace) -> None:
        super().__init__(name="worker-watchdog", daemon=True)
        self.beats = context.socket(zmq.PUSH)
        self.beats.setsockopt(zmq.LINGER, 0)
        self.beats.connect(args.replies)
        self.codec = Codec(m.Command)
        self.death_fd = args.death_fd
        self.interval = args.heartbeat
        self.busy: int | None = None  # written by the compute thread, read here

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.death_fd, zmq.POLLIN)
        while True:
            beat = m.Heartbeat(sent=time.monotonic(), busy=self.busy)
            self.beats.send(self.codec.encode(beat)[0])
            if poller.poll(timeout=int(self.interval * 1000)):
                os._exit(3)  # EOF on the death pipe: the daemon is gone, and so is our purpose
