"""Whether the box is busy before a benchmark starts: what else runs on the cores it will use.

A benchmark on a box where another process computes measures that process too. ``busy_note``
samples the kernel's per-core counters (``/proc/stat``) and every process's CPU time
(``/proc/PID/stat``) over a short interval and names the cores that were busy and the
processes that kept them so, so the figures' reader knows (the bench warns, it does not
refuse: a shared box may be all there is).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

BUSY_SHARE = 0.2  # a core busier than this over the sample is worth a warning
PROC = Path("/proc")


def _core_times() -> dict[int, tuple[int, int]]:
    """{core: (busy ticks, all ticks)} since boot."""
    times = {}
    for line in (PROC / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(field) for field in fields]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def _process_ticks(skip: set[int]) -> dict[int, tuple[str, int]]:
    """{pid: (command name, user + system ticks)} of every readable process not in ``skip``."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile, or is not ours to read
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        found[int(entry.name)] = (name, int(fields[11]) + int(fields[12]))
    return found


def busy_note(cores: set[int] | None = None, sample_s: float = 0.5) -> str | None:
    """One line naming the ``cores`` (default: those this process may use) that were busier
    than BUSY_SHARE over ``sample_s`` seconds, and the processes that used the most CPU
    meanwhile; None where the box looks idle or the counters cannot be read (not Linux)."""
    cores = cores if cores is not None else os.sched_getaffinity(0)
    try:
        ours = {os.getpid()}
        before, processes = _core_times(), _process_ticks(ours)
        time.sleep(sample_s)
        after, later = _core_times(), _process_ticks(ours)
    except (OSError, ValueError, IndexError):
        return None
    busy = {}
    for core in sorted(cores & before.keys() & after.keys()):
        used, total = (a - b for a, b in zip(after[core], before[core], strict=True))
        if total > 0 and used / total > BUSY_SHARE:
            busy[core] = used / total
    if not busy:
        return None
    tick_s = os.sysconf("SC_CLK_TCK") * sample_s
    shares = sorted(
        ((ticks - processes[pid][1]) / tick_s, name, pid)
        for pid, (name, ticks) in later.items()
        if pid in processes
    )
    top = [
        f"{name} (pid {pid}) {share:.0%}"
        for share, name, pid in reversed(shares[-3:])
        if share >= 0.05
    ]
    where = ", ".join(f"core {core} {share:.0%}" for core, share in busy.items())
    who = f"; busiest: {', '.join(top)}" if top else ""
    return (
        f"the box is busy before the benchmark ({where} over {sample_s:g} s{who}): "
        f"every figure will be lower and noisier"
    )
