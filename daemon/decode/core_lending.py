"""The drafter's cores lent to the target while the drafter has nothing to do.

``SpareCoreChoice`` measures whether the target gains by computing on the drafter's idle
cores too. With one request decoding, the request's own rounds say when the drafter idles.
With several, the drafter drafts for whichever of them draft, and a target that borrowed its
cores while it drafts would oversubscribe them (both would wait on each other's threads at
every step): so the cores are lent only while ``drafter_quiet()`` (the daemon's rule: no
drafter call in flight), at the choice measured so far, with no trials; and only a lone
request's calls are measured (a batched forward's cost per token is not a lone one's).
"""

from __future__ import annotations

from collections.abc import Callable

from hetspec.speculative.control.core_choice import SpareCoreChoice


class CoreLending:
    """``choice``, consulted while ``alone()`` (one request decodes), or at its preferred
    choice while ``drafter_quiet()`` (several do, none drafting)."""

    def __init__(
        self,
        alone: Callable[[], bool],
        drafter_quiet: Callable[[], bool] = lambda: False,
        choice: SpareCoreChoice | None = None,
    ) -> None:
        self.alone, self.drafter_quiet = alone, drafter_quiet
        self.choice = choice or SpareCoreChoice()

    def preferred(self) -> bool:
        return (self.alone() or self.drafter_quiet()) and self.choice.preferred()

    def choose(self) -> bool:
        if self.alone():
            return self.choice.choose()
        return self.drafter_quiet() and self.choice.preferred()

    @property
    def exploring(self) -> bool:
        return self.alone() and self.choice.exploring

    def cost_s(self) -> float | None:
        return self.choice.cost_s()

    def record(self, spare_cores: bool, seconds_per_token: float) -> None:
        if self.alone():
            self.choice.record(spare_cores, seconds_per_token)

    def snapshot(self) -> dict:
        return self.choice.snapshot()
