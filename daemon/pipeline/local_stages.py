"""Pipeline stages as processes on this machine (loopback TCP, CURVE as across hosts): what the
bench and the tests run, and what a box splitting a model over its own sockets would.

Key pairs for the coordinator and every stage go to ``folder/keys``; stage i admits the
coordinator's public key and stage i - 1's. Each stage logs to ``folder/stageI.log``.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from hetspec.daemon.pipeline.coordinator import PipelineClient, StageAddress
from hetspec.protocol.curve_keys import make_keys
from hetspec.speculative.flow.layer_split import format_range

READY_LINE = " at tcp://"  # hetspec-stage's line once it serves


def public_key(secret: Path) -> Path:
    """``NAME.key`` beside ``NAME.key_secret``."""
    return secret.with_name(secret.name.removesuffix("_secret"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalStages:
    def __init__(
        self,
        folder: Path,
        model: Path,
        bounds: list[tuple[int, int]],
        *,
        link_ms: float = 0.0,
        threads: int = 1,
        identity: Path | None = None,
    ) -> None:
        """Start one ``hetspec-stage`` per range of half-layers in ``bounds``
        (speculative/flow/layer_split.py); ``wait`` until they serve. Each stage has a key pair
        of its own in ``folder/keys``, or with ``identity`` (a ``NAME.key_secret``, its
        ``NAME.key`` beside it) every stage and the coordinator share that one: stages on
        the coordinator's host, whose next stage elsewhere admits only the coordinator."""
        self.folder, self.model, self.bounds = folder, model, bounds
        self.link_ms, self.threads = link_ms, threads
        self.keys = folder / "keys"
        if identity is None:
            make_keys(self.keys, ["coordinator"] + [f"stage{i}" for i in range(len(bounds))])
            self.secrets = [self.keys / f"stage{i}.key_secret" for i in range(len(bounds))]
            self.coordinator = self.keys / "coordinator.key_secret"
        else:
            self.secrets = [identity] * len(bounds)
            self.coordinator = identity
        self.addresses = [
            StageAddress(f"tcp://127.0.0.1:{free_port()}", public_key(secret))
            for secret in self.secrets
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
        for secret in {self.coordinator, *self.secrets[index - 1 : index]}:
            shutil.copy(public_key(secret), allowed)
        layers = format_range(*self.bounds[index])
        with self.log(index).open("w") as log:
            self.processes[index] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hetspec.workers.stage",
                    "serve",
                    "--model",
                    str(self.model),
                    "--layers",
                    layers,
                    "--bind",
                    self.addresses[index].endpoint,
                    "--key",
                    str(self.secrets[index]),
                    "--authorized",
                    str(allowed),
                    "--threads",
                    str(self.threads),
                    "--link-ms",
                    str(self.link_ms),
                ],
                stderr=log,
                stdout=subprocess.DEVNULL,
            )

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

    def client(self, key: str | None = None, timeout_s: float = 2.0) -> PipelineClient:
        """A coordinator with key pair ``key`` (from this folder's keys; default: the
        coordinator's)."""
        secret = self.coordinator if key is None else self.keys / f"{key}.key_secret"
        return PipelineClient(self.addresses, secret, "tcp://127.0.0.1:*", timeout_s)

    def stop(self) -> None:
        for process in self.processes:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


class LocalRpcServers:
    """``hetspec-rpc-server`` processes on loopback (llama.cpp's RPC split of a target's
    layers), each behind a ``DelayLink`` when ``link_ms`` > 0: the plain path #25 compares
    FlowSpec's pipeline with. ``endpoints`` are what a llama.cpp worker's ``rpc_servers`` take;
    ``start_links``/``close_links`` (awaited on the event loop that serves them) open and close
    the delaying links."""

    def __init__(self, folder: Path, count: int, *, link_ms: float = 0.0, threads: int = 1) -> None:
        self.folder, self.link_ms = folder, link_ms
        self.ports = [free_port() for _ in range(count)]
        self.processes = []
        for index, port in enumerate(self.ports):
            log = (folder / f"rpc{index}.log").open("w")
            self.processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hetspec.workers.rpc_server",
                        "--port",
                        str(port),
                        "--threads",
                        str(threads),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        self.links = [DelayLink(port, link_ms) for port in self.ports] if link_ms > 0 else []

    @property
    def endpoints(self) -> list[str]:
        ports = [link.port for link in self.links] if self.links else self.ports
        return [f"127.0.0.1:{port}" for port in ports]

    def wait(self, timeout_s: float = 30.0) -> None:
        """Until every server accepts connections; RuntimeError naming one that will not."""
        deadline = time.monotonic() + timeout_s
        for index, (port, process) in enumerate(zip(self.ports, self.processes, strict=True)):
            while True:
                if process.poll() is not None:
                    said = (self.folder / f"rpc{index}.log").read_text().strip().splitlines()
                    raise RuntimeError(f"rpc server {index} exited: {said[-1] if said else ''}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"rpc server {index} never listened") from None
                    time.sleep(0.05)

    async def start_links(self) -> None:
        for link in self.links:
            await link.start()

    async def close_links(self) -> None:
        """On the links' event loop, before ``stop``."""
        for link in self.links:
            await link.aclose()

    def stop(self) -> None:
        """End the server processes (close the links first, on their loop)."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class DelayLink:
    """A loopback TCP relay to ``target_port`` that delivers every chunk, in order, ``delay_ms``
    after it arrived, in both directions: a slow link for processes whose sockets hetspec does
    not own (llama.cpp's RPC), as the stages' --link-ms is for theirs. ``start`` and ``aclose``
    run on the event loop that serves it."""

    def __init__(self, target_port: int, delay_ms: float) -> None:
        self.target_port, self.delay_s = target_port, delay_ms / 1000
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader, writer) -> None:
        self._connections.add(asyncio.current_task())
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        # each direction ends at its reader's EOF (or an error); either end closing ends both
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )
        for side in (writer, up_writer):
            side.close()
            self._writers.discard(side)
        self._connections.discard(asyncio.current_task())

    async def _pump(self, reader, writer) -> None:
        """Copy ``reader`` to ``writer``, each chunk delivered delay_s after it was read."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + self.delay_s, data))
        finally:
            queue.put_nowait(None)
            await asyncio.gather(sender, return_exceptions=True)
            writer.close()  # the other direction's reader then ends too

    async def aclose(self) -> None:
        """Stop listening and close every connection's sockets; each connection then ends by
        itself (its readers see the end), and this waits for them."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*list(self._connections), return_exceptions=True)
