"""The simulated unified-memory board: the work model's sides, the roofline replay, and where
the split pays on it (a model with assumed efficiencies, not a measurement)."""

from __future__ import annotations

import pytest

from hetspec.protocol.config_shape import ConfigShape
from hetspec.speculative.control.hcmp_work import CPU, GPU, column_split, forward_work
from hetspec.speculative.control.unified_board import (
    forward_seconds,
    orin_nx_full_clocks,
    xavier_nx_as_the_paper_ran_it,
)

VICUNA_7B = ConfigShape(
    layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000
)


def seconds(board, width: int, ratio: float) -> float:
    return forward_seconds(forward_work(VICUNA_7B, width=width, committed=256, ratio=ratio), board)


@pytest.mark.parametrize(("ratio", "sides"), [(0.0, {CPU}), (1.0, {GPU}), (0.5, {CPU, GPU})])
def test_ratio_zero_and_one_are_one_sides_work(ratio, sides) -> None:
    work = forward_work(VICUNA_7B, width=4, committed=10, ratio=ratio)
    assert {w.side for w in work} == sides
    assert sum(w.flops() for w in work) == sum(
        w.flops() for w in forward_work(VICUNA_7B, width=4, committed=10, ratio=1.0)
    )


def test_column_split_bounds() -> None:
    assert [column_split(10, r) for r in (0.0, 0.34, 1.0)] == [0, 3, 10]
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        column_split(10, 1.2)


def test_a_memory_bound_forward_gains_nothing_from_the_second_side() -> None:
    """At width 1 both sides stream weights from the one DRAM: the split cannot add bandwidth."""
    board = orin_nx_full_clocks()
    best = min(seconds(board, 1, r / 20) for r in range(21))
    assert best >= 0.97 * min(seconds(board, 1, 0.0), seconds(board, 1, 1.0))


def test_on_the_papers_board_a_wide_verification_splits_for_more_than_1_3x() -> None:
    board = xavier_nx_as_the_paper_ran_it()
    for width in (8, 16, 32):
        alone = min(seconds(board, width, 0.0), seconds(board, width, 1.0))
        split = min(seconds(board, width, r / 20) for r in range(1, 20))
        assert alone / split >= 1.3, (width, alone / split)
