"""Computing on the other worker's cores while it idles.

Without CUDA both workers compute on the CPU and the daemon splits the cores between them, so
the target decoding alone (autoregressive mode, rounds where drafting does not pay, the
verification of a plain round) would leave the drafter's half of the box idle: on a 2-core
box llama.cpp decodes the demo target 2x faster with both cores than with one. The daemon
knows when the drafter has nothing in flight and says so in the command; the worker then
widens every one of its threads' affinity to its own and the spare cores and raises its
thread count, and narrows both again for the next command that does not say so.

Every thread is moved, not only the computing one: the runtimes' thread pools (OpenMP) keep
the affinity their threads were created with, and a pool thread left on a spare core would
compete with the drafter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable


def process_threads() -> list[int]:
    """The ids of this process's threads (Linux)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: the calling thread only


def pin_threads(cores: set[int] | frozenset[int]) -> None:
    """Let every thread of this process run on ``cores`` only."""
    for thread in process_threads():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(thread, cores)


class SpareCores:
    """Switches a worker between its own cores (its configured threads) and its own plus the
    spare ones (one more thread per spare core)."""

    def __init__(self, own: Iterable[int], spare: Iterable[int]) -> None:
        self.own = frozenset(own)
        self.spare = frozenset(spare) - self.own
        self.wide = False

    def use(self, wide: bool, set_extra_threads: Callable[[int], None]) -> None:
        """Compute on the spare cores too (``wide``) or on the worker's own only;
        ``set_extra_threads`` gives the runtime that many threads beyond its configured ones.
        Nothing happens when there are no spare cores or nothing changes."""
        wide = wide and bool(self.spare)
        if wide == self.wide:
            return
        pin_threads(self.own | self.spare if wide else self.own)
        set_extra_threads(len(self.spare) if wide else 0)
        self.wide = wide
