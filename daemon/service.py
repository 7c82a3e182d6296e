"""The running daemon: instance lock, arena, supervised workers, HTTP on the Unix socket.

Lifecycle: take the runtime directory's lock and remove what a killed predecessor left; listen
on the socket at once (``/health`` answers 503 while the workers load); start both workers;
serve. SIGTERM or SIGINT drains: new requests get 503, the request in flight may finish
(bounded by ``drain_timeout_s``), then the workers stop and the socket, the endpoints and the
shared-memory segment are removed. Every exit path runs that cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from hetspec import __version__
from hetspec.daemon.config import DaemonConfig
from hetspec.daemon.cores import CoreError
from hetspec.daemon.engine import (
    OverlappedDecoder,
    SpeculativeDecoder,
    SpeculativeStats,
    WorkerPair,
)
from hetspec.daemon.generation import GenerateRequest, GenerationResult, generate
from hetspec.daemon.instance import Instance, InstanceError
from hetspec.daemon.slots import SlotPool
from hetspec.daemon.supervisor import (
    StartupError,
    Supervisor,
    WorkerUnavailable,
    vocab_size_of,
    worker_specs,
)
from hetspec.daemon.worker_client import WorkerClient, WorkerError
from hetspec.protocol.arena import Arena, ArenaError
from hetspec.speculative.budget import BudgetController

log = structlog.get_logger("hetspec.daemon")


@dataclass(frozen=True)
class Job:
    body: GenerateRequest
    mode: str
    pieces: AsyncIterator[str]
    result: GenerationResult
    stats: SpeculativeStats
    drafter: WorkerClient
    verifier: WorkerClient


def json_error(status: int, message: str, **headers: str) -> web.Response:
    body = msgspec.json.encode({"error": message})
    return web.Response(status=status, body=body, content_type="application/json",
                        headers=headers)  # fmt: skip


class Service:
    def __init__(self, config: DaemonConfig, log_format: str) -> None:
        self.config = config
        self.log_format = log_format
        self.instance = Instance(config.runtime_dir)
        self.arena: Arena | None = None
        self.supervisor: Supervisor | None = None
        self.runner: web.AppRunner | None = None
        self.draining = False
        self.listening = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._serial = asyncio.Lock()  # one request decodes at a time
        self.slots = SlotPool(config.arena_slots)
        # one controller for the daemon's life: costs measured in one request still hold
        width = config.max_tree_nodes - 1
        # (parallel mode's gamma is fixed: its controller only measures, for the statistics)
        self.controllers = {
            "sequential": BudgetController(parallel=False, max_width=width),
            "parallel": BudgetController(parallel=True, max_width=width, max_branches=1),
            "adaptive": BudgetController(parallel=True, max_width=width),
        }
        self._requests = 0
        self._stop = asyncio.Event()
        self.started = time.monotonic()

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a clean drain, 1 if serving could not start."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._begin_drain, signum)
        try:
            self.instance.acquire()
            await self._listen()
            specs = worker_specs(self.config, self.log_format)
            vocab = max(vocab_size_of(self.config.target.folder),
                        vocab_size_of(self.config.draft.folder))  # fmt: skip
            self.arena = self.instance.create_arena(
                self.config.arena_slots, self.config.max_tree_nodes * vocab * 4
            )
            self.supervisor = Supervisor(self.config, specs, self.instance.runtime_dir,
                                         self.arena.layout)  # fmt: skip
            start = asyncio.ensure_future(self.supervisor.start())
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():  # told to stop while loading
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError, StartupError):
                    await start
                return 0
            start.result()
            log.info("serving", socket=self.config.socket, placement=self.config.placement,
                     startup_s=round(time.monotonic() - self.started, 2))  # fmt: skip
            await self._stop.wait()
            await self._drain()
            return 0
        except (InstanceError, StartupError, CoreError, ArenaError, OSError) as error:
            log.error("cannot serve", error=str(error))
            return 1
        finally:
            await self._cleanup()

    def _begin_drain(self, signum: int) -> None:
        if not self.draining:
            log.info("draining", signal=signal.Signals(signum).name, in_flight=self.in_flight)
        self.draining = True
        self._stop.set()

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out; stopping with requests in flight", count=self.in_flight)

    async def _cleanup(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.arena is not None:
            self.arena.close()
        if self.listening:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)
        self.instance.release()
        log.info("stopped")

    async def _listen(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/health", self.health), web.post("/api/generate", self.generate)])
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        socket = Path(self.config.socket)
        socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()  # a stale socket of a dead instance; the lock says none is alive
        await web.UnixSite(self.runner, str(socket)).start()
        self.listening = True
        os.chmod(socket, 0o660)

    # ------------------------------------------------------------ endpoints

    async def health(self, request: web.Request) -> web.Response:
        supervisor = self.supervisor
        ready = supervisor is not None and supervisor.ready() and not self.draining
        workers = {}
        if supervisor is not None:
            for name, client in supervisor.workers.items():
                workers[name] = {"pid": client.pid, "alive": client.alive,
                                 "restarts": supervisor.restarts[name],
                                 "device": client.ready.device if client.ready else None,
                                 "model": client.spec.model}  # fmt: skip
        status = "ready" if ready else ("draining" if self.draining else "loading")
        body = {"status": status, "version": __version__, "workers": workers}
        return web.json_response(body, status=200 if ready else 503)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return json_error(503, "hetspecd is shutting down", **{"Retry-After": "5"})
        try:
            body = msgspec.json.decode(await request.read(), type=GenerateRequest)
            mode = body.resolve_mode(self.config.mode)
        except (msgspec.DecodeError, ValueError) as error:  # ValueError: SamplingError, ...
            return json_error(400, f"bad request: {error}")
        if self.supervisor is None or not self.supervisor.workers:
            return json_error(503, "the workers are still loading", **{"Retry-After": "5"})
        self.in_flight += 1
        self._idle.clear()
        try:
            async with self._serial:
                return await self._generate(request, body, mode)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def _generate(self, request: web.Request, body: GenerateRequest, mode: str):
        roles = self.supervisor.roles
        try:
            verifier = await self.supervisor.worker(roles.verifier, self.config.load_timeout_s)
            drafter = await self.supervisor.worker(roles.drafter, self.config.load_timeout_s)
        except WorkerUnavailable as error:
            return json_error(503, str(error), **{"Retry-After": "5"})
        self._requests += 1
        owner = f"request {self._requests}"
        gamma = body.gamma or (self.config.gamma if mode == "parallel" else None)
        if gamma and gamma * (body.branches or 1) + 1 > self.config.max_tree_nodes:
            return json_error(400, f"gamma x branches + 1 = {gamma * (body.branches or 1) + 1} "
                              f"exceeds max_tree_nodes ({self.config.max_tree_nodes})")  # fmt: skip
        with self.slots.lease(owner) as draft_slot, self.slots.lease(owner) as verify_slot:
            result = GenerationResult()
            stats = SpeculativeStats()
            if mode == "autoregressive":
                pieces = generate(body, verifier, draft_slot, result)
            else:
                pair = WorkerPair(drafter, verifier, self.arena, draft_slot, verify_slot)
                kind = SpeculativeDecoder if mode == "sequential" else OverlappedDecoder
                decoder = kind(body, pair, self.controllers[mode], stats, gamma=gamma)
                pieces = decoder.stream(result)
            job = Job(body, mode, pieces, result, stats, drafter, verifier)
            return await self._respond(request, job)

    async def _respond(self, request: web.Request, job: Job) -> web.StreamResponse:
        body, pieces, result, stats = job.body, job.pieces, job.result, job.stats
        drafter, verifier, mode = job.drafter, job.verifier, job.mode

        def final() -> dict:
            document = self._final(result, drafter, verifier, mode)
            if mode != "autoregressive":
                speculative = stats.summary(self.controllers[mode])
                document["timings"]["draft_n"] = speculative.pop("draft_n")
                document["timings"]["draft_n_accepted"] = speculative.pop("draft_n_accepted")
                document["speculative"] = speculative
            return document

        response = None
        try:
            if body.stream:
                first = await anext(pieces, "")  # errors before any output are plain 4xx/5xx
                response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
                await response.prepare(request)
                if first:
                    await response.write(msgspec.json.encode({"response": first}) + b"\n")
                async for piece in pieces:
                    await response.write(msgspec.json.encode({"response": piece}) + b"\n")
                await response.write(msgspec.json.encode(final()) + b"\n")
                await response.write_eof()
                return response
            text = "".join([piece async for piece in pieces])
            return web.json_response({**final(), "response": text})
        except ValueError as error:  # the prompt does not fit the context, ...
            if response is None:
                return json_error(400, str(error))
            raise
        except (WorkerError, WorkerUnavailable) as error:
            log.warning("request failed", error=str(error))
            if response is None:
                return json_error(503, str(error), **{"Retry-After": "2"})
            failed = {**final(), "done_reason": "error", "error": str(error)}
            await response.write(msgspec.json.encode(failed) + b"\n")
            await response.write_eof()
            return response

    @staticmethod
    def _final(result: GenerationResult, drafter, verifier, mode: str) -> dict:
        decode_s = result.decode_ms / 1000
        return {
            "done": True,
            "done_reason": result.done_reason,
            "tokens": result.tokens,
            "timings": {
                "prompt_n": result.prompt_tokens,
                "prompt_ms": round(result.prompt_ms, 3),
                "predicted_n": len(result.tokens),
                "predicted_ms": round(result.decode_ms, 3),
                "predicted_per_second": round(len(result.tokens) / decode_s, 2) if decode_s else 0,
                "ttft_ms": round(result.ttft_ms, 3) if result.ttft_ms is not None else None,
            },
            "mode": mode,
            "devices": {"target": verifier.ready.device, "draft": drafter.ready.device},
        }
