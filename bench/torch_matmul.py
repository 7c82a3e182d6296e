"""Time a verifier's linear layers alone on CUDA: cuBLAS against hetspec's Triton kernel.

For each weight shape of a model (heavy-1b's by default) and each row count, one call's time
in a CUDA graph of many calls (no launch gaps), the weight's bytes over that time (the HBM
bandwidth the call reaches), and whether each tiling keeps a row's bits whatever rows come
with it. The tiling with the best sum over a forward's shapes is the one to use. With
``--weights int8`` the Triton cells read int8 weights with a scale per row (int8_weights.py:
half the bytes), cuBLAS still the dtype's:

    python -m hetspec.bench.torch_matmul [--rows 1,16] [--weights int8]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch.nn import functional as F

from hetspec.workers.runtimes.torch_runtime.int8_weights import quantize_rows
from hetspec.workers.runtimes.torch_runtime.skinny_matmul import (
    DEFAULT_TILING,
    MAX_ROWS,
    Tiling,
    skinny_linear,
    unavailable_reason,
)

# heavy-1b: (name, out features, in features, how many a forward has)
HEAVY_1B = (
    ("q, o", 4096, 4096, 10),
    ("k, v", 2048, 4096, 10),
    ("gate, up", 11264, 4096, 10),
    ("down", 4096, 11264, 5),
    ("head", 4096, 4096, 1),
)
TILINGS = {
    "default": DEFAULT_TILING,
    "no split": Tiling(programs_per_sm=0),  # one program per column block, no second kernel
    "2 per SM": Tiling(programs_per_sm=2),
    "8 per SM": Tiling(programs_per_sm=8),
    "n 32": Tiling(block_n=32),
    "n 128, 8 warps": Tiling(block_n=128, warps=8),
    "k 256, 3 stages": Tiling(block_k=256, stages=3),
    "k 256": Tiling(block_k=256),  # int8's tile of a bfloat16 one's bytes
}
CALLS = 50  # calls in one graph


def changed_fields(tiling: Tiling) -> dict[str, int]:
    """The fields where ``tiling`` differs from the default (gpu_worker.matmul_tiling's)."""
    return {
        field: value
        for field, value in asdict(tiling).items()
        if value != getattr(DEFAULT_TILING, field)
    }


def time_call(call, repeats: int) -> float:
    """Microseconds a call, from a CUDA graph of ``CALLS`` calls replayed ``repeats`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles, allocates
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * CALLS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.torch_matmul",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", default="1,16", help="row counts, comma-separated")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--weights",
        choices=["dtype", "int8"],
        default="dtype",
        help="the Triton kernel's weights: the dtype's, or int8 with a scale "
        "per row (cuBLAS reads the dtype's either way)",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available() or (reason := unavailable_reason(device)):
        print(
            "error: needs a CUDA device and Triton"
            + (f" ({reason})" if torch.cuda.is_available() else ""),
            file=sys.stderr,
        )
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    if not all(0 < r <= MAX_ROWS for r in rows_list):
        print(f"error: --rows must be in 1..{MAX_ROWS}", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    int8 = args.weights == "int8"
    print(
        f"{torch.cuda.get_device_name()}, {args.dtype}"
        + (", the Triton cells' weights int8" if int8 else "")
        + f"; us a call (GB/s of weight), {CALLS} calls a graph x {args.repeats}"
    )
    results, totals = [], {}
    for name, n, k, count in HEAVY_1B:
        weight = torch.randn(n, k, device=device).to(dtype) / k**0.5
        quantized, scale = quantize_rows(weight) if int8 else (weight, None)

        def ours(x, tiling, quantized=quantized, scale=scale):
            return skinny_linear(x, quantized, tiling=tiling, scale=scale)

        for rows in rows_list:
            x = torch.randn(rows, k, device=device).to(dtype)
            row = {"shape": name, "n": n, "k": k, "rows": rows}
            cells = [("cuBLAS", lambda x=x, w=weight: F.linear(x, w), None)]
            cells += [(label, lambda x=x, t=t: ours(x, t), t) for label, t in TILINGS.items()]
            line = [f"{name:>9} {n:>5}x{k:<5} rows {rows:>2}:"]
            for label, call, tiling in cells:
                us = time_call(call, args.repeats)
                row[label] = round(us, 2)
                totals[(label, rows)] = totals.get((label, rows), 0.0) + us * count
                size = (weight if tiling is None else quantized).element_size()
                line.append(f"{label} {us:.1f} ({n * k * size / us / 1e3:.0f})")
                if tiling is not None and rows > 1:  # a row's bits alone and among others
                    row[f"{label} invariant"] = bool(torch.equal(ours(x[:1], tiling), call()[:1]))
            results.append(row)
            print(" | ".join(line), flush=True)
    size = 1 if int8 else torch.tensor([], dtype=dtype).element_size()
    weights = sum(n * k * count for _, n, k, count in HEAVY_1B)
    print(
        f"a forward's linear layers ({weights * size / 1e9:.2f} GB of weight for the Triton "
        f"cells), us:"
    )
    for rows in rows_list:
        cells = [f"{label} {totals[(label, rows)]:.0f}" for label in ["cuBLAS", *TILINGS]]
        print(f"  rows {rows:>2}: " + ", ".join(cells))
    broken = [
        (r["shape"], r["rows"], label)
        for r in results
        for label in TILINGS
        if r.get(f"{label} invariant") is False
    ]
    print(
        "every tiling kept a row's bits among other rows"
        if not broken
        else f"!! rows changed with their company: {broken}"
    )
    if args.json:
        summary = {f"{label} rows {rows}": round(us, 1) for (label, rows), us in totals.items()}
        tilings = {label: changed_fields(tiling) for label, tiling in TILINGS.items()}
        document = {
            "rows": results,
            "forward_us": summary,
            "tilings": tilings,
            "weights": args.weights,
        }
        args.json.write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
