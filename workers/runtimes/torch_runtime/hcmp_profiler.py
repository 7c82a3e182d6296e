"""ARCA's measurements: what an HCMP verification costs at each width and split ratio, the
work each side did in it, and what a round of each width and tree shape emits.

``verify_costs`` times real split forwards (``HcmpRuntime``, its ratio set per measurement)
of ``width`` draft nodes after a prefix; where both sides are one CPU the sides run one after
the other, so the figures show the split's overhead, not a gain. ``emitted_per_round``
calibrates acceptance: on each prompt the target's greedy continuation is the truth, and at
points along it the draft model's tree of each shape and width is matched against it
(accepted nodes plus the verifier's own token).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetspec.speculative.control.hcmp_work import Work
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.tree import chain_parents, match_path
from hetspec.workers.runtimes.torch_runtime.hcmp_runtime import HcmpRuntime
from hetspec.workers.runtimes.tree_runtime import TreeRuntime


@dataclass(frozen=True)
class TreeShape:
    """A draft tree of ``width`` nodes: ``top_k`` children a node (1: a chain)."""

    name: str
    top_k: int


SHAPES = (TreeShape("chain", 1), TreeShape("tree-k2", 2), TreeShape("tree-k4", 4))
TREE_DEPTH = 8


def verify_costs(
    runtime: HcmpRuntime,
    prefix: Sequence[int],
    widths: Iterable[int],
    ratios: Iterable[float],
    *,
    repeats: int = 7,
) -> dict[tuple[int, float], float]:
    """Median ms of one verification of ``width`` chained draft nodes after ``prefix``, at
    each (width, ratio); the runtime's sides and shift are kept, its ratio set in turn. The
    ratios of a width are timed in turns (one forward each, ``repeats`` rounds), so a busy
    box's noise falls on all of them alike."""
    base = runtime.settings
    ratios = list(ratios)
    runtime.prefill(list(prefix))
    samples: dict[tuple[int, float], list[float]] = {}
    for width in widths:
        tokens, parents = list(prefix[:width]), chain_parents(width)
        for turn in range(repeats + 1):  # the first turn warms
            for ratio in ratios:
                runtime.set_split(replace(base, ratio=ratio))
                start = time.perf_counter()
                runtime.forward_tree(tokens, parents)
                seconds = time.perf_counter() - start
                runtime.discard_pending()
                if turn:
                    samples.setdefault((width, ratio), []).append(seconds)
    runtime.set_split(base)
    return {key: 1000.0 * statistics.median(times) for key, times in samples.items()}


def recorded_work(
    runtime: HcmpRuntime, prefix: Sequence[int], width: int, ratio: float
) -> list[Work]:
    """The ``Work`` items one split forward of ``width`` chained nodes after ``prefix`` did
    (ratio 0 and 1 are the unsplit forward, which records nothing: ``hcmp_work`` lists it)."""
    base = runtime.settings
    runtime.set_split(replace(base, ratio=ratio))
    runtime.prefill(list(prefix))
    record: list[Work] = []
    runtime.record_work(record)
    runtime.forward_tree(list(prefix[:width]), chain_parents(width))
    runtime.record_work(None)
    runtime.discard_pending()
    runtime.set_split(base)
    return record


def emitted_per_round(
    target: TreeRuntime,
    draft: TreeRuntime,
    prompts: Sequence[Sequence[int]],
    widths: Iterable[int],
    shapes: Iterable[TreeShape] = SHAPES,
    *,
    tokens: int = 48,
    every: int = 4,
) -> dict[tuple[int, str], float]:
    """Mean tokens a greedy round emits with a draft tree of each width and shape: matched
    against the target's greedy continuation of each prompt, at every ``every``-th of its
    first ``tokens`` positions. A tree is at most ``TREE_DEPTH`` deep (a chain: ``width``)."""
    greedy, sampler = SamplingParams(), DrawnSampler(0)
    widths, shapes = list(widths), list(shapes)
    rounds: dict[tuple[int, str], list[int]] = {(w, s.name): [] for w in widths for s in shapes}
    for prompt in prompts:
        target.prefill(list(prompt))
        truth = target.decode(tokens + max(widths), greedy, sampler)
        for at in range(0, tokens, every):
            draft.prefill([*prompt, *truth[:at]])
            for width in widths:
                for shape in shapes:
                    depth = width if shape.top_k == 1 else min(width, TREE_DEPTH)
                    tree = draft.draft_tree(depth, shape.top_k, width, greedy, sampler)
                    parents = np.asarray(tree.parents)
                    accepted = match_path(np.asarray(tree.tokens), parents, truth[at:])
                    rounds[width, shape.name].append(len(accepted) + 1)
    return {key: statistics.fmean(counts) for key, counts in rounds.items() if counts}
