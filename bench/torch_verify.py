"""Micro-benchmark: how long one tree verification takes against the tree's width.

    python -m hetspec.bench.torch_verify --model DIR [--contexts 128,512,2048]

For each committed context length it times a forward of a drafted tree of 1, 2, 4 ... 64 nodes
(a chain by default; ``--shape star`` for independent one-token branches, ``tree`` for four
equal branches from the root, a comma-separated list for several) and prints the median
latency. This T_verify(width) curve is what the budget controller starts from: while
verifying w tokens costs little more than verifying one, longer drafts and more branches pay.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler
from hetspec.speculative.verify.tree import chain_parents
from hetspec.workers.runtimes.torch_runtime import ModelLoadError, TorchRuntime
from hetspec.workers.runtimes.torch_runtime.static_forward import INVARIANT_PATHS, MIN_SPAN
from hetspec.workers.runtimes.tree_runtime import TreeRuntime
from hetspec.workers.tools.timing import positive_int, positive_int_list, timed_ms

DEFAULT_MODEL = Path(__file__).resolve().parents[1].parent / "models" / "target"


SHAPES = ("chain", "star", "tree")


def tree_parents(shape: str, width: int) -> np.ndarray:
    """A drafted tree's parents: a chain, ``width`` siblings (star), or four equal branches
    (tree; fewer where ``width`` < 4, the last branch the longest)."""
    if shape == "star":
        return np.full(width, -1)
    if shape == "tree":
        branches = min(4, width)
        starts = {b * (width // branches) for b in range(branches)}
        return np.array([-1 if i in starts else i - 1 for i in range(width)])
    return chain_parents(width)


def shape_list(text: str) -> list[str]:
    shapes = [item.strip() for item in text.split(",") if item.strip()]
    if not shapes or any(shape not in SHAPES for shape in shapes):
        raise argparse.ArgumentTypeError(f"shapes are {', '.join(SHAPES)}, not {text!r}")
    return shapes


def time_forward(runtime: TorchRuntime, tokens: np.ndarray, parents: np.ndarray, repeats: int):
    """Median and quartiles of forward_tree latency (ms); the tree is discarded after each run."""
    synchronize = torch.cuda.synchronize if runtime.device.type == "cuda" else lambda: None

    def forward() -> None:
        runtime.forward_tree(tokens, parents)
        synchronize()

    # warm-up: allocator, kernels, caches, compilation
    result = timed_ms(forward, repeats, warmup=3)
    runtime.discard_pending()
    return result


def profile_forward(
    runtime: TorchRuntime, tokens: np.ndarray, parents: np.ndarray, repeats: int, top: int = 12
) -> dict:
    """Where one forward's time goes, by torch's profiler: on CUDA the device's busy time (its
    kernels, replayed graphs' included) against the wall time per forward, and the kernels
    that take most; on the CPU the operators that take most. Returns the same as a row."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = runtime.device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        began = time.perf_counter()
        for _ in range(repeats):
            runtime.forward_tree(tokens, parents)
            synchronize()
            runtime.discard_pending()
        wall = (time.perf_counter() - began) * 1000 / repeats
    device = DeviceType.CUDA if cuda else DeviceType.CPU
    totals: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type != device or (not cuda and event.cpu_parent is not None):
            continue  # on the CPU only top-level operators: their children are inside them
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us() / 1000 / repeats
        entry[1] += 1
    busy = sum(ms for ms, _ in totals.values())
    what = "kernels on the GPU" if cuda else "top-level operators on the CPU"
    print(
        f"profile, {len(tokens)} tokens a forward, {repeats} forwards: {wall:.3f} ms a forward "
        f"(profiled), {what} {busy:.3f} ms ({busy / wall:.0%} of it)"
    )
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    for name, (ms, count) in ranked:
        print(f"  {ms:8.3f} ms {count / repeats:6.1f}x  {name[:90]}")
    return {
        "width": len(tokens),
        "wall_ms": round(wall, 3),
        "busy_ms": round(busy, 3),
        "top": [
            {"name": n, "ms": round(ms, 4), "per_forward": c / repeats} for n, (ms, c) in ranked
        ],
    }


