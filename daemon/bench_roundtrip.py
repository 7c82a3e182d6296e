"""Micro-benchmark: one daemon -> worker -> daemon round trip carrying a probability row.

    python -m hetspec.daemon.bench_roundtrip [--model GGUF] [--floats 32768] [--count 5000]

Starts a real llama.cpp worker process (with the bundled draft model unless told otherwise),
then times ``Echo`` calls from the daemon's asyncio/uvloop side: the daemon writes a row into
an arena slot, the worker copies it into another slot, the daemon reads the answer in place.
For comparison it also sends the row as a message frame both ways. Every speculative round
pays this hop at least twice, so it must stay far below a draft step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

from hetspec.daemon.worker_client import WorkerClient, WorkerSpec, WorkerStartError
from hetspec.protocol import Arena, ArrayRef, frame_array
from hetspec.protocol import worker_messages as m

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "draft" / "draft-q8_0.gguf"


async def time_calls(call, count: int, check, gap_us: float = 0.0) -> list[float]:
    """Round-trip times (us) of ``count`` awaits of ``call()``, each ``gap_us`` after the last
    answer (the daemon busy meanwhile, as between a round's calls: the worker polls, then
    sleeps), every answer checked."""
    samples = []
    for index in range(count):
        until = time.perf_counter() + gap_us / 1e6
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        reply, frames = await call()
        check(reply, frames)
        if index >= count // 10:  # the first tenth warms caches and the allocator
            samples.append((time.perf_counter() - start) * 1e6)
    return samples


async def run(args: argparse.Namespace) -> int:
    row = np.random.default_rng(0).random(args.floats, dtype=np.float32)
    cores = sorted(os.sched_getaffinity(0))
    worker_cores = tuple(cores[-1:])
    if len(cores) > 1:  # as in the daemon: the worker owns its core, the daemon uses the others
        os.sched_setaffinity(0, cores[:-1])
    with tempfile.TemporaryDirectory(prefix="hetspec-bench-") as runtime_dir:
        name = f"/dev/shm/hetspec-bench-{os.getpid()}"
        with Arena.create(name, slots=2, slot_bytes=row.nbytes) as arena:
            spec = WorkerSpec(
                "cpu",
                "llama.cpp",
                str(args.model),
                m.LlamaCppSettings(n_ctx=256, threads=1),
                cores=worker_cores,
                log_format="console",
                spin_us=args.spin_us,
            )
            client = WorkerClient(spec, Path(runtime_dir), 1, arena.layout)
            try:
                await client.start(load_timeout_s=120)
            except WorkerStartError as error:
                print(f"error: {error}", file=sys.stderr)
                return 1
            try:
                arena.empty(0, row.shape)[:] = row
                in_slot = ArrayRef(row.dtype.str, row.shape, slot=0)

                async def via_arena():
                    echo = m.Echo(request=client.next_request(), data=in_slot, out=1)
                    return await client.call(echo)

                def arena_answer(reply, frames):
                    assert arena.view(reply.data)[-1] == row[-1]

                async def via_frames():
                    data = ArrayRef(row.dtype.str, row.shape, frame=1)
                    return await client.call(m.Echo(request=client.next_request(), data=data),
                                             (row,))  # fmt: skip

                def framed_answer(reply, frames):
                    assert frame_array(reply.data, frames)[-1] == row[-1]

                arena_us = await time_calls(via_arena, args.count, arena_answer, args.gap_us)
                frame_us = await time_calls(via_frames, args.count, framed_answer, args.gap_us)
            finally:
                await client.stop()
    kib = row.nbytes / 1024
    print(f"round trip daemon -> worker -> daemon, {args.floats} float32 ({kib:.0f} KiB) each way, "
          f"{len(arena_us)} calls after warm-up, {args.gap_us:g} us apart, the worker polling "
          f"{args.spin_us:g} us before it sleeps")  # fmt: skip
    for label, samples in (("shared-memory arena", arena_us), ("message frames", frame_us)):
        q = statistics.quantiles(samples, n=10)
        print(f"  {label:<20} median {statistics.median(samples):7.1f} us   "
              f"p10 {q[0]:7.1f}   p90 {q[-1]:7.1f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetspec.daemon.bench_roundtrip",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF the worker loads")
    parser.add_argument("--floats", type=int, default=32768, help="length of the row")
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument(
        "--spin-us", type=float, default=100.0, help="the worker's poll before it sleeps"
    )
    parser.add_argument(
        "--gap-us", type=float, default=0.0,
        help="time between an answer and the next call (longer than --spin-us: the worker "
        "sleeps, and the call pays its wake-up)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
