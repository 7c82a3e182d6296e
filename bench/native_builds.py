"""T(w) of several builds of the native kernels, interleaved in one process.

On a shared VM the speed drifts 10-20% within minutes, so builds timed in separate runs are
hard to compare. This loads each build (a copy of ``_hsnative*.so``, or the installed one) as
its own library, runs the same forwards through each in turn, width by width, asserts that
their logits are bit-identical (a kernel change must not change a bit), and prints the median
time per build and width.

    cp native/_hsnative*.so /tmp/before.so     # then change the C and `make setup`
    python bench/native_builds.py --model ~/.cache/hetspec/heavy-300m/heavy-300m-q8_0.gguf \
        before=/tmp/before.so after=installed

A build may name a kernel level after an @ (``avx2=installed@avx2 vnni=installed@vnni``): that
build's forwards run at most that level (``SIMD_LEVELS``), so levels compare in one run too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hetspec.native.kernels import BEST, SIMD_LEVELS, Kernels
from hetspec.native.model import NativeModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file the native kernels read")
    parser.add_argument("builds", nargs="+", help="LABEL=PATH (PATH: a .so, or 'installed')")
    parser.add_argument("--widths", default="1,8,16")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--simd", choices=["best", *SIMD_LEVELS], default="best")
    parser.add_argument(
        "--bits-may-differ",
        action="store_true",
        help="report builds whose logits differ instead of stopping (a change "
        "of arithmetic on purpose); each build is still width-invariant "
        "by test_native",
    )
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    simd = BEST if args.simd == "best" else SIMD_LEVELS[args.simd]
    builds, caps = {}, {}
    for item in args.builds:
        label, _, path = item.partition("=")
        path, _, level = (path or label).partition("@")
        if level and level not in SIMD_LEVELS:
            levels = ", ".join(SIMD_LEVELS)
            raise SystemExit(f"{item}: no kernel level {level!r} (levels: {levels})")
        builds[label] = Kernels.load(None if path == "installed" else path)
        caps[label] = SIMD_LEVELS[level] if level else simd
    model = NativeModel(args.model, capacity=args.context + max(widths) + 8, simd=simd)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.vocab, args.context)

    def chain(label: str, tokens: np.ndarray, start: int, first_logit: int) -> np.ndarray:
        """A chain of tokens at slots start.. below the cached prefix 0..start-1."""
        model.kernels = builds[label]
        model.struct.simd = caps[label]
        n = len(tokens)
        visible = np.concatenate([np.arange(start, start + i + 1) for i in range(n)])
        offsets = np.concatenate([[0], np.cumsum(np.arange(1, n + 1))])
        return model.forward(
            tokens,
            np.arange(start, start + n),
            start=start,
            prefix=start,
            offsets=offsets,
            visible=visible,
            first_logit=first_logit,
            threads=args.threads,
        )

    def forward(label: str, tokens: np.ndarray) -> np.ndarray:
        return chain(label, tokens, args.context, 0)

    # the prefix once, by the first build (every build then reads the same cache)
    chain(next(iter(builds)), prompt, 0, args.context - 1)
    times: dict[tuple[str, int], list[float]] = {(b, w): [] for b in builds for w in widths}
    differ: dict[str, float] = {}
    chains = {w: rng.integers(0, model.vocab, w) for w in widths}
    references: dict[int, np.ndarray] = {}
    # every repeat times each width of each build back to back, so that T(w) / T(1) can be
    # taken within a repeat: this VM's speed drifts over seconds, less within one
    for _ in range(args.repeats):
        for w in widths:
            for label in builds:
                began = time.perf_counter()
                logits = forward(label, chains[w])
                times[label, w].append((time.perf_counter() - began) * 1000)
                if w not in references:
                    references[w] = logits
                elif not np.array_equal(references[w], logits):
                    if not args.bits_may_differ:
                        raise SystemExit(f"{label} at w={w}: logits differ from the first build's")
                    gap = float(np.abs(references[w] - logits).max())
                    differ[label] = max(differ.get(label, 0.0), gap)
    print_table(args, builds, widths, times, differ)


def print_table(args, builds, widths, times, differ) -> None:
    same = (
        "logits bit-identical across builds"
        if not differ
        else "logits differ from the "
        "first build's: " + ", ".join(f"{b} by at most {gap:.2g}" for b, gap in differ.items())
    )
    print(
        f"{args.model}: {args.threads} threads, {args.context} tokens cached, median of "
        f"{args.repeats}, builds interleaved; {same}"
    )
    print("| build | " + " | ".join(f"T({w}) ms" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for label in builds:
        cells = []
        for i, w in enumerate(widths):
            cell = f"{statistics.median(times[label, w]):.2f}"
            if i:  # the median of each repeat's own T(w) / T(first width)
                ratios = [
                    t / t1 for t, t1 in zip(times[label, w], times[label, widths[0]], strict=True)
                ]
                cell += f" ({statistics.median(ratios):.2f}x)"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"(in brackets: the median over the repeats of T(w) / T({widths[0]}) within a repeat)")


if __name__ == "__main__":
    main()
