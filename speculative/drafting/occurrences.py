"""Where each short context occurred in a request's tokens: the index prompt lookup and the
continuation tree read.

A context of order n at position p is the n tokens before p (``tokens[p - n:p]``); position p
is said to follow it. For every order 1..``max_order``, the index keeps each context's latest
following position, and for every position the one that followed the previous occurrence of
the same context (a chain, as zlib's hash chains): so the occurrences of the text's current
ending are found newest first in O(1) each, and appending a token costs ``max_order`` updates.
The text's own ending has no following position yet, so what the index finds for it is always
an earlier occurrence.

Memory: the tokens and one integer per position and order, plus one entry per distinct context,
at most ``max_contexts`` of them (a context first seen beyond that is not indexed: lookups
simply miss it). A run of one repeated token holds ``max_order`` contexts whatever its length;
reading its occurrences is capped by the caller's ``limit``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

NONE = -1  # no earlier occurrence


class OccurrenceIndex:
    """A request's tokens and, per context of 1..``max_order`` tokens, the positions that
    followed its occurrences."""

    def __init__(self, max_order: int = 4, max_contexts: int = 1 << 18) -> None:
        if max_order < 1:
            raise ValueError(f"max_order must be at least 1, not {max_order}")
        self.max_order = max_order
        self.max_contexts = max_contexts
        self.tokens: list[int] = []
        # per order (index order - 1): context -> the position after its latest occurrence
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_order)]
        # per order, per position p: the position after the previous occurrence of p's context
        self._previous: list[array] = [array("q") for _ in range(max_order)]
        self._contexts = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def contexts(self) -> int:
        """Distinct contexts indexed (all orders): what the tables hold besides the tokens."""
        return self._contexts

    def extend(self, tokens: Iterable[int]) -> None:
        history, max_order = self.tokens, self.max_order
        orders = list(enumerate(zip(self._latest, self._previous, strict=True), start=1))
        window = tuple(history[-max_order:])  # the contexts before the next position, longest
        contexts, most = self._contexts, self.max_contexts
        try:
            for token in map(int, tokens):
                position, known = len(history), len(window)
                for order, (latest, chain) in orders:
                    previous = NONE
                    if order <= known:
                        context = window[known - order :]
                        previous = latest.get(context, NONE)
                        if previous != NONE or contexts < most:
                            contexts += previous == NONE
                            latest[context] = position
                    chain.append(previous)  # kept for every position and order: O(1) reads
                history.append(token)
                window = (*window, token)[-max_order:]
        finally:  # a token that is no integer stops the feed with the count still right
            self._contexts = contexts

    def longest_match(self, min_order: int) -> tuple[int, int]:
        """(n, p): the largest order n >= ``min_order`` whose context ending the text occurred
        before, and p, the position after its latest earlier occurrence; (0, -1) if none."""
        history, end = self.tokens, len(self.tokens)
        for order in range(min(self.max_order, end), max(min_order, 1) - 1, -1):
            position = self._latest[order - 1].get(tuple(history[end - order :]))
            if position is not None:
                return order, position
        return 0, NONE

    def earlier(self, order: int, position: int, limit: int) -> list[int]:
        """Positions that followed occurrences of the order-``order`` context before
        ``position`` (``position`` first, then older ones), at most ``limit`` of them."""
        chain = self._previous[order - 1]
        found: list[int] = []
        while position != NONE and len(found) < limit:
            found.append(position)
            position = chain[position]
        return found


class OccurrenceDrafter:
    """What the drafters over an ``OccurrenceIndex`` share: the index of the text's contexts
    of up to ``max_order`` tokens (at most ``max_contexts``), the shortest ending matched
    (``min_order``), the deepest proposal (``max_depth``), the occurrences read
    (``occurrences``) and the pseudo-count that keeps one sighting from reading as certainty
    (``prior``); ``extend`` feeds the index."""

    def __init__(
        self,
        *,
        max_order: int = 4,
        min_order: int = 1,
        max_depth: int = 32,
        occurrences: int = 16,
        prior: float = 0.5,
        max_contexts: int = 1 << 18,
    ) -> None:
        if not 1 <= min_order <= max_order:
            raise ValueError(f"need 1 <= min_order <= max_order, not {min_order}, {max_order}")
        if max_depth < 1 or occurrences < 1 or prior <= 0:
            raise ValueError("max_depth and occurrences must be at least 1, prior above 0")
        self.index = OccurrenceIndex(max_order, max_contexts)
        self.min_order = min_order
        self.max_depth = max_depth
        self.occurrences = occurrences
        self.prior = prior

    def __len__(self) -> int:
        return len(self.index)

    def extend(self, tokens: Iterable[int]) -> None:
        self.index.extend(tokens)
