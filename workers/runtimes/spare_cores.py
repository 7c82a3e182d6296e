"""Computing on the other worker's cores while it idles.

Without CUDA both workers compute on the CPU and the daemon splits the cores between them, so
the target computing while the drafter has nothing to do (the target alone: autoregressive
mode and rounds where drafting does not pay; a plain round's verification) would leave the
drafter's half of the box idle: on a 2-core box llama.cpp decodes the demo target 2x faster
with both cores than with one. The daemon
knows when the drafter has nothing in flight and says so in the command; the worker then
raises its runtime's thread count by one per spare core, and lowers it again for the next
command that does not say so.

Every runtime computes on an OpenMP thread pool (libgomp: llama.cpp's, torch's, ours), and
OpenMP places each thread of a team itself: the worker lists its own cores first and the
spare ones after them (``openmp_places``), so a team as large as its own cores stays on them
and only the extra threads of a wide call run on the spare cores, each on one core for good.
Moving the threads between cores at every call instead (what this module did first) cost a
migration per call (docs/design-notes.md, "Spare cores").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# How long OpenMP's threads spin for the next parallel step before they sleep, for a worker
# with spare cores (libgomp's default, 300k pauses, is milliseconds: after a call on the
# spare cores its threads kept spinning there while the drafter drafted; docs/design-notes.md,
# "Spare cores")
SPARE_CORES_SPIN_COUNT = "20000"


def openmp_places(own: Iterable[int], spare: Iterable[int]) -> dict[str, str]:
    """The OpenMP environment that binds a team's threads one per core, the own cores first
    (the master on the first), then the spare ones; set before any runtime loads."""
    own = sorted(set(own))
    cores = own + sorted(set(spare) - set(own))
    return {"OMP_PLACES": ",".join(f"{{{core}}}" for core in cores), "OMP_PROC_BIND": "close"}


class SpareCores:
    """Switches a worker between its own cores (its configured threads) and its own plus the
    spare ones (one more thread per spare core); OpenMP's places say where each runs."""

    def __init__(self, own: Iterable[int], spare: Iterable[int]) -> None:
        self.spare = frozenset(spare) - frozenset(own)
        self.wide = False

    def use(self, wide: bool, set_extra_threads: Callable[[int], None]) -> None:
        """Compute on the spare cores too (``wide``) or on the worker's own only;
        ``set_extra_threads`` gives the runtime that many threads beyond its configured ones.
        Nothing happens when there are no spare cores or nothing changes."""
        wide = wide and bool(self.spare)
        if wide == self.wide:
            return
        set_extra_threads(len(self.spare) if wide else 0)
        self.wide = wide
