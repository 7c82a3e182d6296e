"""Who holds which slot of the shared-memory arena.

A slot is lent to one owner at a time (a request, for the rows its worker writes there) and
comes back when the owner is done with what it holds. Lending is explicit so that a slot is
never written by one worker while another reads it, and so that a bug that forgets a slot
shows up as an exhausted pool naming the owners, not as silently corrupted rows.

An owner may be done while a worker is not: a cancelled call's command may still be running
and write its rows into the slot. Such a slot comes back with a "not before" future (the
worker is done with the calls) and is lent again only once that resolves, whatever order
the pool lends in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class SlotError(RuntimeError):
    pass


class SlotPool:
    def __init__(self, slots: int) -> None:
        self._free = deque(range(slots))
        self._owners: dict[int, str] = {}
        self._settling: dict[int, asyncio.Future] = {}  # given back, still written perhaps

    @property
    def free(self) -> int:
        return len(self._free)

    def lend(self, owner: str) -> int:
        """A free slot now; ``SlotError`` if none is."""
        if not self._free:
            held = ", ".join(f"{slot}: {who}" for slot, who in sorted(self._owners.items()))
            settling = f"; settling: {sorted(self._settling)}" if self._settling else ""
            raise SlotError(f"no free arena slot for {owner} (held: {held}{settling})")
        slot = self._free.popleft()
        self._owners[slot] = owner
        return slot

    def give_back(self, slot: int, not_before: asyncio.Future | None = None) -> None:
        """Return ``slot``; with ``not_before``, it is free only once that future is done
        (with any outcome)."""
        if self._owners.pop(slot, None) is None:
            raise SlotError(f"slot {slot} was not lent")
        if not_before is None or not_before.done():
            self._free.append(slot)
            return
        self._settling[slot] = not_before
        not_before.add_done_callback(lambda done: self._settled(slot, done))

    def _settled(self, slot: int, done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: a failure here still means the worker is done
        del self._settling[slot]
        self._free.append(slot)

    @asynccontextmanager
    async def lease(
        self, owner: str, settled: Callable[[], asyncio.Future] | None = None
    ) -> AsyncIterator[int]:
        """A slot for the block; waits while the only slots left are settling. On the way
        out ``settled()`` is asked for the future before which the slot must not be lent
        again (see ``give_back``)."""
        while not self._free and self._settling:
            await asyncio.wait(set(self._settling.values()), return_when=asyncio.FIRST_COMPLETED)
        slot = self.lend(owner)
        try:
            yield slot
        finally:
            self.give_back(slot, settled() if settled is not None else None)
