"""What the worker micro-benchmarks share: argument parsing and robust timing."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def positive_int(text: str) -> int:
    """argparse type for a count of at least 1, or a usage error saying what is wrong."""
    values = positive_int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, not {text!r}")
    return values[0]


def positive_int_list(text: str) -> list[int]:
    """argparse type for "1,2,4": positive integers, or a usage error saying what is wrong."""
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        message = f"expected comma-separated integers, not {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return values


def timed_ms(
    work: Callable[[], object],
    repeats: int,
    warmup: int = 2,
    setup: Callable[[], object] | None = None,
) -> tuple[float, float, float]:
    """Median, p25 and p75 of ``work()`` in milliseconds, after ``warmup`` untimed calls (the
    median, because a shared machine preempts the odd run); ``setup()``, untimed, before
    each call."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        work()
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        work()
        samples.append((time.perf_counter() - start) * 1000)
    if not samples:
        raise ValueError(f"timing needs at least one repeat, not {repeats}")
    quartiles = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return statistics.median(samples), quartiles[0], quartiles[2]
