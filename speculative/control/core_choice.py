"""Whether the target should also compute on the drafter's spare cores, for one kind of
call: the daemon keeps one choice for the target alone and one for plain verifications.

Where both workers compute on the CPU the target may borrow the drafter's cores while the
drafter idles (see hetspec.workers.runtimes.spare_cores). But when another process keeps
those cores busy, the target's extra threads wait on each other at every step, and
borrowing costs more than it gains (docs/design-notes.md, "Spare cores"). So the daemon
measures both: the target's own compute per unit of work with and without the spare cores,
the better one is used, and the other is tried now and then, so that a change either way is
noticed. The two trials are not worth the same. While the target keeps to its own cores,
only a trial shows that a busy process left the spare cores: so borrowing is tried every
``explore_every`` calls. While it borrows, its own calls show a busy process arriving by
slowing down; what they cannot show is whether keeping to its own cores is now the better
choice, so that is tried again at once when borrowing's calls slow (their recent median
``slower`` times their usual), and otherwise only every ``recheck_every`` calls (each such
trial is a slower call).
"""

from __future__ import annotations

import statistics
from collections import deque


class SpareCoreChoice:
    def __init__(
        self,
        window: int = 5,
        explore_every: int = 16,
        recheck_every: int = 128,
        usual_window: int = 48,
        slower: float = 1.25,
    ) -> None:
        # recent costs per unit of work, with the spare cores and on the target's own cores
        self._spare: deque[float] = deque(maxlen=window)
        self._own: deque[float] = deque(maxlen=window)
        self._usual = deque(maxlen=usual_window)  # borrowing's calls over a longer time
        self.explore_every, self.recheck_every = explore_every, recheck_every
        self.slower = slower
        self._since_trial = 0  # calls since the last trial
        self._exploring = False  # the last choice was the one not preferred
        self._confirming = False  # ... and it measured better: try it again at once
        self._best = True

    def _samples(self, spare_cores: bool) -> deque[float]:
        return self._spare if spare_cores else self._own

    def _median(self, spare_cores: bool) -> float | None:
        samples = self._samples(spare_cores)
        return statistics.median(samples) if samples else None

    def preferred(self) -> bool:
        """The better choice as measured (the spare cores until shown otherwise)."""
        with_spare, without = self._median(True), self._median(False)
        return with_spare is None or without is None or with_spare <= without

    def choose(self) -> bool:
        """For the next call of its kind: the preferred choice, or now and then the
        other one, to measure it again (and again at once while it measures better, so that
        a few calls overturn a median of old measurements)."""
        best = self.preferred()
        if best != self._best:
            self._best, self._confirming = best, False
        self._since_trial += 1
        measured = bool(self._own)  # keeping to its own cores, measured at least once
        every = self.recheck_every if best and measured else self.explore_every
        self._exploring = (
            self._confirming
            or self._since_trial >= every
            or (best and measured and self._borrowing_slowed())
        )
        if self._exploring:
            self._since_trial = 0
            if best:  # borrowing's level now is its usual, until it slows again
                self._usual.clear()
                self._usual.extend(self._spare)
        return not best if self._exploring else best

    def _borrowing_slowed(self) -> bool:
        """Borrowing's recent calls cost ``slower`` times their usual (the level since the
        last recheck, once a few dozen calls tell it)."""
        recent, usual = self._median(True), self._usual
        if recent is None or len(usual) < usual.maxlen // 2:
            return False
        return recent > self.slower * statistics.median(usual)

    @property
    def exploring(self) -> bool:
        """The last ``choose()`` tried the choice not preferred: keep that call short, since
        it is a measurement that may well be twice as slow."""
        return self._exploring

    def cost_s(self) -> float | None:
        """The preferred choice's median cost per token, if measured."""
        return self._median(self.preferred())

    def record(self, spare_cores: bool, seconds_per_token: float) -> None:
        """The target's own compute per unit of work (a token decoded, a one-node
        verification: see ``Estimates.verify_size``) in a call made with (``spare_cores``) or
        without the spare cores."""
        if seconds_per_token <= 0:
            return
        if self._exploring:
            other = self._median(not spare_cores)
            self._confirming = other is not None and seconds_per_token < other
        self._samples(spare_cores).append(seconds_per_token)
        if spare_cores:
            self._usual.append(seconds_per_token)

    def snapshot(self) -> dict:
        """What was measured: the median cost with and without the spare cores (None where
        not measured yet), and the choice they make."""

        def ms(spare_cores: bool) -> float | None:
            median = self._median(spare_cores)
            return None if median is None else round(median * 1000, 4)

        return {"with_ms": ms(True), "without_ms": ms(False), "uses": self.preferred()}
