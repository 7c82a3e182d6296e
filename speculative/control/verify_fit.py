"""A verification's cost as a function of its width, fitted through the medians the rounds
measured per width: the load profile's curve raised and stretched to them, or a line.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hetspec.speculative.control.cost_model import (
    ProfileCurve,
    ProfiledVerify,
    VerifyCost,
    VerifyLine,
)

FIT_SPAN = 1.5  # the profile's dearest measured width against its cheapest, to fit a slope


def fit_profile(
    profile: ProfileCurve, widths: np.ndarray, times: np.ndarray, weights: np.ndarray
) -> ProfiledVerify:
    """base + scale x the profile, fitted to (width, seconds) medians by weighted least
    squares where three widths or more were measured whose profile costs span at least
    ``FIT_SPAN`` (the profile is taken as plain rounds verify, on the drafter's cores too
    where the verifier may borrow them; overlapped rounds verify on its own cores beside a
    drafting drafter, another level and slope), else the profile scaled by the ratio of the
    medians to it: over a narrow span the noise tilts the line, and a controller that
    believes other widths dear never measures them again (docs/design-notes.md)."""
    expected = profile.at(widths.astype(np.int64))  # tree widths: the profile's table
    floor = float(times.min()) * 0.5
    total = float(weights.sum())  # dot products: np.average's checks cost more than its sums
    if len(widths) >= 3 and expected.max() >= FIT_SPAN * expected.min():
        mean_p = float(weights @ expected) / total
        mean_t = float(weights @ times) / total
        off_p = expected - mean_p
        spread = float(weights @ (off_p * off_p))
        if spread > 0:
            scale = float(weights @ (off_p * (times - mean_t))) / spread
            if scale > 0:
                return ProfiledVerify(profile, mean_t - scale * mean_p, scale, floor)
    scale = float(weights @ times) / float(weights @ expected)
    return ProfiledVerify(profile, 0.0, scale, floor)


def scaled(line: VerifyCost, factor: float) -> VerifyCost:
    """``line``'s seconds times ``factor`` at every width."""
    if isinstance(line, ProfiledVerify):
        return replace(
            line, base=line.base * factor, scale=line.scale * factor, floor=line.floor * factor
        )
    return replace(
        line, mean_t=line.mean_t * factor, slope=line.slope * factor, floor=line.floor * factor
    )


def fit_line(
    widths: np.ndarray, times: np.ndarray, weights: np.ndarray | None = None
) -> VerifyLine:
    """The weighted least-squares line (slope >= 0) through (width, seconds) points."""
    weights = np.ones_like(widths) if weights is None else weights
    mean_w = float(np.average(widths, weights=weights))
    mean_t = float(np.average(times, weights=weights))
    spread = (weights * (widths - mean_w) ** 2).sum()
    slope = 0.0
    if spread > 0:
        slope = max(0.0, float((weights * (widths - mean_w) * (times - mean_t)).sum() / spread))
    return VerifyLine(mean_w, mean_t, slope, float(times.min()) * 0.5)
