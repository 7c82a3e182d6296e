"""The running daemon: instance lock, arena, supervised workers, HTTP on the Unix socket.

Lifecycle: take the runtime directory's lock and remove what a killed predecessor left; listen
at once (on the socket systemd passed, or our own; ``/health`` answers 503 while the workers
load); start both workers; tell systemd READY=1; serve. SIGTERM or SIGINT drains: STOPPING=1,
new requests get 503, the queue and the request in flight may finish (bounded by
``drain_timeout_s``), then the workers stop and the socket, the endpoints and the
shared-memory segment are removed. Every exit path runs that cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from hetspec import __version__
from hetspec.daemon.api.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from hetspec.daemon.api.errors import ApiError, json_errors
from hetspec.daemon.api.guard import GuardedRunner
from hetspec.daemon.api.ollama import OllamaApi
from hetspec.daemon.api.openai import openai_routes
from hetspec.daemon.api.runs import Run
from hetspec.daemon.api.status import native_routes
from hetspec.daemon.config import BUNDLED_MODELS, DaemonConfig, ModelPaths
from hetspec.daemon.decode.admission import Admission, QueueFull
from hetspec.daemon.decode.autoregressive import generate
from hetspec.daemon.decode.engine import Decoder, LookupSource, WorkerPair
from hetspec.daemon.decode.requests import GenerateRequest, GenerationResult, check_messages_fit
from hetspec.daemon.decode.round_log import RoundLog
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.instance import Instance, InstanceError
from hetspec.daemon.load.head_choice import HeadChoiceError
from hetspec.daemon.load.model_facts import ModelFacts, read_model_facts
from hetspec.daemon.load.runtime_trials import (
    DrafterChoice,
    RuntimeChoiceError,
    RuntimeDecision,
    cache_dir,
    decide_drafter,
    decide_gpu_runtime,
)
from hetspec.daemon.metrics import Metrics
from hetspec.daemon.pipeline.backend import PipelineBackend, PipelineStartError
from hetspec.daemon.supervision.cores import CoreError, cuda_present, daemon_cores, owned_cores
from hetspec.daemon.supervision.slots import SlotPool
from hetspec.daemon.supervision.supervisor import (
    StartupError,
    Supervisor,
    WorkerUnavailable,
    check_model_files,
    model_number_of,
    roles,
    worker_specs,
)
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerDied, WorkerSpec
from hetspec.daemon.systemd import Notifier, activated_sockets, watchdog_loop
from hetspec.protocol.arena import Arena, ArenaError
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.control.core_choice import SpareCoreChoice
from hetspec.speculative.control.rounds import Plan
from hetspec.speculative.drafting.continuation_tree import ContinuationTree
from hetspec.speculative.drafting.ngram_table import NgramTable
from hetspec.speculative.drafting.prompt_lookup import PromptLookup

log = structlog.get_logger("hetspec.daemon")

MAX_BODY_BYTES = 4 << 20


# The exit status of a drain that SIGHUP asked for: the systemd unit restarts the daemon on it
# (RestartForceExitStatus) and does not count it a failure (SuccessExitStatus).
RELOAD_EXIT_STATUS = 75


def mode_controllers(config: DaemonConfig, *, chains_only: bool = False) -> dict:
    """Each speculative mode's controller. ``chains_only``: no branches, no trees (a verifier
    whose logits depend on where its KV cache put earlier tokens)."""
    width = config.max_tree_nodes - 1
    # dynamic trees replace branches (and DuoDecoding's rule) in plain rounds
    tree = {"tree_k": config.draft_tree, "max_branches": 1} if config.draft_tree else {}
    if chains_only:
        tree = {"max_branches": 1}
    return {
        "sequential": BudgetController(ControllerConfig.of(overlap=False, max_width=width, **tree)),
        # parallel mode's gamma is fixed: its controller only measures, for the statistics
        "parallel": BudgetController(ControllerConfig.of(max_width=width, max_branches=1)),
        "adaptive": BudgetController(ControllerConfig.of(max_width=width, **tree)),
    }


MODEL_FREE_DRAFTERS = {
    "continuation-tree": ContinuationTree,
    "prompt-lookup": PromptLookup,
    "ngram-table": NgramTable,
}


class Service:
    def __init__(self, config: DaemonConfig, log_format: str) -> None:
        self.config = config
        self.log_format = log_format
        self.instance = Instance(config.runtime_dir)
        self.notifier = Notifier.from_environment()
        self.arena: Arena | None = None
        self.supervisor: Supervisor | None = None
        self.pipeline: PipelineBackend | None = None  # [pipeline]: stages verify
        self.runtime_decision: RuntimeDecision | None = None
        self.drafter: DrafterChoice | None = None
        self.runner: web.AppRunner | None = None
        self.draining = False
        self.reloading = False  # SIGHUP: drain, then exit RELOAD_EXIT_STATUS
        self.own_socket: Path | None = None  # the socket file we created (not systemd's)
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.admission = Admission(config.max_queue)
        self.slots = SlotPool(config.arena_slots)
        self.metrics = Metrics()
        self.round_log: RoundLog | None = None  # opened by run() where configured
        self.chat_template: ChatTemplate | None = None
        self._facts: dict[str, ModelFacts] = {}  # by path, read when first asked
        self.model_name = config.model_name or _model_name(config.target)
        # one controller for the daemon's life: costs measured in one request still hold
        self.controllers = mode_controllers(config)
        self.chains_only = False  # the verifier verifies chains only (set at load)
        # whether the target decoding alone computes on the drafter's cores too: measured
        # for the daemon's life, by every mode
        self.spare_cores = SpareCoreChoice()
        self.verify_cores = SpareCoreChoice()  # the same for a plain round's verification
        self._run_ids = itertools.count(1)
        self._stop = asyncio.Event()
        self.started = time.monotonic()
        self.started_wall = time.time()

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a clean drain, 1 if serving could not start."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, self._begin_drain, signum)
        watchdog = None
        try:
            self.instance.acquire()
            if self.config.round_log:
                self.round_log = RoundLog(self.config.round_log)
            self._load_chat_template()
            await self._listen()
            self.notifier.status("loading the models")
            watchdog = asyncio.ensure_future(watchdog_loop(self.notifier, self._heartbeats_fresh))
            start = asyncio.ensure_future(self._load())
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():  # told to stop while loading
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError, StartupError):
                    await start
                return 0
            stop.cancel()
            start.result()
            startup_s = round(time.monotonic() - self.started, 2)
            log.info(
                "serving",
                socket=self.config.socket,
                placement=self.config.placement,
                startup_s=startup_s,
            )
            self.notifier.ready(
                f"serving {self.model_name} ({self.config.placement}), ready after {startup_s} s"
            )
            await self._stop.wait()
            await self._drain()
            return RELOAD_EXIT_STATUS if self.reloading else 0
        except (
            InstanceError,
            StartupError,
            CoreError,
            ArenaError,
            ChatTemplateError,
            RuntimeChoiceError,
            HeadChoiceError,
            PipelineStartError,
            OSError,
        ) as error:
            log.error("cannot serve", error=str(error))
            self.notifier.status(f"cannot serve: {error}")
            return 1
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._cleanup()

    async def _load(self) -> None:
        """Check the model files, decide the GPU worker's runtime (measuring, for "auto"),
        then start both workers."""
        check_model_files(self.config)  # before any process loads them
        if self.config.pipeline.enabled:
            await self._load_pipeline()
            return
        cache = cache_dir(self.config.cache_dir)
        if self.config.gpu_runtime == "auto" or self.config.cpu_runtime == "auto":
            self.notifier.status("measuring which runtimes draft and verify fastest")
        drafter = await decide_drafter(self.config, self.log_format, cache)
        self.drafter = drafter
        if drafter is not None:
            log.info(
                "drafter",
                runtime=drafter.runtime,
                threads=drafter.threads,
                chosen_by=drafter.chosen_by,
                costs_ms=drafter.costs_ms,
                failures=[f"{f.runtime}: {f.message}" for f in drafter.failures],
            )
        decision = await decide_gpu_runtime(self.config, self.log_format, cache, drafter)
        self.runtime_decision = decision
        log.info(
            "gpu worker runtime",
            runtime=decision.runtime,
            chosen_by=decision.chosen_by,
            summary=decision.summary(),
        )
        specs = worker_specs(
            self.config,
            self.log_format,
            decision.runtime,
            drafter.threads if drafter else None,
            drafter.runtime if drafter else None,
        )
        # A verifier that borrows the drafter's cores while it idles (as its profile was
        # timed) verifies beside a drafting drafter on its own cores only.
        costs = decision.verifier_costs_s()
        verifier = specs[roles(self.config.placement).verifier]
        # llama.cpp sums a token's attention over its KV cells in their order; a branch left
        # behind leaves cells that later tokens fill out of order, and their logits then
        # differ from the target's own one token at a time (by up to 1.2 on SmolLM2): a
        # chain's rejected tail is refilled in order, so llama.cpp verifies chains
        chains_only = verifier.runtime == "llama.cpp"
        if chains_only != self.chains_only:
            self.controllers = mode_controllers(self.config, chains_only=chains_only)
            self.chains_only = chains_only
        own = len(set(verifier.cores)) or 1
        overlap_factor = (own + len(verifier.spare_cores)) / own  # spare: none of its own
        for controller in self.controllers.values():
            if costs is not None:
                controller.assume_verifier(costs)
            controller.assume_overlap_factor(overlap_factor)
        self.notifier.status("loading the models")
        await self._start_workers(specs, features=decision.runtime == "head")
        drafter_name = roles(self.config.placement).drafter
        if drafter_name in specs:  # else no draft model: the verifier has every core
            self._keep_off_drafter(specs[drafter_name])

    async def _start_workers(self, specs: dict, *, features: bool = False) -> None:
        """The arena (a slot holds a tree's probability rows, or with ``features`` its
        target features if wider) and the supervised workers of ``specs``."""
        models = [m for m in (self.config.target, self.config.draft) if m is not None]
        width = max(model_number_of(model) for model in models)
        if features:
            width = max(width, model_number_of(self.config.target, "hidden_size"))
        self.arena = self.instance.create_arena(
            self.config.arena_slots, self.config.max_tree_nodes * width * 4
        )
        self.supervisor = Supervisor(
            self.config, specs, self.instance.runtime_dir, self.arena.layout
        )
        await self.supervisor.start()

    def lookup_source(self) -> LookupSource | None:
        """The requests' model-free drafter, as configured; chains where the verifier
        verifies chains only."""
        drafter = MODEL_FREE_DRAFTERS.get(self.config.model_free_draft)
        if drafter is None:
            return None
        return LookupSource(drafter, 1 if self.chains_only else None)

    def _keep_off_drafter(self, drafter: WorkerSpec) -> None:
        """Move the event loop off ``drafter``'s cores where that is the better place
        (``daemon_cores``); the workers, started already, keep their own."""
        if not self.config.daemon_off_drafter_cores:
            return
        cuda = cuda_present(self.config.gpu_worker.device)
        cores = daemon_cores(owned_cores(), drafter.cores, cuda)
        if cores is None:
            return
        try:
            os.sched_setaffinity(0, cores)
        except OSError as error:  # a cpuset changed under us: stay where we are
            log.warning("cannot keep off the drafter's cores", error=str(error))
            return
        log.info("daemon cores", cores=sorted(cores), drafter_cores=list(drafter.cores))

    async def _load_pipeline(self) -> None:
        """The drafter's worker, then the pipeline's stages (which verify instead of a
        verifier worker)."""
        self.notifier.status("loading the draft model and the pipeline's stages")
        drafter = roles(self.config.placement).drafter
        choice = await decide_drafter(
            self.config, self.log_format, cache_dir(self.config.cache_dir)
        )
        self.drafter = choice
        specs = worker_specs(
            self.config,
            self.log_format,
            "torch",
            choice.threads if choice else None,
            choice.runtime if choice else None,
        )
        await self._start_workers({drafter: specs[drafter]})
        self.pipeline = PipelineBackend(self.config, self.instance.runtime_dir)
        await self.pipeline.start()

    def _heartbeats_fresh(self) -> bool:
        """While the runtimes are measured there is no worker yet: the profiling processes
        are bounded by load_timeout_s."""
        return self.supervisor is None or self.supervisor.heartbeats_fresh()

    def _begin_drain(self, signum: int) -> None:
        if signum == signal.SIGHUP and not self.draining:
            # No configuration is reloaded in place: the daemon drains and exits with
            # RELOAD_EXIT_STATUS, which the systemd unit restarts (systemctl reload sends HUP).
            log.info(
                "reload asked (SIGHUP): draining, then exiting to be restarted with the "
                "configuration as it is now",
                exit_status=RELOAD_EXIT_STATUS,
            )
            self.reloading = True
        if not self.draining:
            log.info("draining", signal=signal.Signals(signum).name, in_flight=self.in_flight)
            self.notifier.stopping()
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
        if self.pipeline is not None:
            await self.pipeline.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.arena is not None:
            self.arena.close()
        if self.round_log is not None:
            self.round_log.close()
        if self.own_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.own_socket.unlink()
        self.instance.release()
        log.info("stopped")

    def _load_chat_template(self) -> None:
        target = self.config.target
        self.chat_template = load_chat_template(target.folder, target.gguf)
        if self.chat_template is None:
            log.warning("the target model has no chat template; /v1/chat/completions is off")

    async def _listen(self) -> None:
        app = web.Application(
            middlewares=[json_errors, self._authorize], client_max_size=MAX_BODY_BYTES
        )
        app.add_routes([*native_routes(self), *OllamaApi(self).routes(), *openai_routes(self)])
        app.on_response_prepare.append(self._count_response)
        self.runner = GuardedRunner(
            app,
            max_connections=self.config.http_max_connections,
            idle_timeout_s=self.config.http_idle_timeout_s,
            on_refused=self._refused_connection,
            handler_cancellation=True,
            access_log=None,
        )
        await self.runner.setup()
        passed = activated_sockets()
        if passed:  # socket activation: systemd owns the socket file and its permissions
            for listener in passed:
                await web.SockSite(self.runner, listener).start()
            log.info("listening on sockets passed by systemd", count=len(passed))
        else:
            path = Path(self.config.socket)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.instance.claim_socket(path)  # refuses while another daemon serves there
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale socket of a dead instance; the lock says none is alive
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            os.chmod(path, 0o660)  # before listening: never reachable with looser rights
            listener.listen(128)
            self.own_socket = path
            await web.SockSite(self.runner, listener).start()
        if self.config.tcp.listen:
            host, _, port = self.config.tcp.listen.rpartition(":")
            await web.TCPSite(self.runner, host.strip("[]") or None, int(port)).start()
            log.info("listening on TCP (bearer token required)", address=self.config.tcp.listen)

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        """Requests over TCP must carry the configured bearer token; the Unix socket's file
        permissions are its access control."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if isinstance(peer, tuple):  # an IP peer: (host, port, ...)
            token = self.config.tcp.token or ""
            # as bytes, exactly as received: aiohttp decoded the header with surrogateescape,
            # and a token from argv may hold surrogates too (then any byte compares)
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            expected = f"Bearer {token}".encode("utf-8", "surrogateescape")
            if not token or not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)")
        return await handler(request)

    def _refused_connection(self) -> None:
        self.metrics.connections_refused.inc()
        log.warning(
            "too many open HTTP connections; refusing new ones",
            limit=self.config.http_max_connections,
        )

    async def _count_response(self, request: web.Request, response: web.StreamResponse) -> None:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        self.metrics.requests.labels(endpoint, str(response.status)).inc()

    # ------------------------------------------------------------ what endpoints use

    def ready(self) -> bool:
        """Both workers loaded and the daemon not draining."""
        pipeline_up = self.pipeline is not None and self.pipeline.client is not None
        return (
            self.supervisor is not None
            and self.supervisor.ready()
            and not self.draining
            and (pipeline_up or not self.config.pipeline.enabled)
        )

    def verifier(self) -> WorkerClient | None:
        """The worker that serves the target, once started."""
        if self.supervisor is None:
            return None
        return self.supervisor.workers.get(self.supervisor.roles.verifier)

    def check_chat_size(self, messages: int) -> None:
        """Refuse (400) a chat of more messages than the loaded context has tokens, before
        its template is rendered (each message takes at least one token)."""
        if self.supervisor is None:
            return
        contexts = [w.ready.context for w in self.supervisor.workers.values() if w.ready]
        try:
            check_messages_fit(messages, min(contexts, default=messages))
        except ValueError as error:
            raise ApiError(400, str(error)) from None

    def target_path(self) -> str:
        """The file or folder the target is served from (its worker's, once started)."""
        verifier = self.verifier()
        if verifier is not None:
            return verifier.spec.model
        return self.config.target.gguf or self.config.target.folder

    async def target_facts(self) -> ModelFacts:
        """What the target's file says of itself, read once (off the event loop)."""
        path = self.target_path()
        if path not in self._facts:
            try:
                self._facts[path] = await asyncio.to_thread(read_model_facts, path)
            except ValueError as error:
                raise ApiError(503, f"the target model cannot be described: {error}") from None
        return self._facts[path]

    def health(self) -> dict:
        supervisor = self.supervisor
        ready = self.ready()
        workers = {}
        if supervisor is not None:
            for name, client in supervisor.workers.items():
                workers[name] = {
                    "pid": client.pid,
                    "alive": client.alive,
                    "restarts": supervisor.restarts[name],
                    "device": client.ready.device if client.ready else None,
                    "model": client.spec.model,
                    "cores": list(client.spec.cores),
                    "spare_cores": list(client.spec.spare_cores),
                }
        daemon = {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0))}
        status = "ready" if ready else ("draining" if self.draining else "loading")
        health = {"status": status, "version": __version__, "workers": workers, "daemon": daemon}
        if self.pipeline is not None:
            health["pipeline"] = self.pipeline.health()
        return health

    def props(self) -> dict:
        """What serves here: models, placement, devices, the queue and the live gamma."""
        health = self.health()
        roles = self.supervisor.roles if self.supervisor else None
        devices = {}
        if roles is not None:
            for role, name in (("target", roles.verifier), ("draft", roles.drafter)):
                devices[role] = health["workers"].get(name, {}).get("device")
            if self.pipeline is not None:  # the stages verify: no verifier worker
                devices["target"] = "pipeline"
        config = self.config
        last = {
            mode: controller.history[-1] if controller.history else None
            for mode, controller in self.controllers.items()
        }
        return {
            "version": __version__,
            "status": health["status"],
            "model": self.model_name,
            "models": {
                "target": {"folder": config.target.folder, "gguf": config.target.gguf},
                "draft": msgspec.to_builtins(config.draft),  # None: no draft model
            },
            "placement": config.placement,
            "devices": devices,
            "gpu_runtime": msgspec.to_builtins(self.runtime_decision)
            if self.runtime_decision
            else None,
            "drafter": msgspec.to_builtins(self.drafter) if self.drafter else None,
            "pipeline": health.get("pipeline"),
            "mode": config.mode,
            "gamma": {
                mode: {"gamma": d.gamma, "branches": d.branches, "overlap": d.overlap}
                if d
                else None
                for mode, d in last.items()
            },
            "parallel_gamma": config.gamma,
            "queue": {
                "running": self.admission.running,
                "waiting": self.admission.waiting,
                "capacity": self.admission.capacity,
                "refused": self.admission.refused,
            },
            "chat_template": self.chat_template is not None,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "workers": health["workers"],
            # the verifier on the drafter's cores too, per token alone and per node verified
            "spare_cores": {
                "alone": self.spare_cores.snapshot(),
                "verify": self.verify_cores.snapshot(),
            },
        }

    def refresh_gauges(self) -> None:
        self.metrics.queue_waiting.set(self.admission.waiting)
        self.metrics.queue_refused.set(self.admission.refused)
        if self.supervisor is not None:
            for name, count in self.supervisor.restarts.items():
                self.metrics.worker_restarts.labels(name).set(count)
                client = self.supervisor.workers.get(name)
                self.metrics.worker_up.labels(name).set(int(bool(client and client.alive)))

    @contextlib.asynccontextmanager
    async def generation(self, body: GenerateRequest) -> AsyncIterator[Run]:
        """A turn to generate: waits in the queue, then yields the run (its pieces are
        produced as the caller iterates). Client errors are ``ApiError``s."""
        if self.draining:
            raise ApiError(503, "hetspecd is shutting down", retry_after_s=5)
        try:
            mode = body.resolve_mode(self.config.mode)
        except ValueError as error:
            raise ApiError(400, f"invalid request: {error}") from None
        gamma = body.gamma or (self.config.gamma if mode == "parallel" else None)
        if self.config.draft is None and (gamma or mode in ("sequential", "parallel")):
            raise ApiError(
                400,
                f"mode {mode} with a draft length needs a draft model, and hetspecd serves "
                "its target without one: use mode adaptive (drafts from the text itself) "
                "or autoregressive",
            )
        if gamma and gamma * (body.branches or 1) + 1 > self.config.max_tree_nodes:
            raise ApiError(
                400,
                f"gamma x branches + 1 = {gamma * (body.branches or 1) + 1} "
                f"exceeds max_tree_nodes ({self.config.max_tree_nodes})",
            )
        if self.supervisor is None or not self.supervisor.workers:
            raise ApiError(503, "the workers are still loading", retry_after_s=5)
        self.in_flight += 1
        self._idle.clear()
        try:
            async with self.admission.turn() as waited_s:
                self.metrics.queue_wait.observe(waited_s)
                async with self._start(body, mode, gamma, waited_s) as run:
                    yield run
        except QueueFull as error:
            raise ApiError(429, str(error), retry_after_s=error.retry_after_s) from None
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def _start(
        self, body: GenerateRequest, mode: str, gamma: int | None, waited_s: float
    ) -> AsyncIterator[Run]:
        if self.pipeline is not None:
            async with self._start_pipeline(body, mode, waited_s) as run:
                yield run
            return
        try:
            verifier, drafter = await self._workers()
        except WorkerUnavailable as error:
            raise ApiError(503, str(error), retry_after_s=5) from None
        run_id = f"{int(self.started_wall):x}-{next(self._run_ids)}"
        devices = {"target": verifier.ready.device}
        if drafter is not None:
            devices["draft"] = drafter.ready.device
        # a slot comes back once no call of this run may still write it (cancelled ones too)
        settled = self.supervisor.settled
        head = drafter is not None and drafter.spec.runtime == "head"  # reads the features
        async with (
            self.slots.lease(run_id, settled) as draft_slot,
            self.slots.lease(run_id, settled) as verify_slot,
            self.slots.lease(run_id, settled) if head else _no_slot() as feature_slot,
        ):
            result = GenerationResult()
            stats, controller = SpeculativeStats(), self.controllers.get(mode)
            fixed = None  # the request's gamma fixes every round's plan
            if gamma:
                overlap = mode != "sequential"
                branches = body.branches or (controller.limits.max_branches if body.dynamic else 1)
                if self.chains_only:  # see _load: one branch keeps the target's own output
                    branches = 1
                fixed = Plan(gamma, 1 if overlap else branches, overlap, body.dynamic)

            def pieces(verifier: WorkerClient, drafter: WorkerClient) -> AsyncIterator[str]:
                if mode == "autoregressive":
                    return generate(
                        body, verifier, draft_slot, result, arena=self.arena, cores=self.spare_cores
                    )
                pair = WorkerPair(
                    drafter,
                    verifier,
                    self.arena,
                    draft_slot,
                    verify_slot,
                    self.spare_cores,
                    self.verify_cores,
                    feature_slot,
                )
                log = self.round_log and functools.partial(self.round_log.write, run_id, mode)
                lookup = self.lookup_source() if mode == "adaptive" else None
                decoder = Decoder(body, pair, controller, stats, plan=fixed, log=log, lookup=lookup)
                return decoder.stream(result)

            def reset() -> None:  # for a start over: what the first attempt counted goes
                started = result.started  # (the time to the first token counts the wait)
                result.__init__()
                result.started = started
                stats.__init__()

            speculative = (stats, controller) if mode != "autoregressive" else (None, None)
            again = self._again_if_died(pieces, verifier, drafter, reset, whole=not body.stream)
            run = Run(
                run_id,
                mode,
                again,
                result,
                devices,
                waited_s * 1000,
                *speculative,
                token_bytes=verifier.ready.token_bytes,
            )
            async with self._counted(run):
                yield run

    async def _workers(self) -> tuple[WorkerClient, WorkerClient | None]:
        """The live verifier and drafter (None: no draft model), waiting for a restarting
        one up to ``restart_wait_s`` (``WorkerUnavailable``)."""
        roles, wait_s = self.supervisor.roles, self.config.restart_wait_s
        verifier = await self.supervisor.worker(roles.verifier, wait_s)
        if self.config.draft is None:
            return verifier, None
        return verifier, await self.supervisor.worker(roles.drafter, wait_s)

    @contextlib.asynccontextmanager
    async def _counted(self, run: Run) -> AsyncIterator[Run]:
        """Yield ``run``; however it ends, stop its decoding and count it in the metrics."""
        result = run.result
        try:
            yield run
        except (asyncio.CancelledError, ConnectionError):  # the client left (or we stop)
            result.done_reason = "cancelled"
            raise
        except Exception:  # answered as an error (collect); stream() already says so
            result.done_reason = "error"
            raise
        finally:
            await run.pieces.aclose()  # a stream left early: stop its decoding now
            if result.tokens or result.prompt_tokens:
                self.metrics.observe_generation(
                    mode=run.mode,
                    reason=result.done_reason,
                    prompt_tokens=result.prompt_tokens,
                    tokens=len(result.tokens),
                    ttft_ms=result.ttft_ms,
                    decode_ms=result.decode_ms,
                    speculative=run.speculative(),
                )

    @contextlib.asynccontextmanager
    async def _start_pipeline(
        self, body: GenerateRequest, mode: str, waited_s: float
    ) -> AsyncIterator[Run]:
        """A run decoded through the pipeline's stages: FlowSpec's schedule in every
        speculative mode, the plain pipeline in autoregressive mode."""
        if body.logprobs is not None:
            raise ApiError(400, "logprobs are not available through the pipeline")
        try:
            drafter = await self.supervisor.worker(
                self.supervisor.roles.drafter, self.config.restart_wait_s
            )
        except WorkerUnavailable as error:
            raise ApiError(503, str(error), retry_after_s=5) from None
        run_id = f"{int(self.started_wall):x}-{next(self._run_ids)}"
        devices = {"target": "pipeline", "draft": drafter.ready.device}
        async with self.slots.lease(run_id, self.supervisor.settled) as slot:
            result = GenerationResult()
            pieces = self.pipeline.generate(
                body,
                drafter,
                result,
                arena=self.arena,
                slot=slot,
                speculative=mode != "autoregressive",
            )
            run = Run(
                run_id,
                mode,
                pieces,
                result,
                devices,
                waited_s * 1000,
                token_bytes=drafter.ready.token_bytes,
            )
            async with self._counted(run):
                yield run

    async def _again_if_died(
        self, pieces, verifier: WorkerClient, drafter: WorkerClient, reset, *, whole: bool
    ) -> AsyncIterator[str]:
        """``pieces(verifier, drafter)``, started over once (after ``reset()``) with the
        restarted workers when a worker dies before anything reached the client: before the
        first piece, or for a ``whole`` (not streamed) request before the last. That is a
        worker killed just before the request came, its death noticed only during it."""
        stream = pieces(verifier, drafter)
        for retry in (True, False):
            try:
                if whole:  # the client gets nothing before the end anyway
                    held = [piece async for piece in stream]
                else:
                    held = [piece async for piece in _first(stream)]
            except WorkerDied as error:
                if not retry:
                    raise
                reason = str(error)
            else:
                workers = [c for c in (verifier, drafter) if c is not None]
                dead = [] if whole else [c for c in workers if c.died.done()]
                if not (retry and dead):
                    break
                reason = f"the {dead[0].spec.name} worker {dead[0].died.result()}"
            await stream.aclose()
            log.info(
                "a worker died before the request answered anything; starting over", reason=reason
            )
            reset()
            verifier, drafter = await self._workers()
            stream = pieces(verifier, drafter)
        try:
            for piece in held:
                yield piece
            async for piece in stream:
                yield piece
        finally:
            await stream.aclose()


async def _first(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """The first piece of ``stream`` (none if it is empty), leaving the rest in it."""
    async for piece in stream:
        yield piece
        return


def _model_name(target: ModelPaths) -> str:
    """The name /v1/models serves: the target's folder name (the bundled pair: hetspec-demo),
    or its GGUF's name without ``.gguf`` where it has no folder."""
    if not target.folder:
        return Path(target.gguf).stem
    path = Path(target.folder).resolve()
    return "hetspec-demo" if path == (BUNDLED_MODELS / "target").resolve() else path.name


@contextlib.asynccontextmanager
async def _no_slot() -> AsyncIterator[int]:
    """The feature slot of a pair whose drafter reads no features: none (-1)."""
    yield -1
