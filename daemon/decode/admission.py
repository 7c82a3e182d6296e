"""One request decodes at a time; the others wait their turn in a bounded FIFO queue.

Edge boxes serve one user at a time, so requests are not batched: each runs by itself at full
speed. A request that arrives to a full queue is refused at once (429) with an estimate of
when to retry, instead of waiting without bound. A waiter that gives up (its client
disconnected) leaves the queue without disturbing the others' order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"the queue is full ({waiting} requests waiting); retry later")
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # requests that may wait while one runs
        self.waiting = 0
        self.running = False
        self.admitted = 0
        self.refused = 0
        self._turn = asyncio.Lock()  # FIFO: its waiters are woken in arrival order
        self._mean_s = 1.0  # moving mean of a request's duration, for Retry-After

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[float]:
        """Wait for this request's turn; yields the seconds it waited. ``QueueFull`` at once
        if ``capacity`` requests are already waiting."""
        arrived = time.perf_counter()
        if self.waiting >= self.capacity and (self.running or self.waiting):
            self.refused += 1
            raise QueueFull(self.waiting, (self.waiting + 1) * self._mean_s)
        self.waiting += 1
        try:
            await self._turn.acquire()
        finally:
            self.waiting -= 1
        started = time.perf_counter()
        self.running = True
        self.admitted += 1
        try:
            yield started - arrived
        finally:
            self.running = False
            self._mean_s += 0.2 * (time.perf_counter() - started - self._mean_s)
            self._turn.release()
