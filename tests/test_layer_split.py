"""Splitting a target's layers into pipeline stages (speculative/flow/layer_split.py): ranges in
half-layers, and the split that makes the slowest stage fastest for measured stage costs."""

from __future__ import annotations

import itertools

import pytest

from hetspec.protocol.config_shape import ConfigShape
from hetspec.speculative.flow.layer_split import (
    SplitError,
    balanced_split,
    counts_split,
    even_split,
    format_range,
    parse_range,
    stage_weights,
)

HEAVY_100M = ConfigShape(
    layers=8, hidden=1024, heads=32, kv_heads=16, head_dim=32, intermediate=2816, vocab=4096
)


def test_ranges_are_written_in_layers_with_halves() -> None:
    assert parse_range("0:2.5", 8) == (0, 5)
    assert parse_range("2.5:8", 8) == (5, 16)
    assert format_range(5, 16) == "2.5:8"
    for text in ["0:8", "1.5:2", "3:3.5"]:
        assert format_range(*parse_range(text, 8)) == text


@pytest.mark.parametrize("text", ["0:9", "2:2", "3:1", "0:2.25", "a:b", "0:2:4", "0", "nan:2"])
def test_a_range_the_model_cannot_have_is_refused(text) -> None:
    with pytest.raises(SplitError):
        parse_range(text, 8)


def test_even_and_counted_splits_cover_the_model_once() -> None:
    assert even_split(8, 3) == [(0, 6), (6, 12), (12, 16)]
    assert counts_split([2.5, 2.5, 3], 8) == [(0, 5), (5, 10), (10, 16)]
    with pytest.raises(SplitError):
        counts_split([2.5, 2.5, 2.5], 8)
    with pytest.raises(SplitError):
        counts_split([0.25, 7.75], 8)
    with pytest.raises(SplitError):
        even_split(2, 3)


def test_weights_count_every_parameter_of_the_model() -> None:
    """heavy-100m: the attention and MLP halves and the head add up to its parameters (less
    the embedding, which is a lookup)."""
    shape = HEAVY_100M
    attention, mlp = shape.half_weights()[:2]
    assert attention == 1024 * 1024 * 2 + 2 * 1024 * 512 + 1024  # q, o; k, v; norm
    assert mlp == 3 * 1024 * 2816 + 1024
    assert sum(stage_weights(shape, even_split(8, 3))) == 8 * (attention + mlp) + 4096 * 1024 + 1024


def brute_force(shape: ConfigShape, rates: list[float]) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, 2 * shape.layers), len(rates) - 1):
        bounds = list(zip([0, *cuts], [*cuts, 2 * shape.layers], strict=True))
        times = [r * w for r, w in zip(rates, stage_weights(shape, bounds), strict=True)]
        best = min(best, max(times))
    return best


@pytest.mark.parametrize("rates", [[1.0, 1.0, 1.0], [1.3, 1.0, 0.8], [1.0, 2.0], [0.5, 1, 1, 2]])
def test_the_balanced_split_makes_the_slowest_stage_fastest(rates) -> None:
    shape = HEAVY_100M
    bounds = balanced_split(shape, rates)
    assert bounds[0][0] == 0
    assert bounds[-1][1] == 16
    assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(bounds))
    times = [r * w for r, w in zip(rates, stage_weights(shape, bounds), strict=True)]
    assert max(times) == pytest.approx(brute_force(shape, rates))


def test_a_stage_that_sees_more_rows_gets_fewer_layers() -> None:
    """The first stage computes what is pruned before it reaches the others: at 1.5x their
    cost per parameter it holds the fewest layers, and some stage ends on a half layer."""
    bounds = balanced_split(HEAVY_100M, [1.5, 1.0, 1.0])
    sizes = [b - a for a, b in bounds]
    assert sizes[0] < sizes[1]
    assert sizes[0] < sizes[2]
    assert any(b % 2 for _, b in bounds[:-1])
    with pytest.raises(SplitError):
        balanced_split(HEAVY_100M, [1.0, 0.0])
