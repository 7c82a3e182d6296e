"""``python -m hetspec.bench.head``: Dovetail's draft head against the draft model.

    python -m hetspec.bench.head [--prompts 8] [--max-tokens 96] [--ablation DIR]
                                        [--heavy 300m] [--out bench-results]

1. Acceptance on the bundled target (as Dovetail's Table III): the draft-gpu placement
   drafting with the independent draft model, with the bundled head and, given
   ``--ablation``, with every head folder under DIR (plain fusion or DGF, 0..4 blocks); a
   chain of gamma 4 (a verified width of 5), greedy and at temperature 1 (speculative
   sampling). Mean drafted tokens accepted per round, and decode tokens/s. Then EAGLE-2's
   dynamic trees (``draft_tree``: 4 layers, the 3 likeliest nodes of each expanded): at most
   4 verified nodes (the chain's width), and as many as the measured costs make pay; the
   nodes verified per round are in the table.
2. Speed on a heavy target: draft-gpu's default mode drafting with the head (the heavy
   folder's draft-head, the bundled head widened) against the draft model, each daemon twice
   in turn; the head's greedy output is checked against the target alone on the same daemon.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from hetspec.arguments import positive
from hetspec.bench.compare import daemon, prompt_set
from hetspec.bench.targets import TargetError, resolve
from hetspec.client.types import HetspecError

MODELS = Path(__file__).resolve().parents[1] / "models"
GAMMA = 4
TEMPERATURES = (0.0, 1.0)
DRAFT_MODEL = ("draft model", ['draft_head="none"'])
TREE = "draft_tree=3"
TREES = [
    ("draft model, dynamic tree, <= 4 nodes", ['draft_head="none"', TREE, "max_tree_nodes=6"]),
    ("head, dynamic tree, <= 4 nodes", [TREE, "max_tree_nodes=6"]),
    ("head, dynamic tree, width by cost", [TREE]),
]


def acceptance(client, prompts: list[str], max_tokens: int) -> dict:
    """Per temperature: drafted tokens accepted per round, and decode tokens/s."""
    rows = {}
    for temperature in TEMPERATURES:
        accepted = rounds = nodes = 0
        rates = []
        for prompt in prompts:
            done = client.generate(
                prompt,
                max_tokens=max_tokens,
                ignore_eos=True,
                temperature=temperature,
                mode="sequential",
                gamma=GAMMA,
            )
            accepted += done.timings["draft_n_accepted"]
            rounds += done.speculative["rounds"]
            nodes += done.speculative.get("verified_nodes", 0)
            rates.append(done.timings["predicted_per_second"])
        rows[temperature] = {
            "accepted_per_round": accepted / rounds,
            "rounds": rounds,
            "nodes_per_round": nodes / rounds,
            "tokens_per_s": statistics.mean(rates),
        }
    return rows


def head_systems(ablation: Path | None) -> list[tuple[str, list[str]]]:
    systems = [DRAFT_MODEL, ("head: DGF, 2 blocks (bundled)", []), *TREES]
    if ablation is not None:
        for folder in sorted(p for p in ablation.iterdir() if (p / "head_config.json").exists()):
            shape = json.loads((folder / "head_config.json").read_text())
            fusion = "DGF" if shape["fusion"] == "dgf" else "plain fusion"
            systems.append(
                (
                    f"head: {fusion}, {shape['blocks']} blocks ({folder.name})",
                    [f"draft_head={json.dumps(str(folder))}"],
                )
            )
    return systems


def acceptance_table(results: dict[str, dict]) -> list[str]:
    base = results[DRAFT_MODEL[0]]
    lines = [
        "| drafter | accepted/round, greedy | x draft model | nodes/round | tok/s | "
        "accepted/round, T = 1 | x draft model | nodes/round | tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        cells = []
        for temperature in TEMPERATURES:
            row, ratio = (
                rows[temperature],
                rows[temperature]["accepted_per_round"] / base[temperature]["accepted_per_round"],
            )
            cells += [
                f"{row['accepted_per_round']:.2f}",
                f"{ratio:.2f}x",
                f"{row['nodes_per_round']:.2f}",
                f"{row['tokens_per_s']:.0f}",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def speed(target, prompts: list[str], max_tokens: int, out: Path) -> list[str]:
    """draft-gpu's default mode, head against draft model, alternating; greedy checked."""
    systems = [("head", []), DRAFT_MODEL, ("head, dynamic tree", [TREE])]
    rates: dict[str, list[float]] = {name: [] for name, _ in systems}
    alone: list[float] = []
    mismatches = {name: 0 for name, _ in systems if name != DRAFT_MODEL[0]}
    for turn in range(2):
        for name, settings in systems:
            log = f"{target.name}-{name.replace(' ', '-')}-{turn}"
            with daemon("draft-gpu", None, out, target, settings=settings, name=log) as client:
                runtime = (client.props().get("gpu_runtime") or {}).get("runtime", "?")
                print(
                    f"{target.name} {name} (GPU worker: {runtime}), turn {turn + 1}",
                    file=sys.stderr,
                    flush=True,
                )
                client.generate(prompts[0], max_tokens=16)  # warm-up
                for prompt in prompts:
                    done = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
                    rates[name].append(done.timings["predicted_per_second"])
                    if name in mismatches and turn == 0:
                        own = client.generate(
                            prompt, max_tokens=max_tokens, ignore_eos=True, mode="autoregressive"
                        )
                        if name == "head":
                            alone.append(own.timings["predicted_per_second"])
                        mismatches[name] += own.tokens != done.tokens
    head, draft = statistics.mean(rates["head"]), statistics.mean(rates[DRAFT_MODEL[0]])
    tree = statistics.mean(rates["head, dynamic tree"])
    return [
        f"draft-gpu, default mode, {len(prompts)} prompts x {max_tokens} tokens, each daemon "
        "twice in turn (decode tokens/s, mean of requests):\n",
        "| drafter | tok/s | x draft model |",
        "|---|---|---|",
        f"| draft model | {draft:.1f} | 1.00x |",
        f"| head | {head:.1f} | {head / draft:.2f}x |",
        f"| head, dynamic tree | {tree:.1f} | {tree / draft:.2f}x |",
        f"| the target alone (autoregressive, the head's daemon) | {statistics.mean(alone):.1f}"
        f" | {statistics.mean(alone) / draft:.2f}x |",
        "",
        *(
            f"Greedy output of the daemon drafting with the {name} equal to the target alone "
            f"(on the same daemon) on {len(prompts) - count} of {len(prompts)} prompts."
            for name, count in mismatches.items()
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.bench.head")
    parser.add_argument("--prompts", type=positive, default=8)
    parser.add_argument("--max-tokens", type=positive, default=96)
    parser.add_argument(
        "--ablation",
        type=Path,
        default=None,
        help="a folder of head folders to compare too (train_head.py --out)",
    )
    parser.add_argument("--heavy", default="300m", help="the heavy target of part 2 ('' skips)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_set(args.prompts)[: args.prompts]
    report = [
        "# Draft head against draft model\n",
        f"## Acceptance on the bundled target: draft-gpu, a chain of gamma {GAMMA}, "
        f"{len(prompts)} prompts x {args.max_tokens} tokens\n",
    ]
    try:
        results = {}
        for name, settings in head_systems(args.ablation):
            log = "head-" + "".join(c if c.isalnum() else "-" for c in name)
            with daemon("draft-gpu", None, args.out, settings=settings, name=log) as client:
                print(f"acceptance: {name}", file=sys.stderr, flush=True)
                client.generate(prompts[0], max_tokens=16)  # warm-up
                results[name] = acceptance(client, prompts, args.max_tokens)
        report += [*acceptance_table(results), ""]
        if args.heavy:
            target = resolve(f"heavy-{args.heavy}", None)
            report += [
                f"## Speed on {target.name}\n",
                *speed(target, prompts, args.max_tokens, args.out),
                "",
            ]
    except (HetspecError, TargetError) as error:
        print(f"bench_head: {error}", file=sys.stderr)
        return 1
    text = "\n".join(report)
    (args.out / "bench-head.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
