"""Pipeline stages as processes on this machine (loopback TCP, CURVE as across hosts): what the
bench and the tests run, and what a box splitting a model over its own sockets would.

Key pairs for the coordinator and every stage go to ``folder/keys``; stage i admits the
coordinator's public key and stage i - 1's. Each stage logs to ``folder/stageI.log``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from hetspec.daemon.pipeline import PipelineClient, StageAddress
from hetspec.protocol.curve_keys import make_keys

READY_LINE = " at tcp://"  # hetspec-stage's line once it serves


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges, the first ones one layer larger where it does not divide."""
    size, extra = divmod(layers, stages)
    bounds, start = [], 0
    for index in range(stages):
        end = start + size + (index < extra)
        bounds.append((start, end))
        start = end
    return bounds


class LocalStages:
    def __init__(self, folder: Path, model: Path, bounds: list[tuple[int, int]], *,
                 link_ms: float = 0.0, threads: int = 1) -> None:  # fmt: skip
        """Start one ``hetspec-stage`` per range in ``bounds``; ``wait`` until they serve."""
        self.folder, self.model, self.bounds = folder, model, bounds
        self.link_ms, self.threads = link_ms, threads
        self.keys = folder / "keys"
        make_keys(self.keys, ["coordinator"] + [f"stage{i}" for i in range(len(bounds))])
        self.addresses = [
            StageAddress(f"tcp://127.0.0.1:{free_port()}", self.keys / f"stage{i}.key")
            for i in range(len(bounds))
        ]
        self.processes: list[subprocess.Popen | None] = [None] * len(bounds)
        for index in range(len(bounds)):
            self.start(index)

    def log(self, index: int) -> Path:
        return self.folder / f"stage{index}.log"

    def start(self, index: int) -> None:
        """(Re)start stage ``index`` (a dead one's supervisor does this)."""
        allowed = self.folder / f"allowed{index}"
        allowed.mkdir(exist_ok=True)
        for name in ["coordinator"] + ([f"stage{index - 1}"] if index else []):
            shutil.copy(self.keys / f"{name}.key", allowed)
        first, end = self.bounds[index]
        with self.log(index).open("w") as log:
            self.processes[index] = subprocess.Popen(
                [sys.executable, "-m", "hetspec.workers.stage", "serve", "--model",
                 str(self.model), "--layers", f"{first}:{end}",
                 "--bind", self.addresses[index].endpoint,
                 "--key", str(self.keys / f"stage{index}.key_secret"),
                 "--authorized", str(allowed), "--threads", str(self.threads),
                 "--link-ms", str(self.link_ms)],
                stderr=log, stdout=subprocess.DEVNULL,
            )  # fmt: skip

    def wait(self, index: int | None = None, timeout_s: float = 120.0) -> None:
        """Until stage ``index`` (default: every stage) serves; RuntimeError with its log's
        last line if it exits or takes longer."""
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.bounds)) if index is None else [index]:
            while READY_LINE not in self.log(i).read_text():
                process = self.processes[i]
                if process.poll() is not None or time.monotonic() > deadline:
                    last = (self.log(i).read_text().strip().splitlines() or ["no output"])[-1]
                    raise RuntimeError(f"stage {i} did not start: {last}")
                time.sleep(0.05)

    def kill(self, index: int) -> None:
        self.processes[index].kill()
        self.processes[index].wait()

    def client(self, key: str = "coordinator", timeout_s: float = 2.0) -> PipelineClient:
        """A coordinator with key pair ``key`` (from this folder's keys)."""
        return PipelineClient(self.addresses, self.keys / f"{key}.key_secret",
                              f"tcp://127.0.0.1:{free_port()}", timeout_s)  # fmt: skip

    def stop(self) -> None:
        for process in self.processes:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
