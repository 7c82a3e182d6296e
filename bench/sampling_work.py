"""``python -m hetspec.bench.sampling_work``: the daemon's per-round sampling work.

    python -m hetspec.bench.sampling_work [--vocabs 4096,32000,128256,151936] [--nodes 8]

A verification round of a sampled request warps the target's logit rows (temperature, top-k,
top-p) and walks the drafted tree; a drafter warps each row it drafts the same way. This
times, on one core, for rows shaped like a language model's (a few likely tokens over a long
tail), in milliseconds (median of --repeats):

- ``warp row``: ``distribution`` of one row, and with top-p by a sort of the whole row
  (``keep_nucleus(thresholds=(0.0,))``: how top-p was computed before its candidates' shortcut);
- ``round``: a chain of --nodes drafted nodes verified by drawn speculative sampling, the
  target rows warped up front (every row) or as the walk reaches them (``WarpedRows``, what the
  engine does), the draft accepted up to a random depth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hetspec.arguments import positive, positive_list
from hetspec.speculative.verify.distributions import (
    SamplingParams,
    WarpedRows,
    distribution,
    keep_nucleus,
)
from hetspec.speculative.verify.tree import chain_parents
from hetspec.speculative.verify.verdicts import verify_sampling

SETTINGS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "top-k 40, top-p 0.9": SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
}


def lm_like_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """A long Gaussian tail and a few tokens far above it (a top token of ~0.3-0.7)."""
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    for row in logits:
        row[rng.choice(vocab, 8, replace=False)] += rng.uniform(8, 16, 8).astype(np.float32)
    return logits


def median_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cells(
    target: np.ndarray, draft_logits: np.ndarray, params: SamplingParams, repeats: int
) -> list[float]:
    """One table row's timings (see the module's docstring)."""
    draft = distribution(draft_logits, params)
    tokens = np.array([int(row.argmax()) for row in draft])
    parents = chain_parents(len(tokens))
    untruncated = SamplingParams(params.temperature, params.top_k)

    def sorted_row() -> None:
        row = distribution(target[0], untruncated)
        if params.top_p < 1:
            keep_nucleus(row, params.top_p, thresholds=(0.0,))

    def every_row() -> None:
        rows = distribution(target, params)
        verify_sampling(tokens, parents, draft, rows, np.random.default_rng(1))

    def as_reached() -> None:
        rows = WarpedRows(target, params)
        verify_sampling(tokens, parents, draft, rows, np.random.default_rng(1))

    return [
        median_ms(lambda: distribution(target[0], params), repeats),
        median_ms(sorted_row, repeats),
        median_ms(every_row, repeats),
        median_ms(as_reached, repeats),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", type=positive_list, default=[4096, 32000, 128256, 151936])
    parser.add_argument("--nodes", type=positive, default=8)
    parser.add_argument("--repeats", type=positive, default=15)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(
        "| vocabulary | sampling | warp row | warp row, whole-row sort | round, every row "
        "warped | round, rows as reached |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for vocab in args.vocabs:
        target = lm_like_logits(rng, args.nodes + 1, vocab)
        draft_logits = target[1:] + rng.standard_normal((args.nodes, vocab)).astype(np.float32)
        for name, params in SETTINGS.items():
            timings = cells(target, draft_logits, params, args.repeats)
            print(
                f"| {vocab} | {name} | " + " | ".join(f"{ms:.2f}" for ms in timings) + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
