"""The pipeline's timeline with a device per stage (speculative/flow/pipeline_clock.py)."""

from __future__ import annotations

import pytest

from hetspec.speculative.flow.pipeline_clock import CostProfile, PipelineClock


def test_one_segment_at_a_time_adds_every_hop_and_every_stage() -> None:
    clock = PipelineClock()
    clock.spend(0.001)
    clock.sent()
    clock.returned([10.0, 20.0, 30.0], [1, 1, 1])
    seconds, used = clock.timeline(3, 0.002)
    assert seconds == pytest.approx(0.001 + 4 * 0.002 + 0.060)
    assert used == pytest.approx([0.010 / seconds, 0.020 / seconds, 0.030 / seconds])


def test_segments_in_flight_overlap_across_stages() -> None:
    """Three equal segments through three equal stages: a pipeline's fill and drain, not
    nine stage times."""
    clock = PipelineClock()
    for _ in range(3):
        clock.sent()
    for _ in range(3):
        clock.returned([10.0, 10.0, 10.0], [2, 2, 2])
    seconds, used = clock.timeline(3, 0.0)
    assert seconds == pytest.approx(0.050)
    assert used == pytest.approx([0.6, 0.6, 0.6])


def test_a_profile_replaces_the_runs_own_times_by_width() -> None:
    profile = CostProfile()
    for seconds in (0.010, 0.011, 0.012):
        profile.add(0, 1, seconds)
    profile.add(0, 9, 0.027)
    assert profile.cost(0, 1) == pytest.approx(0.011)  # the median
    assert profile.cost(0, 5) == pytest.approx(0.011 + 0.016 * 4 / 8)
    assert profile.cost(0, 13) == pytest.approx(0.011 + 0.016 * 12 / 8)  # extrapolated
    assert profile.cost(0, 0) == 0.0
    with pytest.raises(KeyError, match="stage 1"):
        profile.cost(1, 3)
    clock = PipelineClock()
    clock.sent()
    clock.returned([99.0], [5])  # measured while sharing cores: replaced
    assert clock.timeline(1, 0.0, profile)[0] == pytest.approx(0.019)
    measured = CostProfile()
    clock.measured(measured)
    assert measured.cost(0, 5) == pytest.approx(0.099)
