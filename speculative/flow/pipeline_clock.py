"""A pipeline's timeline as if every stage had a device of its own: what a run on one shared
box would have taken on as many hosts as stages.

A run records its events (the coordinator's work, each segment sent, each segment back with
every stage's measured compute time and rows); ``timeline`` replays them. Stages are servers
taking segments in the order sent (each stage is first in, first out); every hop
(coordinator to stage, stage to stage, last stage to coordinator) adds ``link_s``. A segment
costs each stage what a ``CostProfile`` says for the rows it computed there (compute times
measured while that stage ran by itself), or else the time measured in the run itself (inflated
where stages shared cores). Pure arithmetic: the decisions (what was sent when, what was
pruned) are the real run's.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field


class CostProfile:
    """Each stage's compute seconds by rows computed, from samples; other widths are
    interpolated linearly between the nearest two measured (extrapolated beyond them)."""

    def __init__(self) -> None:
        self.samples: dict[tuple[int, int], list[float]] = {}

    def add(self, stage: int, width: int, seconds: float) -> None:
        if width > 0:
            self.samples.setdefault((stage, width), []).append(seconds)

    def cost(self, stage: int, width: int) -> float:
        if width == 0:
            return 0.0
        known = sorted(
            (w, statistics.median(v)) for (s, w), v in self.samples.items() if s == stage
        )
        if not known:
            raise KeyError(f"no compute time measured for stage {stage}")
        widths = [w for w, _ in known]
        if len(known) == 1:
            return known[0][1] * width / widths[0]
        index = min(max(bisect.bisect_left(widths, width), 1), len(known) - 1)
        (w0, c0), (w1, c1) = known[index - 1], known[index]
        return max(c0 + (c1 - c0) * (width - w0) / (w1 - w0), 0.0)


@dataclass
class PipelineClock:
    """The events of one run (``spend``, ``sent``, ``returned``), for ``timeline``."""

    events: list[tuple] = field(default_factory=list)

    def spend(self, seconds: float) -> None:
        """The coordinator worked (drafted) for ``seconds``."""
        self.events.append(("spend", seconds))

    def sent(self) -> None:
        self.events.append(("sent",))

    def returned(self, costs_ms: list[float], widths: list[int]) -> None:
        """The oldest segment in flight came back; each stage computed ``widths`` rows of it
        in ``costs_ms``."""
        self.events.append(("returned", list(costs_ms), list(widths)))

    def measured(self, profile: CostProfile) -> None:
        """Add this run's compute times to ``profile``."""
        for event in self.events:
            if event[0] == "returned":
                for stage, (cost_ms, width) in enumerate(zip(event[1], event[2], strict=True)):
                    profile.add(stage, width, cost_ms / 1000)

    def timeline(
        self, stages: int, link_s: float, profile: CostProfile | None = None
    ) -> tuple[float, list[float]]:
        """(seconds the run would take, each stage's busy share) with a device per stage."""
        now, free_at, busy = 0.0, [0.0] * stages, [0.0] * stages
        sent: deque[float] = deque()
        for event in self.events:
            if event[0] == "spend":
                now += event[1]
            elif event[0] == "sent":
                sent.append(now)
            else:
                arrival = sent.popleft() + link_s
                for stage, (cost_ms, width) in enumerate(zip(event[1], event[2], strict=True)):
                    cost = cost_ms / 1000 if profile is None else profile.cost(stage, width)
                    start = max(arrival, free_at[stage])
                    free_at[stage] = start + cost
                    busy[stage] += cost
                    arrival = free_at[stage] + link_s
                now = max(now, arrival)
        return now, [b / now if now else 0.0 for b in busy]
