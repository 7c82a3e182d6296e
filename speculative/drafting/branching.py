"""DuoDecoding's dynamic multi-sequence drafting: branch only where the draft is unsure.

After the drafter's first two steps along its top choice, theta = p(top-1 at position 1) x
p(top-1 at position 2) (times ``scale``) approximates the chance that the single sequence is
accepted that far. Every first-position candidate at least that likely is worth a sequence of
its own, so the draft branches into k = #{candidates with p >= theta} sequences (the top one
always counts), each ``budget // k`` tokens long: one long sequence when the drafter is sure,
several short ones when it is not, for the same number of drafted tokens.
"""

from __future__ import annotations

import numpy as np


def uncertainty_branches(first: np.ndarray, second_top: float, cap: int, scale: float = 1.0) -> int:
    """k for a draft whose first-position distribution is ``first`` and whose top-1
    continuation's top probability at position 2 is ``second_top``; 1 <= k <= ``cap``."""
    theta = float(first.max()) * second_top * scale
    return int(min(max(np.count_nonzero(first >= theta), 1), cap))


def branch_length(budget: int, branches: int) -> int:
    """Tokens per sequence when ``budget`` drafted tokens are shared by ``branches``."""
    return max(1, budget // branches)
