"""What each request decoding now puts in the verifier's forwards, for the others' plans.

Requests decoding at once share each forward (the worker evaluates every sequence's tree
and token together), so a request's plan is weighed beside the others' latest: the rows
they add to a forward and the tokens they commit a round (``Beside``). A seat posts its
round's shape when it commits a plan and leaves when its request ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hetspec.speculative.control.rounds import NO_ONE_BESIDE, Beside


class BatchBoard:
    def __init__(self) -> None:
        self._posted: dict[int, tuple[int, float]] = {}  # seat: (rows, tokens a round)

    def post(self, seat: int, rows: int, tokens: float) -> None:
        """Seat ``seat``'s rounds verify ``rows`` nodes a forward (1: it decodes alone) and
        commit about ``tokens`` each."""
        self._posted[seat] = (max(int(rows), 1), max(float(tokens), 1.0))

    def leave(self, seat: int) -> None:
        self._posted.pop(seat, None)

    @contextlib.contextmanager
    def seated(self, seat: int) -> Iterator[None]:
        """A request on ``seat``, from its turn to its end: one row a forward until its
        rounds post their own shapes."""
        self.post(seat, 1, 1.0)
        try:
            yield
        finally:
            self.leave(seat)

    def beside(self, seat: int) -> Beside:
        """What the other seats put in each forward (nothing where the seat is alone)."""
        if len(self._posted) <= (seat in self._posted):
            return NO_ONE_BESIDE
        rows = tokens = 0
        for other, (other_rows, other_tokens) in self._posted.items():
            if other != seat:
                rows += other_rows
                tokens += other_tokens
        return Beside(rows, tokens)

    @property
    def seats(self) -> int:
        return len(self._posted)
