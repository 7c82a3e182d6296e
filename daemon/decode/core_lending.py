"""The drafter's cores lent to the target only while one request decodes.

``SpareCoreChoice`` measures whether the target gains by computing on the drafter's idle
cores too. With several requests at once the drafter is never idle for long (it drafts for
the others), and a target that borrowed its cores would oversubscribe them: both would wait
on each other's threads at every step. So while more than one request decodes nothing is
borrowed, and nothing measured then counts for the choice (a batched forward's cost per
token is not a lone one's).
"""

from __future__ import annotations

from collections.abc import Callable

from hetspec.speculative.control.core_choice import SpareCoreChoice


class CoreLending:
    """``choice``, consulted only while ``alone()`` says one request decodes."""

    def __init__(self, alone: Callable[[], bool], choice: SpareCoreChoice | None = None) -> None:
        self.alone = alone
        self.choice = choice or SpareCoreChoice()

    def preferred(self) -> bool:
        return self.alone() and self.choice.preferred()

    def choose(self) -> bool:
        return self.alone() and self.choice.choose()

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
