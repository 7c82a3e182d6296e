"""Up to ``parallel`` requests decode at once, each on a seat; the others wait in a bounded
FIFO queue.

A seat is a sequence number in both workers: its own KV cache, sampler and grammar there, so
requests on different seats never see each other's tokens (and their verifications may
share a forward). The lowest free seat is taken, so a lone user always decodes on seat 0,
whose cache keeps the last conversation's prefix. A request that arrives to a full queue is
refused at once (429) with an estimate of when to retry, instead of waiting without bound. A
waiter that gives up (its client disconnected) leaves the queue without disturbing the
others' order.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"the queue is full ({waiting} requests waiting); retry later")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Seat:
    """A request's turn: its sequence in the workers and how long it waited for it."""

    sequence: int
    waited_s: float


class Admission:
    def __init__(self, capacity: int, parallel: int = 1) -> None:
        if parallel < 1:
            raise ValueError(f"at least one request must decode, not {parallel}")
        self.capacity = capacity  # requests that may wait while ``parallel`` run
        self.parallel = parallel
        self.running = 0
        self.admitted = 0
        self.refused = 0
        self._free = list(range(parallel))  # a heap: the lowest seat first
        self._waiters: deque[asyncio.Future] = deque()  # FIFO, each resolved with a seat
        self._mean_s = 1.0  # moving mean of a request's duration, for Retry-After

    @property
    def waiting(self) -> int:
        return sum(not waiter.done() for waiter in self._waiters)

    def seat_count(self, parallel: int) -> None:
        """Serve ``parallel`` requests at once from now on (what the loaded workers serve).
        Seats beyond it still taken are not lent again once given back."""
        if parallel < 1:
            raise ValueError(f"at least one request must decode, not {parallel}")
        taken = set(range(self.parallel)) - set(self._free)
        self.parallel = parallel
        self._free = [seat for seat in range(parallel) if seat not in taken]
        heapq.heapify(self._free)
        self._seat_waiters()

    def _seat_waiters(self) -> None:
        while self._free and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # else its client gave up
                waiter.set_result(heapq.heappop(self._free))

    def _give_back(self, sequence: int) -> None:
        if sequence < self.parallel:
            heapq.heappush(self._free, sequence)
        self._seat_waiters()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[Seat]:
        """Wait for a seat (FIFO) and hold it for the block. ``QueueFull`` at once if
        ``capacity`` requests are already waiting."""
        arrived = time.perf_counter()
        waiting = self.waiting
        if self._free and not waiting:
            sequence = heapq.heappop(self._free)
        else:
            if waiting >= self.capacity:
                self.refused += 1
                raise QueueFull(waiting, (waiting + 1) * self._mean_s / self.parallel)
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                sequence = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # seated as it gave up
                    self._give_back(waiter.result())
                raise
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        started = time.perf_counter()
        self.running += 1
        self.admitted += 1
        try:
            yield Seat(sequence, started - arrived)
        finally:
            self.running -= 1
            self._mean_s += 0.2 * (time.perf_counter() - started - self._mean_s)
            self._give_back(sequence)
