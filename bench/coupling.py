"""``python -m hetspec.bench.coupling``: how often the target accepts drafted tokens
under each way of sampling, keyed (a seeded request) or speculative sampling (no seed).

    python -m hetspec.bench.coupling [--target bundled,heavy-100m] [--prompts 4]

Both are lossless; they differ in how the drafter's and the target's randomness are coupled,
hence in acceptance. Keyed: a drafted token is accepted when it is the target's own
Gumbel-max choice under the same noise. Speculative sampling (maximal coupling): accepted with
probability min(1, p/q), so 1 - TV(p, q) per token, the most any coupling reaches. Each
(temperature, shape) runs the same prompts through one daemon at a fixed draft shape
(sequential mode), once with a seed per request and once without; prints a markdown table of
accepted / drafted and tokens per round.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hetspec.arguments import positive
from hetspec.bench.compare import daemon, prompt_set
from hetspec.bench.targets import TargetError, resolve

TEMPERATURES = (0.3, 0.7, 1.0)
SHAPES = {"chain, gamma 4": {"gamma": 4}, "3 branches, gamma 4": {"gamma": 4, "branches": 3}}


def measure(client, prompts: list[str], max_tokens: int) -> list[dict]:
    rows = []
    for temperature in TEMPERATURES:
        for shape, options in SHAPES.items():
            for scheme in ("keyed", "speculative sampling"):
                drafted = accepted = rounds = tokens = 0
                for index, prompt in enumerate(prompts):
                    seed = {"seed": 7000 + index} if scheme == "keyed" else {}
                    done = client.generate(
                        prompt,
                        max_tokens=max_tokens,
                        ignore_eos=True,
                        temperature=temperature,
                        mode="sequential",
                        **options,
                        **seed,
                    )
                    drafted += done.timings["draft_n"]
                    accepted += done.timings["draft_n_accepted"]
                    rounds += done.speculative["rounds"]
                    tokens += len(done.tokens) - 1  # the first comes from the prefill
                rows.append(
                    {
                        "temperature": temperature,
                        "shape": shape,
                        "scheme": scheme,
                        "acceptance": accepted / drafted,
                        "tokens_per_round": tokens / rounds,
                        "drafted": drafted,
                    }
                )
            print(f"  temperature {temperature} {shape}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| temperature | draft shape | keyed: accepted / drafted | speculative sampling: "
        "accepted / drafted | keyed: tokens per round | speculative sampling: tokens per "
        "round |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    pairs = {}
    for row in rows:
        pairs.setdefault((row["temperature"], row["shape"]), {})[row["scheme"]] = row
    for (temperature, shape), by in pairs.items():
        keyed, maximal = by["keyed"], by["speculative sampling"]
        lines.append(
            f"| {temperature} | {shape} | {keyed['acceptance']:.3f} | "
            f"{maximal['acceptance']:.3f} | {keyed['tokens_per_round']:.2f} | "
            f"{maximal['tokens_per_round']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.coupling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--target",
        default="bundled",
        help="comma-separated: bundled, heavy-100m, heavy-300m, ... (default: bundled)",
    )
    parser.add_argument(
        "--prompts",
        type=positive,
        default=16,
        help="code prompts besides the 4 chat ones (default: 16)",
    )
    parser.add_argument("--max-tokens", type=positive, default=64)
    parser.add_argument("--placement", default="draft-cpu")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    prompts, results = prompt_set(args.prompts), {}
    for spec in args.target.split(","):
        try:
            target = resolve(spec, None)
        except TargetError as error:
            print(f"hetspec bench_coupling: {error}", file=sys.stderr)
            return 2
        print(f"{spec}: {len(prompts)} prompts x {args.max_tokens} tokens", file=sys.stderr)
        with daemon(args.placement, None, Path(tempfile.mkdtemp()), target) as client:
            results[spec] = measure(client, prompts, args.max_tokens)
        print(f"\n### {spec} ({args.placement})\n\n{table(results[spec])}\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
