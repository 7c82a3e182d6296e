"""``python -m hetspec.workers.bench_widths``: T(w), one forward of w tokens, in every runtime.

    python -m hetspec.workers.bench_widths [--sizes 100m,300m] [--widths 1,2,4,8,16]

For each heavy target (made in the cache when absent) it times, after a 128-token prefix, one
forward of w chained tokens in: llama.cpp Q8_0 and Q4_0 (the verifier's settings), hetspec's
native kernels on the same Q8_0 and Q4_0 files, torch f32, and torch with fbgemm's dynamic int8
linear layers. Each runs in a process of its own, pinned to the same cores, one after the
other (never two at once: they would share the cores). Prints a markdown table of medians
and each runtime's T(w) / T(1); ``--json`` writes the figures too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from hetspec.workers.benchmarking import positive_int_list

SYSTEMS = {  # name -> (runtime, the heavy model's file, settings)
    "llama.cpp Q8_0": ("llama.cpp", "q8_0", '{"type":"llama.cpp","flash_attention":"off",'
                       '"kv_type":"f16","v_type":"f32"}'),
    "llama.cpp Q4_0": ("llama.cpp", "q4_0", '{"type":"llama.cpp","flash_attention":"off",'
                       '"kv_type":"f16","v_type":"f32"}'),
    "native Q8_0": ("native", "q8_0", '{"type":"native"}'),
    "native Q4_0": ("native", "q4_0", '{"type":"native"}'),
    "torch f32": ("torch", "folder", '{"type":"torch","device":"cpu","dtype":"float32"}'),
    "torch fbgemm int8": ("torch-int8", "folder", ""),
}  # fmt: skip


def measure_one(runtime: str, model: str, settings: str, widths: list[int], repeats: int) -> dict:
    """One system's medians, measured in a fresh process; {"error": ...} when it fails."""
    shape = ["--widths", ",".join(map(str, widths)), "--repeats", str(repeats)]
    if runtime == "torch-int8":
        command = [sys.executable, "-m", "hetspec.workers.bench_widths", "--int8-in-process",
                   model, *shape]  # fmt: skip
    else:
        command = [sys.executable, "-m", "hetspec.workers.profile", runtime, model,
                   "--settings", settings, *shape]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        report = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        said = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exited with {result.returncode}: {said}"}
    if "median_ms" not in report:
        return {"error": report.get("message", "no figures")}
    return {"median_ms": report["median_ms"]}


def int8_in_process(folder: str, widths: list[int], repeats: int) -> None:
    """torch f32 with every linear layer swapped for fbgemm's dynamic int8 one (activations
    quantized per tensor: a token's logits then depend on the batch, so it cannot verify
    losslessly; it is here as the shape a batched int8 kernel gives)."""
    import torch  # noqa: PLC0415

    from hetspec.workers.profile import forward_medians  # noqa: PLC0415
    from hetspec.workers.torch_runtime import TorchRuntime  # noqa: PLC0415

    runtime = TorchRuntime(folder, device="cpu", dtype="float32", max_context=1024,
                           threads=len(os.sched_getaffinity(0)))  # fmt: skip
    # the decoder layers' linears; the output head stays f32 (the runtime reads its weight)
    runtime.model.model = torch.ao.quantization.quantize_dynamic(
        runtime.model.model, {torch.nn.Linear}, dtype=torch.qint8
    )
    medians = forward_medians(runtime, widths=widths, prefix=128, repeats=repeats)
    print(json.dumps({"median_ms": medians}))


def table(results: dict[str, dict[str, dict]], widths: list[int]) -> str:
    lines = []
    for size, systems in results.items():
        lines += [f"\n### heavy-{size}: T(w) in ms (T(w) / T(1) in brackets)\n",
                  "| runtime | " + " | ".join(f"w={w}" for w in widths) + " |",
                  "|---|" + "---:|" * len(widths)]  # fmt: skip
        for name, figures in systems.items():
            if "error" in figures:
                lines.append(f"| {name} | skipped: {figures['error']} |")
                continue
            ms = figures["median_ms"]
            cells = [f"{t:.2f} ({t / ms[0]:.2f}x)" for t in ms]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.workers.bench_widths", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--sizes", default="100m,300m", help="heavy targets (default 100m,300m)")
    parser.add_argument("--widths", type=positive_int_list, default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated names of the rows to measure")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--int8-in-process", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.int8_in_process:
        int8_in_process(args.int8_in_process, args.widths, args.repeats)
        return 0
    from hetspec.models.heavy import HeavyModelError, ensure_heavy  # noqa: PLC0415

    chosen = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    results: dict[str, dict[str, dict]] = {}
    for size in args.sizes.split(","):
        try:
            heavy = ensure_heavy(size.strip(), ("q8_0", "q4_0"), None)
        except HeavyModelError as error:
            print(f"heavy-{size}: {error}", file=sys.stderr)
            return 1
        results[size] = {}
        for name in chosen:
            runtime, file, settings = SYSTEMS[name]
            model = str(heavy.folder if file == "folder" else heavy.gguf(file))
            print(f"heavy-{size}: {name} ...", file=sys.stderr, flush=True)
            results[size][name] = measure_one(runtime, model, settings, args.widths,
                                              args.repeats)  # fmt: skip
    print(table(results, args.widths))
    if args.json:
        args.json.write_text(json.dumps({"widths": args.widths, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