def time_decode(runtime: TorchRuntime, steps: int, repeats: int) -> dict:
    """ms a token decoding alone, ``steps`` tokens a call (``steps`` - 1 forwards), greedily
    and sampled (T = 0.8, keyed): the runtime's own decode (in fixed shapes its forwards
    queued on the device, each next token chosen there) against ``TreeRuntime``'s host loop
    (a wait for the device a token). The sampled keys start with ``sampled_``."""
    synchronize = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda: None)
    start, row = len(runtime.tokens), {"steps": steps}

    def rewind() -> None:  # back to the context, its last token's logits known again
        runtime.rollback(start)
        runtime.last_logits()
        synchronize()

    modes = (
        ("", "greedily", SamplingParams(), DrawnSampler(0)),
        ("sampled_", "sampled", SamplingParams(temperature=0.8), KeyedSampler(1)),
    )
    for prefix, how, params, sampler in modes:
        for name, decode in (("queued", TorchRuntime.decode), ("host_loop", TreeRuntime.decode)):
            call = partial(decode, runtime, steps, params, sampler)
            median, _, _ = timed_ms(call, repeats, setup=rewind)
            row[f"{prefix}{name}_ms_a_token"] = round(median / (steps - 1), 4)
        runtime.rollback(start)
        queued, host = row[f"{prefix}queued_ms_a_token"], row[f"{prefix}host_loop_ms_a_token"]
        print(
            f"decoding alone {how}, {steps} tokens a call, median of {repeats}: {queued:.3f} "
            f"ms a token with its forwards queued on the device, {host:.3f} ms in the host's "
            f"loop ({host / queued:.2f}x)",
            flush=True,
        )
    return row


