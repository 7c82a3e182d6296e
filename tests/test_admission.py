"""Admission: up to ``parallel`` requests on seats (the lowest free first), the rest FIFO."""

from __future__ import annotations

import asyncio

import pytest

from hetspec.daemon.decode.admission import Admission, QueueFull


async def hold(admission: Admission, log: list, name: str, release: asyncio.Event) -> None:
    async with admission.turn() as seat:
        log.append((name, seat.sequence))
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_requests_take_the_lowest_free_seats_and_wait_in_order_for_more() -> None:
    admission = Admission(capacity=8, parallel=3)
    log, releases = [], {name: asyncio.Event() for name in "abcdef"}
    tasks = {
        name: asyncio.create_task(hold(admission, log, name, releases[name])) for name in "abcdef"
    }
    await settle()
    assert log == [("a", 0), ("b", 1), ("c", 2)]
    assert (admission.running, admission.waiting) == (3, 3)
    releases["b"].set()  # its seat goes to the first waiter
    await settle()
    assert log[3:] == [("d", 1)]
    releases["a"].set()
    releases["c"].set()
    await settle()
    assert sorted(log[4:]) == [("e", 0), ("f", 2)]
    assert log[4][0] == "e"
    for event in releases.values():
        event.set()
    await asyncio.gather(*tasks.values())
    assert (admission.running, admission.waiting, admission.admitted) == (0, 0, 6)
    async with admission.turn() as seat:  # a lone user decodes on seat 0 again
        assert seat.sequence == 0


@pytest.mark.asyncio
async def test_a_full_queue_refuses_at_once_with_a_retry_after() -> None:
    admission = Admission(capacity=1, parallel=2)
    release = asyncio.Event()
    log: list = []
    tasks = [asyncio.create_task(hold(admission, log, str(i), release)) for i in range(3)]
    await settle()
    assert (admission.running, admission.waiting) == (2, 1)
    with pytest.raises(QueueFull) as refused:
        async with admission.turn():
            pass
    assert refused.value.retry_after_s > 0
    assert admission.refused == 1
    release.set()
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_a_waiter_that_gives_up_leaves_its_place_and_no_seat_is_lost() -> None:
    admission = Admission(capacity=4, parallel=1)
    release, log = asyncio.Event(), []
    first = asyncio.create_task(hold(admission, log, "first", release))
    await settle()
    gone = asyncio.create_task(hold(admission, log, "gone", asyncio.Event()))
    last = asyncio.create_task(hold(admission, log, "last", release))
    await settle()
    assert admission.waiting == 2
    gone.cancel()
    await settle()
    assert admission.waiting == 1
    release.set()
    await asyncio.gather(first, last)
    assert log == [("first", 0), ("last", 0)]
    assert admission.running == 0


@pytest.mark.asyncio
async def test_fewer_seats_once_the_workers_serve_fewer_sequences() -> None:
    admission = Admission(capacity=4, parallel=4)
    releases = [asyncio.Event() for _ in range(4)]
    log: list = []
    tasks = [asyncio.create_task(hold(admission, log, str(i), releases[i])) for i in range(3)]
    await settle()
    admission.seat_count(2)  # seat 2, taken, is not lent again once given back
    releases[2].set()
    await settle()
    late = asyncio.create_task(hold(admission, log, "late", releases[3]))
    await settle()
    assert admission.waiting == 1  # seats 0 and 1 are taken, seat 2 is gone
    releases[0].set()
    await settle()
    assert log[-1] == ("late", 0)
    releases[1].set()
    releases[3].set()
    await asyncio.gather(*tasks, late)
    with pytest.raises(ValueError, match="at least one"):
        admission.seat_count(0)
