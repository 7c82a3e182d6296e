"""The sampling checks' statistics: a target's exact law of its first generated tokens, and the
chi-square goodness-of-fit test against it (the exact tail, no scipy here)."""

from __future__ import annotations

import math

import numpy as np

from hetspec.speculative.verify.distributions import SamplingParams, distribution


def chi2_sf(statistic: float, df: int) -> float:
    """P(X > statistic) for X ~ chi-square(df): the regularized upper incomplete gamma
    function's closed form for integer df (a finite sum; erfc for odd df), in log space so
    that large statistics neither overflow nor underflow early."""
    if statistic <= 0:
        return 1.0
    half = statistic / 2
    if df % 2 == 0:  # exp(-h) * sum_{i < df/2} h^i / i!
        exponents = [-half + i * math.log(half) - math.lgamma(i + 1) for i in range(df // 2)]
        return min(1.0, math.fsum(math.exp(e) for e in exponents))
    # erfc(sqrt(h)) + exp(-h) * sum_{1 <= i <= (df-1)/2} h^(i - 1/2) / gamma(i + 1/2)
    exponents = [
        -half + (i - 0.5) * math.log(half) - math.lgamma(i + 0.5) for i in range(1, (df + 1) // 2)
    ]
    return min(1.0, math.erfc(math.sqrt(half)) + math.fsum(math.exp(e) for e in exponents))


def chi2_critical(df: int, p: float = 0.001) -> float:
    """The statistic a correct sampler exceeds with probability ``p`` (bisection on chi2_sf)."""
    low, high = 0.0, float(df)
    while chi2_sf(high, df) > p:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if chi2_sf(middle, df) > p else (low, middle)
    return high


def chi_square(counts: dict[int, int], law: dict[int, float], trials: int) -> tuple[float, int]:
    """Statistic and degrees of freedom, pooling outcomes expected fewer than 5 times."""
    cells, pooled_expected, pooled_observed = [], 0.0, 0
    for token, p in law.items():
        expected = p * trials
        if expected < 5:
            pooled_expected += expected
            pooled_observed += counts.get(token, 0)
        else:
            cells.append((counts.get(token, 0), expected))
    if pooled_expected > 0:
        cells.append((pooled_observed, pooled_expected))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    return statistic, len(cells) - 1


def exact_marginals(runtime, prompt: str, params: SamplingParams) -> list[dict[int, float]]:
    """P(token i = x) for the first three generated tokens, by enumerating every prefix the
    warped (top-k) target allows."""
    base = runtime.tokenize(prompt)

    def next_law(prefix: list[int]) -> dict[int, float]:
        runtime.prefill(base + prefix)
        row = distribution(runtime.last_logits()[None, :], params)[0]
        return {int(t): float(row[t]) for t in np.flatnonzero(row > 0)}

    first = next_law([])
    second: dict[int, float] = {}
    third: dict[int, float] = {}
    for a, pa in first.items():
        after_a = next_law([a])
        for b, pb in after_a.items():
            second[b] = second.get(b, 0.0) + pa * pb
            for c, pc in next_law([a, b]).items():
                third[c] = third.get(c, 0.0) + pa * pb * pc
    return [first, second, third]
