"""Bench: the target split into pipeline stages (``hetspec-stage`` processes on loopback, CURVE
on every link), with and without speculation, at several link delays.

    python -m hetspec.bench.pipeline --target ~/.cache/hetspec/heavy-100m \\
        --stages 3 --link-ms 0,2 --prompts 4 --tokens 48

Systems, all greedy and checked against each other token for token:
- plain pipeline: one token at a time through every stage (no draft);
- naive pipelined speculation: the drafter's tree as one segment, the next tree only after
  its verdict (the pipeline holds one segment at a time);
- FlowSpec, no expansion: the tree in score order, cut into segments, one per stage in
  flight, the tree advanced as each segment's logits arrive and the drafter asked again from
  the new root;
- FlowSpec: the same, and while the root waits with every node sent, the drafter expands the
  likeliest leaf (daemon/pipeline/drafter.py);
- llama.cpp RPC: the target's GGUF (16-bit) in a llama.cpp worker with every layer on as many
  ``hetspec-rpc-server`` processes as there are stages (llama.cpp splits them), each behind a
  relay that delays every chunk by the link time; the target alone, one token at a time (its
  text is llama.cpp's, not compared). What a user reaches for first (docs/beyond-one-box.md).
The drafter is the llama.cpp draft model in a real worker process (EAGLE-2 trees: depth, top-k
and size below). With ``--layers auto`` (the default) each link delay runs twice: on the even
split of whole layers, then on the split the first run's FlowSpec stage costs choose
(speculative/flow/layer_split.py). Stage processes and the drafter share this machine's cores:
on a box with fewer cores than processes they compete, which a real multi-host pipeline
would not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import uvloop

from hetspec.daemon.pipeline.coordinator import (
    PipelineError,
    PipelineStats,
    no_draft,
    pipeline_decode,
)
from hetspec.daemon.pipeline.drafter import PipelineDrafter, TreeShape
from hetspec.daemon.pipeline.local_stages import LocalRpcServers, LocalStages
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec, WorkerStartError
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.protocol.config_shape import ConfigShape
from hetspec.protocol.sampling import SamplingParams
from hetspec.speculative.flow.layer_split import (
    SplitError,
    balanced_split,
    counts_split,
    even_split,
    format_range,
    stage_weights,
)
from hetspec.speculative.flow.pipeline_clock import CostProfile, PipelineClock

BUNDLED = Path(__file__).resolve().parents[1] / "models"
PROMPTS = [
    "def read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef walk(folder):\n",
    "def fibonacci(n):\n",
    "def merge_sorted(a, b):\n",
    "def parse_args(argv):\n",
]


@dataclass
class Row:
    system: str
    link_ms: float
    tokens: int
    seconds: float  # on this box
    clock: PipelineClock
    stats: PipelineStats
    texts: list[list[int]] = field(default_factory=list)

    def line(self, stages: int, profile: CostProfile, layers: str) -> str:
        s = self.stats
        simulated, utilization = self.clock.timeline(stages, self.link_ms / 1000, profile)
        used = " / ".join(f"{u:.0%}" for u in utilization)
        return (
            f"| {self.system} | {layers} | {self.link_ms:g} | "
            f"{self.tokens / self.seconds:6.1f} | "
            f"{self.tokens / simulated:6.1f} | {used} | "
            f"{s.nodes_sent / max(s.segments, 1):4.1f} | "
            f"{self.tokens / max(s.commits, 1):4.2f} |"
        )


async def run_system(client, drafter, prompts, *, tokens, system, link_ms, **schedule) -> Row:
    total = PipelineStats()
    seconds, produced, texts = 0.0, 0, []
    clock = PipelineClock()
    for prompt in prompts:
        if drafter is not no_draft:
            await drafter.start(prompt)
        start = time.perf_counter()
        out, stats = await pipeline_decode(client, prompt, tokens, drafter, clock=clock, **schedule)
        seconds += time.perf_counter() - start
        produced += len(out)
        texts.append(out)
        for name in ("segments", "nodes_sent", "nodes_back", "commits"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
    return Row(system, link_ms, produced, seconds, clock, total, texts)


def splits(args, shape: ConfigShape) -> list[tuple[int, int]] | None:
    """The first split to run (``--layers``); None, with the reason printed, if it is bad."""
    try:
        if args.layers in ("even", "auto"):
            return even_split(shape.layers, args.stages)
        counts = [float(n) for n in args.layers.split(",")]
        if len(counts) != args.stages:
            raise SplitError(f"{len(counts)} counts for {args.stages} stages")
        return counts_split(counts, shape.layers)
    except (SplitError, ValueError) as error:
        print(f"error: --layers {args.layers}: {error}", file=sys.stderr)
        return None


async def run(args: argparse.Namespace) -> int:
    target = Path(args.target).expanduser()
    shape = ConfigShape.from_config(json.loads((target / "config.json").read_text()))
    if (bounds := splits(args, shape)) is None:
        return 2
    tokenizer_prompts = tokenize(target, PROMPTS[: args.prompts])
    print(
        f"target {target.name}: {shape.layers} layers in {args.stages} stages; draft "
        f"{args.draft.name}; tree depth {args.depth}, top-k {args.top_k}, {args.size} nodes; "
        f"{args.prompts} prompts x {args.tokens} tokens; {os.cpu_count()} cores "
        "here"
    )
    print()
    print(
        "| system | layers | link ms | tok/s here | tok/s, a device per stage | stage "
        "utilization (a device per stage) | nodes per segment | tokens per commit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="hetspec-bench-pipeline-") as folder:
        arena_name = f"/dev/shm/hetspec-bench-pipeline-{os.getpid()}"
        with Arena.create(arena_name, slots=1, slot_bytes=1 << 20) as arena:
            settings = m.LlamaCppSettings(n_ctx=2048, threads=1)
            spec = WorkerSpec("cpu", "llama.cpp", str(args.draft), settings, log_format="console")
            worker = WorkerClient(spec, Path(folder), 1, arena.layout)
            try:
                await worker.start(load_timeout_s=120)
            except WorkerStartError as error:
                print(f"error: {error}", file=sys.stderr)
                return 1
            try:
                tree = TreeShape(args.depth, args.top_k, args.size, expand_steps=args.expand)
                drafters = (
                    PipelineDrafter(worker, arena, replace(tree, expand_steps=0)),
                    PipelineDrafter(worker, arena, tree),
                )
                for link_ms in args.link_ms:
                    here = Path(folder) / f"link{link_ms:g}"
                    here.mkdir()
                    run_split = bounds
                    for attempt in range(2 if args.layers == "auto" else 1):
                        (sub := here / f"split{attempt}").mkdir()
                        stages = LocalStages(sub, target, run_split, link_ms=link_ms)
                        flowspec = await on_stages(
                            stages, drafters, tokenizer_prompts, args, link_ms
                        )
                        if flowspec is None or args.layers != "auto" or attempt:
                            break
                        run_split = split_by_cost(shape, run_split, flowspec, args, link_ms)
                    if args.rpc:
                        await rpc_row(here, target, tokenizer_prompts, args, link_ms, arena=arena)
            finally:
                await worker.stop()
    return 0


async def on_stages(stages: LocalStages, drafters, prompts, args, link_ms: float):
    """``compare`` on ``stages``, stopped after."""
    try:
        stages.wait()
        return await compare(stages, drafters, prompts, args, link_ms)
    finally:
        stages.stop()


def split_by_cost(shape: ConfigShape, bounds, flowspec: tuple, args, link_ms: float):
    """The split whose slowest stage is fastest, from each stage's busy time per parameter in
    FlowSpec's replayed run on ``bounds`` (the first stage computes rows the later ones never
    see: pruned in flight)."""
    row, profile = flowspec
    seconds, utilization = row.clock.timeline(args.stages, link_ms / 1000, profile)
    weights = stage_weights(shape, bounds)
    rates = [u * seconds / w for u, w in zip(utilization, weights, strict=True)]
    chosen = balanced_split(shape, rates)
    ranges = ", ".join(format_range(a, b) for a, b in chosen)
    per_mparam = " / ".join(f"{r * 1e6 * 1000 / max(row.tokens, 1):.3f}" for r in rates)
    print(
        f"| split by measured cost: {ranges} (FlowSpec's busy ms per Mparam per token, by "
        f"stage: {per_mparam}) | | | | | | | |",
        flush=True,
    )
    return chosen


async def rpc_row(folder: Path, target: Path, prompts, args, link_ms: float, *, arena) -> None:
    """The llama.cpp RPC row: the target alone, its layers on ``args.stages`` rpc-servers."""
    gguf = next(iter(sorted(target.glob("*-f16.gguf"))), None)
    if gguf is None:
        print(
            f"| llama.cpp RPC | - | {link_ms:g} | - | - | - | - | - | (no *-f16.gguf in {target})"
        )
        return
    servers = LocalRpcServers(folder, args.stages, link_ms=link_ms)
    worker = None
    try:
        servers.wait()
        await servers.start_links()
        settings = m.LlamaCppSettings(
            n_ctx=2048, threads=1, gpu_layers=-1, rpc_servers=tuple(servers.endpoints)
        )
        spec = WorkerSpec("gpu", "llama.cpp", str(gguf), settings, log_format="console")
        worker = WorkerClient(spec, folder, 2, arena.layout)
        await worker.start(load_timeout_s=300)
        seconds, produced = 0.0, 0
        for index, prompt in enumerate([prompts[0], *prompts]):  # the first warms up
            await worker.call(m.Prefill(request=worker.next_request(), tokens=prompt))
            start = time.perf_counter()
            decode = m.Decode(
                request=worker.next_request(), steps=args.tokens, sampling=SamplingParams()
            )
            reply, _ = await worker.call(decode)
            if index:
                seconds += time.perf_counter() - start
                produced += len(reply.tokens)
        print(
            f"| llama.cpp RPC ({args.stages} servers, target alone) | llama.cpp's | "
            f"{link_ms:g} | {produced / seconds:6.1f} | - | - | - | - |",
            flush=True,
        )
    except (WorkerStartError, RuntimeError) as error:
        print(f"error: llama.cpp RPC: {error}", file=sys.stderr)
    finally:
        if worker is not None:
            await worker.stop()
        await servers.close_links()
        servers.stop()


async def compare(stages, drafters, prompts, args, link_ms):
    """The systems on running stages, one table row each; FlowSpec's row (with expansion)
    and the cost profile its replay used, or None if the pipeline failed."""
    plain_tree, drafter = drafters
    client = stages.client(timeout_s=30)
    layers = " + ".join(f"{(b - a) / 2:g}" for a, b in stages.bounds)
    try:
        runs = [
            ("plain pipeline", no_draft, {"segment_size": 1, "in_flight": 1}),
            (
                "naive pipelined speculation",
                plain_tree,
                {"segment_size": args.size + 1, "in_flight": 1},
            ),
            (
                "FlowSpec, no expansion",
                plain_tree,
                {"segment_size": args.segment, "in_flight": args.stages},
            ),
            (
                "FlowSpec",
                drafter,
                {"segment_size": args.segment, "in_flight": args.stages, "expand": drafter.expand},
            ),
        ]
        await pipeline_decode(client, prompts[0], 8, no_draft, segment_size=1, in_flight=1)
        rows = []
        for system, draft, schedule in runs:
            rows.append(
                await run_system(
                    client,
                    draft,
                    prompts,
                    tokens=args.tokens,
                    system=system,
                    link_ms=link_ms,
                    **schedule,
                )
            )
        # stage compute times as measured while one segment at a time was in flight (each
        # stage computing alone): the plain pipeline's and the naive speculation's
        profile = CostProfile()
        for row in rows[:2]:
            row.clock.measured(profile)
        for row in rows:
            print(row.line(args.stages, profile, layers), flush=True)
        print(
            f"(FlowSpec's expansion drafted {drafter.expanded_nodes} nodes below leaves, "
            f"{drafter.expanded_nodes / max(rows[-1].tokens, 1):.2f} a token)",
            file=sys.stderr,
        )
        drafter.expanded_nodes = 0
        if any(row.texts != rows[0].texts for row in rows):
            print("MISMATCH: the systems' greedy texts differ", file=sys.stderr)
        return rows[-1], profile
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return None
    finally:
        client.close()


def tokenize(target: Path, prompts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer  # noqa: PLC0415

    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    return [tokenizer.encode(p).ids for p in prompts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.pipeline", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target", required=True, help="the target's model folder")
    parser.add_argument("--draft", type=Path, default=BUNDLED / "draft" / "draft-q8_0.gguf")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument(
        "--link-ms", default="0,2", help="comma-separated link delays (ms, each message and hop)"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--size", type=int, default=8, help="nodes drafted per tree")
    parser.add_argument("--segment", type=int, default=3, help="FlowSpec's nodes per segment")
    parser.add_argument(
        "--expand",
        type=int,
        default=TreeShape.expand_steps,
        help="tokens per expansion chain below the likeliest leaf while the root waits (0: none)",
    )
    parser.add_argument(
        "--layers",
        default="auto",
        help="layers per stage: 'even' (whole layers, as even as they go), counts such as "
        "2.5,2.5,3 (halves split a layer after its attention), or 'auto' (default: even, "
        "then again split by the stage costs FlowSpec measured on the even split)",
    )
    parser.add_argument(
        "--no-rpc", dest="rpc", action="store_false", help="skip the llama.cpp RPC row"
    )
    args = parser.parse_args(argv)
    if not (Path(args.target) / "config.json").is_file():
        parser.error(
            f"--target {args.target}: not a model folder (its config.json is missing); "
            "the stages load a Hugging Face folder, not a GGUF file"
        )
    try:
        args.link_ms = [float(x) for x in args.link_ms.split(",")]
    except ValueError:
        parser.error(f"--link-ms {args.link_ms!r}: expected comma-separated milliseconds")
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
