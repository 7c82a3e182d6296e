"""``python -m hetspec.bench.hcmp``: Ghidorah's split verifier (HCMP) and ARCA's choice,
measured on this box and replayed on simulated unified-memory boards.

    python -m hetspec.bench.hcmp [--widths 1,2,4,8,16,32,64] [--out docs/bench/hcmp.md]

1. The profile on this box: the bundled target verified by ``HcmpRuntime`` with both sides on
   this CPU (one after the other, ``--threads`` each), every (width, ratio) timed after a
   ``--prefix``-token prefix; the acceptance of each width and tree shape calibrated with the
   bundled draft against the target's greedy text; ARCA's choice from both. Here the split
   can only show its overhead: there is no second processor.
2. The simulated boards (speculative/control/unified_board.py): each side's work in the
   forward (the bundled target's as its forward recorded it; a Vicuna-7B-shaped target's from
   the same work model, with the paper's Table I acceptance) replayed at a Jetson-class
   board's roofline, the link at zero cost: the better of GPU-only and CPU-only verification
   against the best split, width by width, and ARCA's choice against each side alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from hetspec.arguments import positive, positive_list
from hetspec.protocol.config_shape import ConfigShape
from hetspec.speculative.control.arca import Profile, choose
from hetspec.speculative.control.hcmp_work import forward_work
from hetspec.speculative.control.unified_board import (
    Board,
    forward_seconds,
    orin_nx_full_clocks,
    xavier_nx_as_the_paper_ran_it,
)
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.workers.runtimes.torch_runtime import TorchRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_profiler import (
    emitted_per_round,
    recorded_work,
    verify_costs,
)
from hetspec.workers.runtimes.torch_runtime.hcmp_runtime import HcmpRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_sides import HcmpSettings, Side

BUNDLED = Path(__file__).resolve().parents[1] / "models"
PROMPTS = [
    "def read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef walk(folder):\n",
]
PREFIX_TEXT = (
    "import json\nimport os\n\n\ndef load_settings(path, defaults=None):\n"
    '    """Read the settings at path, falling back to defaults."""\n'
    "    if not os.path.exists(path):\n        return dict(defaults or {})\n"
    "    with open(path) as handle:\n        data = json.load(handle)\n"
    "    for key, value in (defaults or {}).items():\n        data.setdefault(key, value)\n"
    "    return data\n\n\nclass Cache:\n    def __init__(self, folder):\n"
    "        self.folder = folder\n        self.entries = {}\n\n    def get(self, key):\n"
)
# Ghidorah, Table I: acceptance length (tokens a step emits) of Medusa's trees on Vicuna-7B,
# MT-bench, at verification widths 1-64
PAPER_EMITTED = {1: 1.0, 2: 1.72, 4: 2.28, 8: 2.59, 16: 2.93, 32: 3.19, 64: 3.34}
VICUNA_7B = ConfigShape(
    layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000
)
BOARD_RATIOS = [r / 20 for r in range(21)]
BOARD_CONTEXT = 256  # Ghidorah's evaluation: a KV cache of about 256


def ratio_list(text: str) -> list[float]:
    ratios = [float(part) for part in text.split(",")]
    if not all(0.0 <= r <= 1.0 for r in ratios) or not {0.0, 1.0} <= set(ratios):
        raise argparse.ArgumentTypeError("ratios in [0, 1], 0 and 1 among them")
    return sorted(set(ratios))


def profile_here(args: argparse.Namespace) -> tuple[HcmpRuntime, list[int], dict, dict]:
    side = Side("cpu", threads=args.threads)
    target = HcmpRuntime(
        args.target, HcmpSettings(1.0, gpu=side, cpu=side), dtype="float32", max_context=512
    )
    prefix = target.tokenize(PREFIX_TEXT * 4)[: args.prefix]
    costs = verify_costs(target, prefix, args.widths, args.ratios, repeats=args.repeats)
    draft = TorchRuntime(args.draft, device="cpu", dtype="float32", max_context=512)
    prompts = [target.tokenize(p) for p in PROMPTS]
    emitted = emitted_per_round(target, draft, prompts, args.widths)
    return target, prefix, costs, emitted


def same_tokens(target: HcmpRuntime, prefix: list[int], ratio: float) -> bool:
    """Greedy text at ``ratio`` against the unsplit runtime's (ratio 1), 32 tokens."""
    texts = []
    base = target.settings
    for r in (1.0, ratio):
        target.set_split(HcmpSettings(r, gpu=base.gpu, cpu=base.cpu))
        target.prefill(prefix[:64])
        texts.append(target.decode(32, SamplingParams(), DrawnSampler(0)))
    target.set_split(base)
    return texts[0] == texts[1]


