"""``python -m hetspec.workers.process``: a worker process hosting one engine.

The daemon starts this as a fresh interpreter (never a fork: a process forked after llama.cpp
has decoded hangs, and forking after CUDA is unsafe) and talks to it over two ZeroMQ sockets
the daemon binds: commands (PUSH -> our PULL) and replies (our PUSH -> its PULL).

Two threads, so that liveness never depends on compute:
- the watchdog thread sends heartbeats (on its own socket: no socket is shared between
  threads) and exits the process when the daemon dies (the death pipe reaches EOF);
- the main thread receives commands (``CommandReader``: malformed ones are answered, ``Cancel``
  answers a queued command in its place), runs the engine one command at a time and sends
  each reply.
Torch and llama.cpp release the GIL while they compute, so heartbeats flow during long work.
Receiving on the compute thread instead of handing each command over from an I/O thread saves
a thread wake-up per command, which this project's round-trip budget cannot afford.

The parts, a module each: ``watchdog`` (heartbeats, and death with the daemon),
``command_reader`` (the commands, read on the compute thread), ``worker`` (the command loop and
its replies) with ``compute_handlers`` (what each command does to the engine and the arena),
and ``runtimes.loading`` (the cores first, then the engine). This module reads the command
line and wires them together.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import structlog
import zmq

from hetspec.logs import configure_logging
from hetspec.protocol import worker_messages as m
from hetspec.protocol.mailbox import Mailbox
from hetspec.workers.command_reader import CommandReader
from hetspec.workers.runtimes.loading import (
    RUNTIMES,
    LoadError,
    claim_cores,
    core_list,
    load_runtime,
)
from hetspec.workers.runtimes.spare_cores import SpareCores
from hetspec.workers.watchdog import Watchdog, die_with_parent
from hetspec.workers.worker import Worker

# imported from here by the tools, the benchmarks and the tests
__all__ = [
    "RUNTIMES",
    "CommandReader",
    "LoadError",
    "Watchdog",
    "Worker",
    "claim_cores",
    "core_list",
    "load_runtime",
    "main",
    "parse_args",
]

log = structlog.get_logger("hetspec.worker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hetspec.workers.process")
    parser.add_argument("--runtime", choices=RUNTIMES, required=True)
    parser.add_argument("--name", required=True, help="how logs name this worker")
    parser.add_argument("--commands", required=True, help="ZeroMQ endpoint the daemon pushes to")
    parser.add_argument("--replies", required=True, help="ZeroMQ endpoint the daemon pulls from")
    parser.add_argument("--death-fd", type=int, required=True, help="read end of the death pipe")
    parser.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    parser.add_argument("--cores", default="", help="comma-separated cores this worker owns")
    parser.add_argument(
        "--spare-cores",
        default="",
        help="comma-separated cores of the other worker, used too when a command says so",
    )
    parser.add_argument("--heartbeat", type=float, default=0.5, help="seconds between beats")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=100,
        help="how long to poll for the next command before sleeping",
    )
    parser.add_argument(
        "--mailboxes",
        default="",
        help="inherited descriptors COMMANDS_MEMORY,COMMANDS_BELL,REPLIES_MEMORY,REPLIES_BELL "
        "of the shared-memory mailboxes (protocol/mailbox.py); none: ZeroMQ alone",
    )
    parser.add_argument("--log-format", choices=["json", "console"], default="json")
    args = parser.parse_args(argv)
    fds = [int(fd) for fd in args.mailboxes.split(",") if fd]
    if len(fds) not in (0, 4):
        parser.error("--mailboxes takes four descriptors")
    args.mailboxes = fds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    die_with_parent(args.parent)
    claim_cores(args.runtime, core_list(args.cores), core_list(args.spare_cores))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    configure_logging(log_format=args.log_format, worker=args.name, pid=os.getpid())

    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 2000)
    replies.connect(args.replies)
    watchdog = Watchdog(context, args)
    cores = sorted(os.sched_getaffinity(0))
    spare = SpareCores(cores, core_list(args.spare_cores))
    inbox = outbox = None
    if args.mailboxes:
        inbox, outbox = Mailbox.attach(*args.mailboxes[:2]), Mailbox.attach(*args.mailboxes[2:])
    worker = Worker(args.runtime, replies, watchdog, spare, outbox)
    commands = CommandReader(context, args.commands, args.spin_us / 1e6, worker.send, inbox)
    hello = m.Hello(
        protocol=m.PROTOCOL_VERSION,
        pid=os.getpid(),
        runtime=args.runtime,
        cores=cores,
        spare_cores=sorted(spare.spare),
    )
    worker.send(hello)
    watchdog.start()
    log.info("worker started", runtime=args.runtime, cores=cores)
    worker.serve(commands)
    log.info("worker stopping")
    if worker.arena is not None:
        worker.arena.close()
    replies.close()  # lingers until the last replies are out
    sys.stderr.flush()
    os._exit(0)  # the watchdog's socket would make a normal exit wait on zmq_ctx_term


if __name__ == "__main__":
    sys.exit(main())
