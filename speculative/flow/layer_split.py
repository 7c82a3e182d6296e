"""Which of the target's layers each pipeline stage holds, in half-layers.

Half-layer 2i is layer i's attention (with its input norm and KV cache), 2i + 1 its MLP (with
the post-attention norm): a stage may end between the two, so a model of few layers can still
be split into stages of equal cost. A stage's range is written in layers, halves as ``.5``:
``0:2.5`` is layers 0 and 1 and layer 2's attention.

``balanced_split`` chooses the ranges that minimize the slowest stage's time, from each
stage's measured cost per parameter: a stage's cost per parameter differs by its place (the
first stage computes every segment's rows, later ones only what was not pruned on the way,
the last one also the LM head), so the cheapest split is not the even one. Pure arithmetic.
"""

from __future__ import annotations

import itertools
import math

from hetspec.protocol.config_shape import ConfigShape


class SplitError(ValueError):
    """A layer range or split that the model cannot have."""


def parse_range(text: str, layers: int) -> tuple[int, int]:
    """``"FIRST:END"`` in layers (whole or ``.5``) -> (first half, end half), checked to be
    a non-empty range of a ``layers``-layer model."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        halves = [float(part) * 2 for part in parts]
    except ValueError:
        raise SplitError(f"a layer range is FIRST:END (e.g. 0:4 or 0:2.5), not {text!r}") from None
    if not all(math.isfinite(h) and h == int(h) for h in halves):
        raise SplitError(f"{text!r}: a stage ends on a whole or a half layer (x.5)")
    first, end = (int(h) for h in halves)
    if not 0 <= first < end <= 2 * layers:
        raise SplitError(f"{text!r} is not a range of the model's {layers} layers")
    return first, end


def format_range(first_half: int, end_half: int) -> str:
    """(first half, end half) -> ``"0:2.5"``."""
    return f"{first_half / 2:g}:{end_half / 2:g}"


def even_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Whole layers, as even as they divide (earlier stages one layer more), in halves."""
    if not 1 <= stages <= layers:
        raise SplitError(f"cannot split {layers} layers into {stages} stages of whole layers")
    size, extra = divmod(layers, stages)
    bounds, start = [], 0
    for index in range(stages):
        end = start + size + (index < extra)
        bounds.append((2 * start, 2 * end))
        start = end
    return bounds


def counts_split(counts: list[float], layers: int) -> list[tuple[int, int]]:
    """Layers per stage (e.g. ``[2.5, 2.5, 3]``) -> half ranges; they must cover the model."""
    halves = [c * 2 for c in counts]
    if any(h != int(h) or h < 1 for h in halves) or sum(halves) != 2 * layers:
        raise SplitError(
            f"{counts} is not positive whole or half layers summing to the model's {layers}"
        )
    ends = list(itertools.accumulate(int(h) for h in halves))
    return [(end - int(h), end) for h, end in zip(halves, ends, strict=True)]


def stage_weights(shape: ConfigShape, bounds: list[tuple[int, int]]) -> list[int]:
    """Parameters each stage computes with (the last stage's LM head included)."""
    halves = shape.half_weights()
    weights = [sum(halves[a:b]) for a, b in bounds]
    weights[-1] += shape.head_weight()
    return weights


def balanced_split(shape: ConfigShape, cost_per_weight: list[float]) -> list[tuple[int, int]]:
    """The split into ``len(cost_per_weight)`` stages whose slowest stage is fastest, where
    stage k's time is ``cost_per_weight[k]`` times the parameters it holds (``stage_weights``);
    ties go to the split whose costs are most even. Exhaustive over half-layer boundaries:
    fine for the few stages and few dozen layers a pipeline has."""
    stages = len(cost_per_weight)
    total = 2 * shape.layers
    if not 1 <= stages <= total or any(c <= 0 for c in cost_per_weight):
        raise SplitError(f"cannot split {shape.layers} layers by costs {cost_per_weight}")
    prefix = [0, *itertools.accumulate(shape.half_weights())]
    head = shape.head_weight()
    best: tuple[float, float] | None = None
    chosen: list[tuple[int, int]] = []
    for cuts in itertools.combinations(range(1, total), stages - 1):
        starts, ends = [0, *cuts], [*cuts, total]
        times = [
            c * (prefix[b] - prefix[a])
            for c, a, b in zip(cost_per_weight, starts, ends, strict=True)
        ]
        times[-1] += cost_per_weight[-1] * head
        key = (max(times), max(times) - min(times))
        if best is None or key < best:
            best, chosen = key, list(zip(starts, ends, strict=True))
    return chosen