def ms_text(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def profile_table(costs: dict, ratios: list[float], widths: list[int]) -> list[str]:
    lines = [
        "| width | " + " | ".join(f"r={r:g}" for r in ratios) + " |",
        "|---:|" + "---:|" * len(ratios),
    ]
    for w in widths:
        lines.append(f"| {w} | " + " | ".join(ms_text(costs[w, r]) for r in ratios) + " |")
    return lines


def emitted_table(emitted: dict, widths: list[int]) -> list[str]:
    shapes = sorted({s for _, s in emitted})
    lines = ["| width | " + " | ".join(shapes) + " |", "|---:|" + "---:|" * len(shapes)]
    for w in widths:
        lines.append(f"| {w} | " + " | ".join(f"{emitted[w, s]:.2f}" for s in shapes) + " |")
    return lines


def choice_line(profile: Profile) -> str:
    c = choose(profile)
    return (
        f"ARCA's choice: width {c.width}, {c.tree}, ratio {c.ratio:g}: {ms_text(c.ms)} ms a "
        f"verification, {c.tokens_per_s:.1f} tokens/s ({c.gain:.2f}x the unsplit verifier "
        "at that width)"
    )


def board_rows(board: Board, work_of, emitted: dict[int, float], widths: list[int]) -> list[str]:
    """Per width: GPU-only, CPU-only and the best split (ms on ``board``), and the rates;
    then ARCA's choice against each side alone at its own best width."""
    ms = {
        (w, r): 1000 * forward_seconds(work_of(w, r), board) for w in widths for r in BOARD_RATIOS
    }
    lines = [
        "| width | emitted | GPU only ms | CPU only ms | best split | split ms | "
        "split / better side |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in widths:
        alone = min(ms[w, 0.0], ms[w, 1.0])
        split = min((r for r in BOARD_RATIOS if 0 < r < 1), key=lambda r: ms[w, r])
        lines.append(
            f"| {w} | {emitted[w]:.2f} | {ms_text(ms[w, 1.0])} | {ms_text(ms[w, 0.0])} | "
            f"r={split:g} | {ms_text(ms[w, split])} | {alone / ms[w, split]:.2f}x |"
        )
    profile = Profile(ms, {(w, "tree"): emitted[w] for w in widths})
    choice = choose(profile)

    def rate(ratio: float) -> tuple[float, int]:
        return max((1000 * emitted[w] / ms[w, ratio], w) for w in widths)

    (gpu, gpu_w), (cpu, cpu_w) = rate(1.0), rate(0.0)
    lines += [
        "",
        choice_line(profile),
        "",
        f"GPU only at its best width ({gpu_w}): {gpu:.1f} tokens/s; CPU only ({cpu_w}): "
        f"{cpu:.1f} tokens/s; ARCA's choice: **{choice.tokens_per_s / max(gpu, cpu):.2f}x** "
        "the better of them.",
    ]
    return lines


def report(args: argparse.Namespace) -> str:
    torch.set_num_threads(args.threads)
    target, prefix, costs, emitted = profile_here(args)
    shape = ConfigShape.from_config(json.loads((args.target / "config.json").read_text()))
    best_emitted = {w: max(n for (x, _), n in emitted.items() if x == w) for w in args.widths}
    here = choose(Profile(costs, emitted))
    out = [
        "# HCMP and ARCA (Ghidorah, #75)",
        "",
        f"`python -m hetspec.bench.hcmp {' '.join(args.argv)}` on {platform.node()} "
        f"({platform.machine()}, {torch.get_num_threads()} torch thread(s) a side, torch "
        f"{torch.__version__}), {datetime.date.today().isoformat()}.",
        "",
        "## 1. The profile on this box (both sides on this CPU, no GPU)",
        "",
        f"The bundled target ({shape.parameters / 1e6:.1f}M weights, float32) verifying a chain "
        f"of `width` draft nodes after {len(prefix)} tokens; median ms of {args.repeats} "
        "forwards at each GPU-side share `r` (0 and 1: the unsplit runtime). Both sides are "
        "this CPU and run one after the other: the split can only add its overhead here.",
        "",
        *profile_table(costs, args.ratios, args.widths),
        "",
        "Tokens a greedy round emits (accepted + the verifier's own), the bundled draft's trees "
        f"against the target's greedy text ({len(PROMPTS)} prompts):",
        "",
        *emitted_table(emitted, args.widths),
        "",
        choice_line(Profile(costs, emitted))
        + (" — the unsplit runtime, as expected here." if here.ratio in (0.0, 1.0) else "."),
        "",
        f"Greedy text split at r=0.5 identical to the unsplit runtime's: "
        f"{same_tokens(target, prefix, 0.5)}.",
        "",
        "## 2. Simulated unified-memory boards",
        "",
        "Each side's work in the forward replayed at the board's roofline "
        "(speculative/control/unified_board.py): per step, the slower side or the shared "
        "DRAM's time for both sides' bytes; no link (zero cost). fp16 weights; "
        f"{BOARD_CONTEXT} cached tokens. A model of a board, not a measurement.",
    ]
    context = min(len(prefix), BOARD_CONTEXT)
    recorded = {  # the split forwards' own record; the unsplit ones' from the work model
        (w, r): recorded_work(target, prefix[:context], w, r)
        for w in args.widths
        for r in BOARD_RATIOS
        if 0 < r < 1
    }

    def bundled(w: int, r: float) -> list:
        if (w, r) in recorded:
            return recorded[w, r]
        return forward_work(shape, width=w, committed=context, ratio=r)

    def vicuna(w: int, r: float) -> list:
        return forward_work(VICUNA_7B, width=w, committed=BOARD_CONTEXT, ratio=r)

    for board in (xavier_nx_as_the_paper_ran_it(), orin_nx_full_clocks()):
        out += ["", f"### {board.name}", "", f"Figures: {board.source}.", ""]
        out += ["Vicuna-7B shape, acceptance from Ghidorah's Table I (MT-bench, Medusa trees):"]
        out += ["", *board_rows(board, vicuna, PAPER_EMITTED, sorted(PAPER_EMITTED)), ""]
        out += ["The bundled target (its forward's recorded work), the bundled pair's acceptance:"]
        out += ["", *board_rows(board, bundled, best_emitted, args.widths)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.bench.hcmp", description=__doc__)
    parser.add_argument("--target", type=Path, default=BUNDLED / "target")
    parser.add_argument("--draft", type=Path, default=BUNDLED / "draft")
    parser.add_argument("--widths", type=positive_list, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--ratios", type=ratio_list, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--prefix", type=positive, default=128)
    parser.add_argument("--repeats", type=positive, default=7)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    text = report(args)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
