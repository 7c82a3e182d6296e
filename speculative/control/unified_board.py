"""An HCMP forward's work replayed at a unified-memory board's cost (no such board here).

Each ``Work`` item (hcmp_work.py: the list the real forward records) costs its side a
roofline: ``op_seconds + max(flops / flops_rate, bytes / bandwidth)``. A step's items run on
both sides at once and the step ends when the slower side does, but never before the DRAM
both share has moved both sides' bytes (``shared_bandwidth``: the contention Ghidorah's ARCA
profiles for). Both sides read the one memory, so no link is crossed (a link at zero cost);
``sync_seconds`` is paid once a step that both sides worked in.

The boards' figures are published peaks times efficiencies that are assumptions (each
``Board.source`` says which); the replay is a model of such a board, not a measurement.
Pure arithmetic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from hetspec.speculative.control.hcmp_work import CPU, GPU, Work

GB = 1e9


@dataclass(frozen=True)
class Processor:
    """One side of a board: what it attains on the forward's arithmetic and reads alone."""

    flops: float  # FLOP/s
    bandwidth: float  # bytes/s from DRAM when the other side is idle
    op_seconds: float  # a fixed cost per operation (a kernel launch, a thread wake-up)


@dataclass(frozen=True)
class Board:
    name: str
    gpu: Processor
    cpu: Processor
    shared_bandwidth: float  # bytes/s both sides together reach
    weight_bytes: float = 2.0  # fp16 weights
    activation_bytes: float = 2.0
    sync_seconds: float = 0.0
    source: str = ""


def xavier_nx_as_the_paper_ran_it() -> Board:
    """Jetson Xavier NX with the GPU locked at 204 MHz and the CPU at 1.9 GHz (Ghidorah's
    testbed, section IV-A)."""
    return Board(
        name="Jetson Xavier NX, GPU at 204 MHz (Ghidorah's testbed)",
        # 384 Volta CUDA cores x 2 (FMA) x 2 (fp16x2) x 204 MHz = 313 GFLOP/s peak
        gpu=Processor(flops=0.7 * 313e9, bandwidth=0.8 * 59.7 * GB, op_seconds=10e-6),
        # 6 Carmel cores x 1.9 GHz x 2 NEON FMA pipes x 8 fp16 lanes x 2 = 365 GFLOP/s peak
        cpu=Processor(flops=0.6 * 365e9, bandwidth=0.5 * 59.7 * GB, op_seconds=2e-6),
        shared_bandwidth=0.8 * 59.7 * GB,  # 128-bit LPDDR4x-3733: 59.7 GB/s
        source=(
            "NVIDIA Jetson Xavier NX datasheet (384-core Volta GPU, 6-core Carmel ARMv8.2, "
            "59.7 GB/s LPDDR4x) with the clocks Ghidorah locked (GPU 204 MHz, CPU 1.9 GHz); "
            "assumed: 70% (GPU) and 60% (CPU) of peak FLOP/s, 80% of the DRAM's bandwidth for "
            "the GPU or both sides, 50% for the CPU alone, 10 us (GPU) and 2 us (CPU) an "
            "operation, no sync cost"
        ),
    )


def orin_nx_full_clocks() -> Board:
    """Jetson Orin NX 16 GB at its published maximum clocks."""
    return Board(
        name="Jetson Orin NX 16GB, full clocks",
        # 1024 Ampere CUDA cores x 2 (FMA) x 918 MHz = 1.88 TFLOP/s (fp32 rate; tensor cores
        # would make the GPU side faster still and the split pay less)
        gpu=Processor(flops=0.7 * 1.88e12, bandwidth=0.8 * 102.4 * GB, op_seconds=10e-6),
        # 8 Cortex-A78AE x 2.0 GHz x 2 NEON FMA pipes x 8 fp16 lanes x 2 = 512 GFLOP/s peak
        cpu=Processor(flops=0.6 * 512e9, bandwidth=0.5 * 102.4 * GB, op_seconds=2e-6),
        shared_bandwidth=0.8 * 102.4 * GB,  # 128-bit LPDDR5: 102.4 GB/s
        source=(
            "NVIDIA Jetson Orin NX 16GB datasheet (1024-core Ampere GPU at up to 918 MHz, "
            "8-core Cortex-A78AE at up to 2 GHz, 102.4 GB/s LPDDR5); assumed: the GPU's fp32 "
            "CUDA-core rate for its fp16 GEMMs (no tensor cores), the same efficiencies as "
            "the Xavier NX row"
        ),
    )


def work_seconds(work: Work, board: Board) -> float:
    """What one side's item costs it on ``board`` (roofline plus the fixed cost)."""
    side = board.gpu if work.side == GPU else board.cpu
    moved = work.bytes(board.weight_bytes, board.activation_bytes)
    return side.op_seconds + max(work.flops() / side.flops, moved / side.bandwidth)


def forward_seconds(work: Iterable[Work], board: Board) -> float:
    """One forward's time on ``board``: its steps one after another, each as long as its
    slower side or the shared DRAM's time for both sides' bytes, whichever is longer."""
    steps: dict[int, list[Work]] = defaultdict(list)
    for item in work:
        steps[item.step].append(item)
    total = 0.0
    for items in steps.values():
        busy = {GPU: 0.0, CPU: 0.0}
        moved = 0.0
        for item in items:
            busy[item.side] += work_seconds(item, board)
            moved += item.bytes(board.weight_bytes, board.activation_bytes)
        total += max(busy[GPU], busy[CPU], moved / board.shared_bandwidth)
        if busy[GPU] and busy[CPU]:
            total += board.sync_seconds
    return total
