"""Which runtime should hold a model: the one that decodes fastest for the rounds expected.

Pure arithmetic over measured forward costs (``{width: ms}`` per runtime), so the daemon can
choose at load without importing a runtime, and tests need no model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The fraction of drafted tokens a verifier accepts, before anything is measured: the bundled
# pair accepts about 0.75 per token, real pairs 0.6-0.8 on code and chat.
PRIOR_ACCEPTANCE = 0.7
# ... of tokens drafted from the text itself (no draft model): a copy is often right where
# the text repeats and absent where it does not; a run of the model-free drafts' own
# estimate for one earlier sighting (2/3) where they propose, none elsewhere
MODEL_FREE_ACCEPTANCE = 0.5


def expected_tokens(gamma: int, acceptance: float) -> float:
    """Tokens one round emits on average: the accepted run of ``gamma`` drafted tokens plus
    the verifier's own (each drafted token accepted with probability ``acceptance`` while
    its predecessors were)."""
    return sum(acceptance**i for i in range(gamma + 1))


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    gamma: int  # the draft length it is reached at; 0: the target alone


def best_rate(
    cost_ms: Mapping[int, float], draft_ms: float | None, acceptance: float = PRIOR_ACCEPTANCE
) -> Rate:
    """The best decode rate a verifier with forward costs ``cost_ms`` ({width: ms}) offers:
    the target alone (width 1), or a round of gamma = width - 1 drafted tokens that costs the
    drafting (``gamma * draft_ms``, done first) plus the verification. Rounds that overlap
    drafting with verifying cost less, for every runtime alike, so this ranks runtimes
    without knowing which rounds the controller will choose. ``draft_ms`` None: no drafter
    is known, and only the target alone counts."""
    if 1 not in cost_ms:
        raise ValueError("a profile needs the cost of one token (width 1)")
    best = Rate(1000.0 / cost_ms[1], 0)
    if draft_ms is None:
        return best
    for width, ms in cost_ms.items():
        gamma = width - 1
        if gamma < 1:
            continue
        rate = 1000.0 * expected_tokens(gamma, acceptance) / (gamma * draft_ms + ms)
        if rate > best.tokens_per_s:
            best = Rate(rate, gamma)
    return best


def fastest(rates: Mapping[str, Rate]) -> str:
    """The runtime with the highest rate (the first listed on a tie)."""
    if not rates:
        raise ValueError("no runtime to choose from")
    return max(rates, key=lambda name: rates[name].tokens_per_s)


# A thread count within this fraction of the fastest counts as fast: fewer threads then win,
# leaving cores to the rest of the box and to other tenants.
THREADS_TOLERANCE = 0.05


def thread_counts(cores: int) -> list[int]:
    """The drafter's thread counts worth timing on ``cores`` cores: 1, 2, 4 .. and all."""
    counts = [1]
    while counts[-1] * 2 < cores:
        counts.append(counts[-1] * 2)
    return [*counts, cores] if cores > 1 else counts


def fewest_fast_threads(costs_ms: Mapping[int, float], tolerance: float = THREADS_TOLERANCE) -> int:
    """The fewest threads whose cost per token is within ``tolerance`` of the cheapest. A
    small draft model is often fastest on few threads: every step of llama.cpp's graph waits
    for all of them, and a tiny step is mostly that wait."""
    if not costs_ms:
        raise ValueError("no thread count was timed")
    cheapest = min(costs_ms.values())
    return min(n for n, cost in costs_ms.items() if cost <= cheapest * (1 + tolerance))


def fastest_drafter(
    costs_ms: Mapping[str, Mapping[int, float]], tolerance: float = THREADS_TOLERANCE
) -> tuple[str, int]:
    """The drafting runtime and thread count, from one draft token's cost ``{runtime:
    {threads: ms}}``: each runtime at its fewest fast threads (``fewest_fast_threads``), then
    the cheapest of those, where a runtime listed earlier keeps its place unless a later one
    is cheaper by more than ``tolerance`` (so noise does not swap a runtime for an equal
    one). Raises ``ValueError`` when nothing was timed."""
    best: tuple[str, int, float] | None = None
    for runtime, by_threads in costs_ms.items():
        if not by_threads:
            continue
        threads = fewest_fast_threads(by_threads, tolerance)
        cost = by_threads[threads]
        if best is None or cost < best[2] * (1 - tolerance):
            best = (runtime, threads, cost)
    if best is None:
        raise ValueError("no drafting runtime was timed")
    return best[0], best[1]
