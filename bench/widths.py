"""``python -m hetspec.bench.widths``: T(w), one forward of w tokens, in every runtime.

    python -m hetspec.bench.widths [--sizes 100m,300m] [--widths 1,2,4,8,16] [--prefix 128]

For each heavy target (made in the cache when absent) it times, after a 128-token prefix (the
bench's prompts and answers reach 200-700: attention grows with them), one
forward of w chained tokens in: llama.cpp Q8_0, Q4_0 and Q4_K_M (the verifier's settings),
hetspec's native kernels on the same files, torch f32, and torch with fbgemm's dynamic int8
linear layers. Each runs in a worker-side process of its own (``hetspec.workers.tools.profile``) on
the same cores, one after the other (never two at once: they would share the cores). Prints a
markdown table of medians and each runtime's T(w) / T(1); ``--json`` writes the figures too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hetspec.arguments import positive, positive_list
from hetspec.models.heavy import HeavyModelError, ensure_heavy

SYSTEMS = {  # name -> (runtime, the heavy model's file, settings)
    "llama.cpp Q8_0": (
        "llama.cpp",
        "q8_0",
        '{"type":"llama.cpp","flash_attention":"off","kv_type":"f16","v_type":"f32"}',
    ),
    "llama.cpp Q4_0": (
        "llama.cpp",
        "q4_0",
        '{"type":"llama.cpp","flash_attention":"off","kv_type":"f16","v_type":"f32"}',
    ),
    "llama.cpp Q4_K_M": (
        "llama.cpp",
        "q4_k_m",
        '{"type":"llama.cpp","flash_attention":"off","kv_type":"f16","v_type":"f32"}',
    ),
    "native Q8_0": ("native", "q8_0", '{"type":"native"}'),
    "native Q4_0": ("native", "q4_0", '{"type":"native"}'),
    "native Q4_K_M": ("native", "q4_k_m", '{"type":"native"}'),
    # the same kernels capped at AVX-VNNI (256-bit vpdpbusd, Intel's client CPUs) and at AVX2
    # (where the CPU has more): what vpdpbusd is worth
    "native Q8_0 AVX-VNNI": ("native", "q8_0", '{"type":"native","simd":"avx_vnni"}'),
    "native Q8_0 AVX2": ("native", "q8_0", '{"type":"native","simd":"avx2"}'),
    "native Q4_0 AVX2": ("native", "q4_0", '{"type":"native","simd":"avx2"}'),
    "torch f32": ("torch", "folder", '{"type":"torch","device":"cpu","dtype":"float32"}'),
    "torch fbgemm int8": ("torch", "folder", '{"type":"torch","device":"cpu","dtype":"float32"}'),
}


def measure_one(
    name: str, model: str, *, widths: list[int], repeats: int, prefix: int = 128
) -> dict:
    """System ``name``'s medians, measured in a fresh process; {"error": ...} when it fails."""
    runtime, _, settings = SYSTEMS[name]
    command = [
        sys.executable,
        "-m",
        "hetspec.workers.tools.profile",
        runtime,
        model,
        "--settings",
        settings,
        "--widths",
        ",".join(map(str, widths)),
        "--repeats",
        str(repeats),
        "--prefix",
        str(prefix),
    ]
    if "fbgemm" in name:
        command.append("--fbgemm-int8")
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        report = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        said = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exited with {result.returncode}: {said}"}
    if "median_ms" not in report:
        return {"error": report.get("message", "no figures")}
    return {"median_ms": report["median_ms"]}


def table(results: dict[str, dict[str, dict]], widths: list[int], prefix: int = 128) -> str:
    lines = []
    for size, systems in results.items():
        title = f"heavy-{size}: T(w) in ms after {prefix} tokens (T(w) / T(1) in brackets)"
        lines += [
            f"\n### {title}\n",
            "| runtime | " + " | ".join(f"w={w}" for w in widths) + " |",
            "|---|" + "---:|" * len(widths),
        ]
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
        prog="python -m hetspec.bench.widths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="100m,300m", help="heavy targets (default 100m,300m)")
    parser.add_argument("--widths", type=positive_list, default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--prefix",
        type=positive,
        default=128,
        help="tokens of context before the timed forward (default 128)",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated names of the rows to measure"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    results: dict[str, dict[str, dict]] = {}
    for size in args.sizes.split(","):
        try:
            files = {SYSTEMS[name][1] for name in chosen} - {"folder"}
            heavy = ensure_heavy(size.strip(), sorted(files), None)
        except HeavyModelError as error:
            print(f"heavy-{size}: {error}", file=sys.stderr)
            return 1
        results[size] = {}
        for name in chosen:
            file = SYSTEMS[name][1]
            model = str(heavy.folder if file == "folder" else heavy.gguf(file))
            print(f"heavy-{size}: {name} ...", file=sys.stderr, flush=True)
            results[size][name] = measure_one(
                name, model, widths=args.widths, repeats=args.repeats, prefix=args.prefix
            )
    print(table(results, args.widths, args.prefix))
    if args.json:
        args.json.write_text(
            json.dumps({"widths": args.widths, "prefix": args.prefix, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
