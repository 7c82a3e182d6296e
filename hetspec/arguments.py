"""argparse types shared by the shell client and the benches (the daemon's too): a bad value is
one line."""

from __future__ import annotations

import argparse
import math


def whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}: {text!r}")
    return value


def positive(text: str) -> int:
    return whole(text, 1)


def non_negative(text: str) -> int:
    return whole(text, 0)


def positive_list(text: str) -> list[int]:
    """Comma-separated whole numbers of at least 1."""
    return [positive(part) for part in text.split(",")]


def finite_float(text: str) -> float:
    """A float that JSON can carry (not nan or inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a finite number of at least 0 (0: greedy)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0: {text!r}")
    return value


def setting(text: str) -> str:
    """A daemon setting for ``hetspecd --set``: ``section.key=value`` (the value as TOML)."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip() or not value.strip() or " " in key.strip():
        raise argparse.ArgumentTypeError(f'not KEY=VALUE (e.g. gpu_runtime="torch"): {text!r}')
    return f"{key.strip()}={value.strip()}"
