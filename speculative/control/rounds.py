"""A speculative round as two values: the plan that goes in, the report that comes out.

The budget controller chooses plans and learns from reports alone; the engine turns a plan
into worker calls and the calls' timings into a report, and the controller's tests get the
same reports from a simulated box. So what the controller learns cannot depend on which of
the two ran the round.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """One round's shape and what the controller expects of it."""

    gamma: int  # tokens drafted per branch; 0: no draft, the target decodes alone
    branches: int = 1
    overlap: bool = False  # the drafter drafts the next round while this one is verified
    # DuoDecoding's uncertainty rule picks the branch count: ``gamma`` is then the budget
    # the branches share and ``branches`` the most it may pick
    rule: bool = False
    expected_tokens: float = 1.0  # committed per round, the target's bonus token included
    round_s: float = 0.0  # expected seconds

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.round_s if self.round_s > 0 else 0.0


@dataclass(frozen=True)
class Beside:
    """What the other requests decoding at the same time put in each verifier forward,
    by their latest plans: ``rows`` nodes (a request decoding alone: one) and ``tokens``
    committed a round. Requests verified together share one forward, so a request's plan
    is priced at the forward's whole width and weighed by what the whole batch commits."""

    rows: int = 0
    tokens: float = 0.0


NO_ONE_BESIDE = Beside()


@dataclass(frozen=True)
class DraftCall:
    """One draft call's cost: ``steps`` forwards of ``branches`` branches took ``compute_s``
    of the drafter's own time (steps 0: not a measure of a step, e.g. a long catch-up), its
    catch-up before them (appending what it had not seen) ``catch_up_s``, and the call took
    ``latency_s`` more (messages, wake-ups). ``prefill_wait_s``: before the call, waiting for
    the drafter's prompt prefill (started late, after rounds without a draft): neither a
    draft's cost nor the daemon's."""

    steps: int
    branches: int
    compute_s: float
    latency_s: float
    overlapped: bool = False  # drafted while the verifier computed
    prefill_wait_s: float = 0.0
    catch_up_s: float = 0.0


@dataclass(frozen=True)
class TreeOutcome:
    """What a dynamic tree round tells the controller of its scores: ``expected``, the
    verified nodes' estimated acceptance summed (against the report's ``accepted``), and
    ``first_choices``, below the root and each accepted node, whether verification took the
    draft's first choice."""

    expected: float
    first_choices: tuple[bool, ...] = ()


@dataclass(frozen=True)
class RoundReport:
    """What one round did and cost. ``gamma`` and ``branches`` are the shape drafted (the
    rule picks its own); ``accepted`` counts drafted tokens accepted on the best branch."""

    gamma: int
    branches: int
    accepted: int
    rule: bool = False  # drafted by the uncertainty rule
    rule_k: int | None = None  # a single-branch draft: the branch count the rule would pick
    # several branches: the drafted tokens the first branch kept (0: it missed at once; None:
    # not known). The first branch holds the draft's own choices, a one-branch round's chain
    first_branch_accepted: int | None = None
    drafts: tuple[DraftCall, ...] = ()
    verify_width: int = 0  # nodes verified: the pending bonus and the draft
    # rows of the forward that verified them, every request's (0: its own alone): what
    # ``verify_s`` paid for; a round of the target alone: 1 + the rows the other requests
    # decoding at the time put in a forward (their rounds share its forwards)
    batch_rows: int = 0
    verify_s: float = 0.0  # 0: not what such a round costs (a trial of the other core choice)
    verify_compute_s: float = 0.0  # of that, the verifier's own time (the rest: the link)
    verify_overlapped: bool = False  # verified while the drafter drafted ahead
    # the rest of the round's period (from the previous round's report to this one's):
    # the daemon's bookkeeping, streaming the tokens out, choosing the next plan
    overhead_s: float = 0.0
    # the round's whole period, from the previous round's report to this one's (0: not
    # measured): what its tokens really cost, whatever the cost model thinks of its parts
    period_s: float = 0.0
    # gamma 0 (the target alone): seconds per token of the whole round and of the target's
    # own work (None: not what decoding alone costs, e.g. a transition from drafting or a
    # trial of the other core choice)
    alone_round_s: float | None = None
    alone_compute_s: float | None = None
    tree: TreeOutcome | None = None  # a dynamic tree round's
    # a model-free draft's round (``gamma``: the nodes it verified, one branch whatever
    # their shape): their estimated acceptance, summed, against ``accepted``
    lookup: float | None = None

    @property
    def drafted(self) -> int:
        return self.gamma * self.branches
