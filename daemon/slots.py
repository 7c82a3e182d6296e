"""Who holds which slot of the shared-memory arena.

A slot is lent to one owner at a time (a request, for the rows its worker writes there) and
comes back when the owner is done with what it holds. Lending is explicit so that a slot is
never written by one worker while another reads it, and so that a bug that forgets a slot
shows up as an exhausted pool naming the owners, not as silently corrupted rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class SlotError(RuntimeError):
    pass


class SlotPool:
    def __init__(self, slots: int) -> None:
        self._free = deque(range(slots))
        self._owners: dict[int, str] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def lend(self, owner: str) -> int:
        if not self._free:
            held = ", ".join(f"{slot}: {who}" for slot, who in sorted(self._owners.items()))
            raise SlotError(f"no free arena slot for {owner} (held: {held})")
        slot = self._free.popleft()
        self._owners[slot] = owner
        return slot

    def give_back(self, slot: int) -> None:
        if self._owners.pop(slot, None) is None:
            raise SlotError(f"slot {slot} was not lent")
        self._free.append(slot)

    def reclaim(self, owner: str) -> list[int]:
        """Take back every slot ``owner`` still holds (it failed or was cancelled)."""
        slots = [slot for slot, who in self._owners.items() if who == owner]
        for slot in slots:
            self.give_back(slot)
        return slots

    @contextmanager
    def lease(self, owner: str) -> Iterator[int]:
        slot = self.lend(owner)
        try:
            yield slot
        finally:
            self.give_back(slot)
