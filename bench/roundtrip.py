"""Micro-benchmark: one daemon -> worker -> daemon round trip carrying a probability row.

    python -m hetspec.bench.roundtrip [--model GGUF] [--floats 32768] [--count 5000]
        [--gap-us 0] [--spin-us 100] [--hold-us 0] [--daemon-spin-us 0] [--json PATH]

Starts a real llama.cpp worker process (with the bundled draft model unless told otherwise),
then times ``Echo`` calls from the daemon's asyncio/uvloop side: the daemon writes a row into
an arena slot, the worker copies it into another slot, the daemon reads the answer in place.
For comparison it also sends the row as a message frame both ways. Each is timed over both
links, in turn: the shared-memory mailboxes (where supported) and ZeroMQ alone. Every
speculative round pays this hop at least twice, so it must stay far below a draft step.
With ``--hold-us`` the worker computes that long before each answer (the daemon waits, as
through a verification) and the times given are the round trips less it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec, WorkerStartError
from hetspec.protocol import Arena, ArrayRef, frame_array
from hetspec.protocol import worker_messages as m
from hetspec.protocol.mailbox import supported as mailboxes_supported

LINKS = {"mailbox": "mailboxes", "zmq": "ZeroMQ alone"}

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "draft" / "draft-q8_0.gguf"


async def time_calls(
    call, count: int, check, gap_us: float = 0.0, hold_us: float = 0.0
) -> list[float]:
    """Round-trip times (us) of ``count`` awaits of ``call()``, each ``gap_us`` after the last
    answer (the daemon busy meanwhile, as between a round's calls: the worker polls, then
    sleeps), less the ``hold_us`` the worker computes for each, every answer checked."""
    samples = []
    for index in range(count):
        until = time.perf_counter() + gap_us / 1e6
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        reply, frames = await call()
        check(reply, frames)
        if index >= count // 10:  # the first tenth warms caches and the allocator
            samples.append((time.perf_counter() - start) * 1e6 - hold_us)
    return samples


async def run(args: argparse.Namespace) -> int:
    row = np.random.default_rng(0).random(args.floats, dtype=np.float32)
    cores = sorted(os.sched_getaffinity(0))
    worker_cores = tuple(cores[-1:])
    if len(cores) > 1:  # as in the daemon: the worker owns its core, the daemon uses the others
        os.sched_setaffinity(0, cores[:-1])
    links = ["mailbox", "zmq"] if mailboxes_supported() else ["zmq"]
    samples: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hetspec-bench-") as runtime_dir:
        name = f"/dev/shm/hetspec-bench-{os.getpid()}"
        with Arena.create(name, slots=2, slot_bytes=row.nbytes) as arena:
            for turn in range(args.turns):  # links in turn: the box's drift hits each alike
                for link in links:
                    spec = WorkerSpec(
                        "cpu",
                        "llama.cpp",
                        str(args.model),
                        m.LlamaCppSettings(n_ctx=256, threads=1),
                        cores=worker_cores,
                        log_format="console",
                        spin_us=args.spin_us,
                        mailbox=link == "mailbox",
                        reply_spin_us=args.daemon_spin_us,
                    )
                    generation = len(samples) + 1  # fresh endpoints for each worker
                    client = WorkerClient(spec, Path(runtime_dir), generation, arena.layout)
                    try:
                        await client.start(load_timeout_s=120)
                    except WorkerStartError as error:
                        print(f"error: {error}", file=sys.stderr)
                        return 1
                    try:
                        timed = await time_link(client, arena, row, args)
                    finally:
                        await client.stop()
                    for kind, answers in timed.items():
                        samples[link, kind, turn] = answers
    kib = row.nbytes / 1024
    print(
        f"round trip daemon -> worker -> daemon, {args.floats} float32 ({kib:.0f} KiB) each "
        f"way, {args.turns} x {args.count - args.count // 10} calls after warm-up per link, "
        f"{args.gap_us:g} us apart, the worker polling {args.spin_us:g} us before it "
        f"sleeps, holding each answer {args.hold_us:g} us (not counted), the daemon polling "
        f"{args.daemon_spin_us:g} us after each call"
    )
    merged: dict[tuple[str, str], list[float]] = {}
    for (link, kind, _), answers in samples.items():
        merged.setdefault((link, kind), []).extend(answers)
    medians = {}
    for (link, kind), times in merged.items():
        q = statistics.quantiles(times, n=10)
        label = f"{LINKS[link]}, {kind}"
        medians[label] = round(statistics.median(times), 1)
        print(f"  {label:<42} median {medians[label]:7.1f} us   p10 {q[0]:7.1f}   p90 {q[-1]:7.1f}")
    if args.json is not None:
        document = {
            "floats": args.floats,
            "gap_us": args.gap_us,
            "spin_us": args.spin_us,
            "hold_us": args.hold_us,
            "daemon_spin_us": args.daemon_spin_us,
            "median_us": medians,
        }
        args.json.write_text(json.dumps(document))
    return 0


async def time_link(client: WorkerClient, arena: Arena, row: np.ndarray, args) -> dict:
    """Echo round trips of ``row`` through an arena slot and as message frames."""
    arena.empty(0, row.shape)[:] = row
    in_slot = ArrayRef(row.dtype.str, row.shape, slot=0)

    async def via_arena():
        echo = m.Echo(request=client.next_request(), data=in_slot, out=1, hold_us=args.hold_us)
        return await client.call(echo)

    def arena_answer(reply, frames):
        assert arena.view(reply.data)[-1] == row[-1]

    async def via_frames():
        data = ArrayRef(row.dtype.str, row.shape, frame=1)
        echo = m.Echo(request=client.next_request(), data=data, hold_us=args.hold_us)
        return await client.call(echo, (row,))

    def framed_answer(reply, frames):
        assert frame_array(reply.data, frames)[-1] == row[-1]

    timing = {"gap_us": args.gap_us, "hold_us": args.hold_us}
    return {
        "shared-memory arena": await time_calls(via_arena, args.count, arena_answer, **timing),
        "message frames": await time_calls(via_frames, args.count, framed_answer, **timing),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.bench.roundtrip", description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF the worker loads")
    parser.add_argument("--floats", type=int, default=32768, help="length of the row")
    parser.add_argument("--count", type=int, default=5000, help="calls per link and turn")
    parser.add_argument("--turns", type=int, default=2, help="times each link is timed, in turn")
    parser.add_argument(
        "--spin-us", type=float, default=100.0, help="the worker's poll before it sleeps"
    )
    parser.add_argument(
        "--gap-us",
        type=float,
        default=0.0,
        help="time between an answer and the next call (longer than --spin-us: the worker "
        "sleeps, and the call pays its wake-up)",
    )
    parser.add_argument(
        "--hold-us",
        type=float,
        default=0.0,
        help="the worker computes this long before each answer (the daemon waits, as through "
        "a verification); not counted in the times",
    )
    parser.add_argument(
        "--daemon-spin-us",
        type=float,
        default=0.0,
        help="the daemon polls the replies this long after each call instead of sleeping "
        "until one wakes it (daemon_spin_us)",
    )
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args(argv)
    cores = os.sched_getaffinity(0)
    try:
        return uvloop.run(run(args))
    finally:  # run leaves the worker's core to it; a caller in this process gets it back
        os.sched_setaffinity(0, cores)


if __name__ == "__main__":
    sys.exit(main())
