"""The controller's trackers of single quantities, each fed by round reports: a windowed
median (costs), a decayed rate (acceptance), and what drafted rounds delivered against
their prediction. ``estimates.Estimates`` holds one per quantity it measures.
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np


class WindowedMedian:
    """The median of the last ``window`` samples, ignoring those older than ``max_age``
    ticks of ``clock``."""

    def __init__(
        self, window: int, clock=None, max_age: int | None = None, *, keep_last: bool = False
    ) -> None:
        """``keep_last``: once every sample is too old, the value is the latest sample's
        (and the count 0: stale) rather than None."""
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._clock = clock or (lambda: 0)
        self._max_age = max_age
        self._keep_last = keep_last
        # (clock, (median, count)) until a sample is added: a controller's choice reads each
        # median several times between two rounds
        self._cached: tuple[int, tuple[float | None, int]] | None = None

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))
        self._cached = None

    def _fresh(self) -> list[float]:
        if self._max_age is None:
            return [value for _, value in self._samples]
        oldest = self._clock() - self._max_age
        return [value for tick, value in self._samples if tick >= oldest]

    def __len__(self) -> int:
        return self.median_and_count()[1]

    @property
    def value(self) -> float | None:
        return self.median_and_count()[0]

    def median_and_count(self) -> tuple[float | None, int]:
        """``value`` and ``len`` from one pass over the samples (again only once a sample
        was added or the clock moved)."""
        now = self._clock()
        if self._cached is None or self._cached[0] != now:
            fresh = self._fresh()
            if fresh:
                median = statistics.median(fresh)
            else:
                median = self._samples[-1][1] if self._keep_last and self._samples else None
            self._cached = now, (median, len(fresh))
        return self._cached[1]


class DecayedRate:
    """Successes over tries, both decayed each round: a rate that follows recent rounds."""

    def __init__(self, size: int) -> None:
        self.tries = np.zeros(size)
        self.hits = np.zeros(size)

    def decay(self, factor: float) -> None:
        self.tries *= factor
        self.hits *= factor

    def add(self, index: int, hit: bool) -> None:
        self.tries[index] += 1
        self.hits[index] += hit

    def cap(self, tries: float) -> None:
        """Scale each index's counts down to at most ``tries`` tries, keeping its rate."""
        scale = np.minimum(1.0, tries / np.maximum(self.tries, 1e-12))
        self.tries *= scale
        self.hits *= scale

    def rate(self, index, prior: float, weight: float):
        """hits / tries at ``index`` (an int or an array of them), with ``weight`` tries of
        ``prior`` added: one unlucky try must not rule a choice out."""
        return (self.hits[index] + prior * weight) / (self.tries[index] + weight)


class Delivered:
    """What drafted rounds delivered against what the cost model predicted for them: tokens
    committed, and the tokens the predicted rate would have committed in the rounds' whole
    periods, both decayed per round. The model predicts a round from its parts (acceptance
    by depth, costs by width), and those can each be right on average while the prediction
    is not (priors of shapes seldom tried, costs that shift with the text)."""

    def __init__(self) -> None:
        self.tokens = self.predicted = 0.0

    def add(self, tokens: int, predicted: float) -> None:
        self.tokens += tokens
        self.predicted += predicted

    def decay(self, factor: float) -> None:
        self.tokens *= factor
        self.predicted *= factor

    def cap(self, predicted: float) -> None:
        """Scale down to at most ``predicted`` predicted tokens' worth, keeping the ratio."""
        if self.predicted > predicted:
            scale = predicted / self.predicted
            self.tokens, self.predicted = self.tokens * scale, predicted

    def share(self, prior_tokens: float) -> float:
        """Delivered over predicted, drawn toward 1 by ``prior_tokens`` predicted tokens."""
        return (self.tokens + prior_tokens) / (self.predicted + prior_tokens)
