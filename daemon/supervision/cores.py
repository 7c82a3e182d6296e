"""Which CPU cores each worker owns.

llama.cpp's speed collapses when its threads outnumber the cores they run on (they spin and
wait on each other: docs/design-notes.md, "Cores"), so each worker gets its own cores and
never more threads than it owns. With CUDA the GPU worker mostly launches kernels and needs
one core; llama.cpp takes the rest. Without CUDA both compute on the CPU and split the box in
half.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class CoreError(ValueError):
    pass


def cuda_present(device: str) -> bool:
    """Whether the GPU worker will compute on CUDA, judged without importing torch."""
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    return Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()


def split_cores(owned: Sequence[int], cuda: bool) -> tuple[list[int], list[int]]:
    """(the CPU worker's cores, the GPU worker's cores) out of the daemon's own."""
    cores = sorted(owned)
    if len(cores) == 1:
        return cores, cores  # nothing to split: both share the one core
    if cuda:
        return cores[1:], cores[:1]
    half = len(cores) // 2
    return cores[half:], cores[:half]


def daemon_cores(owned: set[int], drafter_cores: Sequence[int], cuda: bool) -> set[int] | None:
    """The cores the daemon's event loop keeps to, or None to leave it where the scheduler
    puts it. Where both workers compute on the CPU, the daemon works (the next round's plan,
    a round's bookkeeping, streaming) while the drafter drafts and the verifier idles: on the
    drafter's cores that work delays the draft's start, or stalls a thread the others wait
    on, so it keeps to the cores the drafter does not own. With CUDA the only such core is
    the GPU worker's, which polls between calls: there the scheduler chooses."""
    free = set(owned) - set(drafter_cores)
    return free if free and not cuda else None


def check_cores(name: str, cores: Sequence[int], threads: int | None, owned: set[int]) -> None:
    """Refuse cores the daemon does not own, and more threads than cores."""
    if not cores:
        raise CoreError(f"{name}.cores is empty")
    foreign = sorted(set(cores) - owned)
    if foreign:
        raise CoreError(
            f"{name}.cores {foreign} are not among the cores this daemon may use {sorted(owned)}"
        )
    if threads is not None and threads > len(set(cores)):
        raise CoreError(
            f"{name}.threads = {threads} exceeds its {len(set(cores))} cores; "
            "more threads than cores only slows the worker down"
        )


def owned_cores() -> set[int]:
    return os.sched_getaffinity(0)