def invariance_rows(runtime: TorchRuntime, widths: list[int], rng) -> list[dict]:
    """For each width: how far a chain's logits evaluated w tokens a forward are from the same
    tokens one a forward (max |difference|, rows not bit-identical, argmax flips). The chain
    crosses the first attention-span bucket's end, so spans are compared too."""
    vocab, length = runtime.config.vocab_size, max(widths)
    prompt = rng.integers(0, vocab, size=MIN_SPAN - length // 2).tolist()
    chain = rng.integers(0, vocab, size=length)
    runtime.prefill(prompt)
    alone = []
    for token in chain:
        alone.append(runtime.forward_tree([int(token)], [-1]).logits[0].float().cpu())
        runtime.commit([0])
    alone = torch.stack(alone)
    print(f"{'width':>6} {'max |diff|':>11} {'rows differ':>12} {'argmax flips':>13}")
    rows = []
    for width in widths:
        runtime.rollback(len(prompt))
        outputs = []
        for begin in range(0, length, width):
            part = chain[begin : begin + width]
            outputs.append(runtime.forward_tree(part, chain_parents(len(part))).logits.cpu())
            runtime.commit(list(range(len(part))))
        together = torch.cat(outputs).float()
        differ = int((together != alone).any(-1).sum())
        flips = int((together.argmax(-1) != alone.argmax(-1)).sum())
        worst = float((together - alone).abs().max())
        rows.append(
            {
                "width": width,
                "max_abs_diff": worst,
                "rows_differ": differ,
                "argmax_flips": flips,
                "rows": length,
            }
        )
        print(f"{width:>6} {worst:>11.3g} {f'{differ}/{length}':>12} {flips:>13}", flush=True)
    if length >= 16:
        rows.append(tree_row(runtime, prompt, chain))
    else:
        print("  tree: not compared (a 4 x 4 tree needs widths up to 16)", flush=True)
    runtime.rollback(0)
    return rows


def tree_row(runtime: TorchRuntime, prompt: list[int], chain: np.ndarray) -> dict:
    """A tree of four branches of four tokens (one forward of four paths, where a fixed-width
    forward gathers four) against each branch evaluated as a chain (a one-path forward where
    ``chain_forwards``): the same tokens, the same keys, other shapes."""
    branches = [chain[4 * b : 4 * b + 4] for b in range(4)]
    runtime.rollback(len(prompt))
    as_chains = []
    for branch in branches:
        as_chains.append(runtime.forward_tree(branch, chain_parents(4)).logits.float().cpu())
        runtime.discard_pending()
    tokens = np.concatenate(branches)
    tree = runtime.forward_tree(tokens, tree_parents("tree", 16)).logits.float().cpu()
    runtime.discard_pending()
    alone = torch.cat(as_chains)
    differ = int((tree != alone).any(-1).sum())
    flips = int((tree.argmax(-1) != alone.argmax(-1)).sum())
    worst = float((tree - alone).abs().max())
    print(
        f"{'tree':>6} {worst:>11.3g} {f'{differ}/16':>12} {flips:>13}   (4 branches of 4 "
        "against each branch as a chain)",
        flush=True,
    )
    return {
        "width": "tree 4x4",
        "max_abs_diff": worst,
        "rows_differ": differ,
        "argmax_flips": flips,
        "rows": 16,
    }


def tiling_fields(text: str) -> dict[str, int]:
    """``block_n=32,warps=8`` -> {"block_n": 32, "warps": 8} (an empty text: {})."""
    try:
        return {
            key.strip(): int(value)
            for key, value in (item.split("=") for item in text.split(",") if item.strip())
        }
    except ValueError:
        raise argparse.ArgumentTypeError(f"not FIELD=N,...: {text!r}") from None


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.torch_verify", description=__doc__
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (each fixed shape at load, with its CUDA graph)",
    )
    parser.add_argument(
        "--matmul",
        choices=["torch", "triton"],
        default="torch",
        help="linear layers of at most 16 rows: cuBLAS, or hetspec's Triton kernel",
    )
    parser.add_argument(
        "--matmul-tiling",
        type=tiling_fields,
        default={},
        metavar="FIELD=N,...",
        help="--matmul triton: the kernel's tiling, e.g. block_n=32,warps=8 (see "
        "skinny_matmul.Tiling; bench_matmul times tilings)",
    )
    parser.add_argument(
        "--weights",
        choices=["dtype", "int8"],
        default="dtype",
        help="int8: every linear layer's weight in int8 with a scale per row, read by the "
        "Triton kernel (the int8 model: its logits are not the dtype's)",
    )
    parser.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        help="CUDA: run the fixed shapes eagerly, not as CUDA graphs",
    )
    parser.add_argument(
        "--fixed-width",
        type=int,
        default=0,
        help="every forward this many rows (a width-invariant verifier's "
        "shape); 0: width buckets on CUDA, the call's shape on the CPU",
    )
    parser.add_argument(
        "--paths",
        type=int,
        default=INVARIANT_PATHS,
        help="tree paths a fixed-width forward gathers",
    )
    parser.add_argument(
        "--no-chain-forwards",
        dest="chain_forwards",
        action="store_false",
        help="fixed width: chains in the shape trees use too (all paths), not one-path forwards",
    )
    parser.add_argument(
        "--no-chain-in-place",
        dest="chain_in_place",
        action="store_false",
        help="fixed width: chains in the cache's order gather their path like other chains, "
        "not attend to the cache in place",
    )
    parser.add_argument(
        "--attention",
        choices=["gathered", "split"],
        default="gathered",
        help="fixed width: rows attend to their paths gathered, or split (the cache in place "
        "up to a point their position fixes, their path's last keys gathered)",
    )
    parser.add_argument(
        "--no-span-buckets",
        dest="span_buckets",
        action="store_false",
        help="attend over the whole context in every forward",
    )
    parser.add_argument(
        "--invariance",
        action="store_true",
        help="also compare each width's chain logits with one token at a time",
    )
    parser.add_argument(
        "--profile-width",
        type=int,
        default=0,
        metavar="W",
        help="also profile forwards of W tokens at the last context: where the time goes",
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="N",
        help="also time greedy decoding alone at the last context, N tokens a call, forwards "
        "queued on the device against the host's loop",
    )
    parser.add_argument("--contexts", type=positive_int_list, default=[128, 512, 1536])
    parser.add_argument("--widths", type=positive_int_list, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--shape",
        type=shape_list,
        default=["chain"],
        help="drafted trees: chain, star, tree (four branches), or a comma-separated list",
    )
    parser.add_argument("--repeats", type=positive_int, default=30)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)

    try:
        capacity = max(args.contexts) + max(*args.widths, args.decode)
        if args.invariance:  # its chain crosses the first span bucket's end
            capacity = max(capacity, MIN_SPAN + max(args.widths))
        runtime = TorchRuntime(
            args.model,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            max_context=capacity,
            compile=args.compile,
            cuda_graphs=args.graphs,
            fixed_width=args.fixed_width,
            span_buckets=args.span_buckets,
            invariant_paths=args.paths,
            chain_forwards=args.chain_forwards,
            chain_in_place=args.chain_in_place,
            attention=args.attention,
            matmul=args.matmul,
            matmul_tiling=args.matmul_tiling,
            weights=args.weights,
        )
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    vocab = runtime.config.vocab_size
    refused = runtime.split_kernel_refused
    print(
        f"model {args.model} ({sum(p.numel() for p in runtime.model.parameters()) / 1e6:.1f}M "
        f"parameters) on {runtime.device} {str(runtime.dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}; "
        f"{runtime.graphs} CUDA graphs{', compiled' if args.compile else ''}, "
        f"fixed width {runtime.fixed_width or 'none'}"
        f"{', chains in place' if runtime.chains_in_place else ''}"
        f"{', split attention' if runtime.attention == 'split' else ''}"
        f"{' (Triton kernel)' if runtime.split_kernel else ''}"
        f"{f' (kernel refused: {refused})' if refused else ''}, "
        f"matmul {'triton' if runtime.weights == 'int8' else args.matmul}"
        + "".join(f" {field}={value}" for field, value in args.matmul_tiling.items())
        + (", int8 weights" if runtime.weights == "int8" else "")
        + (f" (kernel refused: {runtime.matmul_refused}; cuBLAS)" if runtime.matmul_refused else "")
    )
    print(
        f"{'context':>8} {'shape':>6} {'width':>6} {'ms':>9} {'p25-p75':>15} {'ms/token':>9} "
        f"{'x w=1':>6}"
    )
    rows = []
    for context in args.contexts:
        runtime.prefill(rng.integers(0, vocab, size=context).tolist())
        base = None
        for shape in args.shape:
            for width in args.widths:
                tokens = rng.integers(0, vocab, size=width)
                parents = tree_parents(shape, width)
                median, p25, p75 = time_forward(runtime, tokens, parents, args.repeats)
                base = base or median
                rows.append(
                    {
                        "context": context,
                        "shape": shape,
                        "width": width,
                        "median_ms": round(median, 3),
                        "p25_ms": round(p25, 3),
                        "p75_ms": round(p75, 3),
                    }
                )
                print(
                    f"{context:>8} {shape:>6} {width:>6} {median:>9.3f} "
                    f"{f'{p25:.2f}-{p75:.2f}':>15} {median / width:>9.3f} {median / base:>6.2f}",
                    flush=True,
                )
        if args.profile_width > 0 and context == args.contexts[-1]:
            width = args.profile_width
            parents = tree_parents(args.shape[0], width)
            profiled = profile_forward(
                runtime, rng.integers(0, vocab, size=width), parents, args.repeats
            )
        if args.decode > 1 and context == args.contexts[-1]:
            decoding = time_decode(runtime, args.decode, args.repeats)
    invariance = invariance_rows(runtime, args.widths, rng) if args.invariance else []
    if args.json:
        meta = {
            "model": str(args.model),
            "device": str(runtime.device),
            "shape": args.shape,
            "dtype": str(runtime.dtype),
            "threads": torch.get_num_threads(),
            "graphs": runtime.graphs,
            "fixed_width": runtime.fixed_width,
            "chains_in_place": runtime.chains_in_place,
            "attention": runtime.attention,
            "split_kernel": runtime.split_kernel,
            "split_kernel_refused": runtime.split_kernel_refused,
            "compile": args.compile,
            "matmul": args.matmul,
            "matmul_tiling": args.matmul_tiling,
            "weights": runtime.weights,
            "matmul_refused": runtime.matmul_refused,
        }
        document = {**meta, "rows": rows, "invariance": invariance}
        if args.profile_width > 0:
            document["profile"] = profiled
        if args.decode > 1:
            document["decode"] = decoding
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
