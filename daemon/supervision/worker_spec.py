"""What a worker is (``WorkerSpec``), and the command line that starts one.

Contract: a ``WorkerSpec`` is everything the daemon decides about a worker before it starts:
its name, runtime, model and settings, its cores and the other worker's it may borrow, its
heartbeat and call timeouts, and how its link works (mailboxes, the daemon's reply polling).
``worker_argv`` turns one incarnation of it into the command line of ``python -m
hetspec.workers.process``, whose ``parse_args`` reads exactly these options: the two sides of
that command line change together.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from hetspec.protocol import worker_messages as m


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # "cpu" or "gpu": how logs and errors name it
    runtime: str  # "llama.cpp" or "torch"
    model: str
    settings: m.RuntimeSettings
    cores: tuple[int, ...] = ()
    # the other worker's cores, computed on too when a command says that worker is idle
    spare_cores: tuple[int, ...] = ()
    heartbeat_s: float = 0.5  # the worker's beat interval
    heartbeat_timeout_s: float = 10.0  # silence after which the worker is killed
    call_timeout_s: float = 300.0  # a command taking longer means a wedged engine: kill it
    log_format: str = "json"
    spin_us: float = 100.0  # how long the worker polls for its next command before it sleeps
    # after a call is sent, how long the daemon reads the replies mailbox on every pass of its
    # event loop, which then never sleeps (0: it waits for the bell, a wake-up per reply)
    reply_spin_us: float = 0.0
    # commands and replies through shared-memory mailboxes (protocol/mailbox.py) where they
    # work (x86-64 Linux); False, or elsewhere: through the ZeroMQ sockets alone
    mailbox: bool = True
    # requests served at once: each its own sequence (cache, sampler, grammar) in the worker
    sequences: int = 1


def worker_argv(
    spec: WorkerSpec, commands: str, replies: str, death_read: int, mailbox_fds: list[int]
) -> list[str]:
    """The worker's interpreter command line: its endpoints, the read end of its death pipe,
    and the descriptors of its mailboxes where the link uses them (inherited; none: the
    ZeroMQ sockets alone)."""
    argv = [
        sys.executable,
        "-m",
        "hetspec.workers.process",
        "--runtime",
        spec.runtime,
        "--name",
        spec.name,
        "--commands",
        commands,
        "--replies",
        replies,
        "--death-fd",
        str(death_read),
        "--parent",
        str(os.getpid()),
        "--cores",
        ",".join(map(str, spec.cores)),
        "--spare-cores",
        ",".join(map(str, spec.spare_cores)),
        "--heartbeat",
        str(spec.heartbeat_s),
        "--log-format",
        spec.log_format,
        "--spin-us",
        str(spec.spin_us),
    ]
    if mailbox_fds:
        argv += ["--mailboxes", ",".join(map(str, mailbox_fds))]
    return argv
