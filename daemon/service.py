"""The running daemon: instance lock, arena, supervised workers, HTTP on the Unix socket.

Lifecycle: take the runtime directory's lock and remove what a killed predecessor left; listen
at once (on the socket systemd passed, or our own; ``/health`` answers 503 while the workers
load); start both workers; tell systemd READY=1; serve. SIGTERM or SIGINT drains: STOPPING=1,
new requests get 503, the queue and the request in flight may finish (bounded by
``drain_timeout_s``), then the workers stop and the socket, the endpoints and the
shared-memory segment are removed. Every exit path runs that cleanup.

What the endpoints need of a running daemon is a module each: ``api.http_server`` (where it
listens and who may ask), ``api.generations`` (a request's turn to generate, counted for the
drain) and ``api.status`` (what ``/health``, ``/props`` and ``/metrics`` report). This module
keeps the lifecycle: the lock, loading, the workers, draining and the cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import structlog

from hetspec.daemon.api.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from hetspec.daemon.api.errors import ApiError
from hetspec.daemon.api.generations import Generations
from hetspec.daemon.api.http_server import HttpServer
from hetspec.daemon.api.runs import Run
from hetspec.daemon.config import BUNDLED_MODELS, DaemonConfig, ModelPaths, cache_dir
from hetspec.daemon.decode.admission import Admission
from hetspec.daemon.decode.batch_board import BatchBoard
from hetspec.daemon.decode.core_lending import CoreLending
from hetspec.daemon.decode.engine import LookupSource
from hetspec.daemon.decode.grammar_compiler import GrammarCompiler
from hetspec.daemon.decode.requests import GenerateRequest, check_messages_fit
from hetspec.daemon.decode.round_log import RoundLog
from hetspec.daemon.instance import Instance, InstanceError
from hetspec.daemon.load.head_choice import HeadChoiceError
from hetspec.daemon.load.model_facts import ModelFacts, read_model_facts
from hetspec.daemon.load.runtime_trials import (
    DrafterChoice,
    RuntimeChoiceError,
    RuntimeDecision,
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
    check_model_files,
    model_number_of,
    roles,
    worker_specs,
)
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec
from hetspec.daemon.systemd import Notifier, activated_sockets, watchdog_loop
from hetspec.protocol.arena import Arena, ArenaError
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.drafting.continuation_tree import ContinuationTree
from hetspec.speculative.drafting.ngram_table import NgramTable
from hetspec.speculative.drafting.prompt_lookup import PromptLookup

log = structlog.get_logger("hetspec.daemon")

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


# with several requests decoding, the drafter's cores are lent to the target once it has had
# no call for this long (0: whenever none is in flight). A cheap draft posted during a
# borrowing call shares a core with it for that draft's few milliseconds: measured on
# heavy-300m with four clients, lending whenever the drafter idles gave 98 tok/s against 74
# after 0.1 s quiet (the drafter is idle most of a round, yet never for 0.1 s)
DRAFTER_QUIET_S = 0.0

# arena slots a request holds: its draft's rows, its tree's logits, a head's features
RUN_SLOTS = 3


def arena_slot_count(config: DaemonConfig) -> int:
    """``arena_slots`` for one request, and a request's slots for each other one served at
    once."""
    return config.arena_slots + RUN_SLOTS * (config.max_parallel - 1)


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
        self.http = HttpServer(self)  # where it listens, once run() starts
        self.draining = False
        self.reloading = False  # SIGHUP: drain, then exit RELOAD_EXIT_STATUS
        self.generations = Generations(self)  # the requests' runs, counted for the drain
        self.admission = Admission(config.max_queue)  # one seat until the workers serve more
        self.slots = SlotPool(arena_slot_count(config))
        self.metrics = Metrics()
        self.round_log: RoundLog | None = None  # opened by run() where configured
        self.chat_template: ChatTemplate | None = None
        self._facts: dict[str, ModelFacts] = {}  # by path, read when first asked
        self.model_name = config.model_name or _model_name(config.target)
        # one controller for the daemon's life: costs measured in one request still hold
        self.controllers = mode_controllers(config)
        self._seat_controllers: dict[tuple[str, int], BudgetController] = {}  # see controller()
        self.batch_board = BatchBoard()  # what each seat's rounds put in a forward
        self.chains_only = False  # the verifier verifies chains only (set at load)
        self.grammars = GrammarCompiler()  # structured output: grammars for the target
        # whether the target decoding alone computes on the drafter's cores too: measured
        # for the daemon's life, by every mode
        # (lent only while one request decodes)
        alone, quiet = self._decoding_alone, self._drafter_quiet
        self.spare_cores = CoreLending(alone, quiet)
        self.verify_cores = CoreLending(alone, quiet)  # the same for a plain round's verification
        self._stop = asyncio.Event()
        self.started = time.monotonic()
        self.started_wall = time.time()

    def controller(self, mode: str, sequence: int) -> BudgetController | None:
        """Mode ``mode``'s controller for requests on seat ``sequence`` (None: the mode has
        none). Seat 0, where a lone user decodes, has the mode's own; another seat has its
        own too, first copied from seat 0's (what it measured holds for the others), so that
        requests decoding at once never interleave their plans in one controller."""
        base = self.controllers.get(mode)
        if base is None or sequence == 0:
            return base
        key = (mode, sequence)
        if key not in self._seat_controllers:
            self._seat_controllers[key] = copy.deepcopy(base)
        return self._seat_controllers[key]

    def _decoding_alone(self) -> bool:
        return self.admission.running <= 1

    def _drafter_quiet(self) -> bool:
        """Whether the drafter has had no call for ``DRAFTER_QUIET_S`` (or there is none)."""
        if self.supervisor is None:
            return False
        drafter = self.supervisor.workers.get(self.supervisor.roles.drafter)
        return drafter is None or not drafter.busy_within(DRAFTER_QUIET_S)

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
            await self.http.listen(activated_sockets)
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
            self._seat_controllers.clear()
            self.chains_only = chains_only
        own = len(set(verifier.cores)) or 1
        overlap_factor = (own + len(verifier.spare_cores)) / own  # spare: none of its own
        for controller in self.controllers.values():
            if costs is not None:
                controller.assume_verifier(costs)
            controller.assume_overlap_factor(overlap_factor)
        self.notifier.status("loading the models")
        await self._start_workers(specs, features=decision.runtime == "head")
        # as many requests at once as every worker serves sequences
        served = [client.ready.sequences for client in self.supervisor.workers.values()]
        self.admission.seat_count(min([self.config.max_parallel, *served]))
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
            arena_slot_count(self.config), self.config.max_tree_nodes * width * 4
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
            in_flight = self.generations.in_flight
            log.info("draining", signal=signal.Signals(signum).name, in_flight=in_flight)
            self.notifier.stopping()
        self.draining = True
        self._stop.set()

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.generations.idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            count = self.generations.in_flight
            log.warning("drain timed out; stopping with requests in flight", count=count)

    async def _cleanup(self) -> None:
        if self.http.runner is not None:
            await self.http.runner.cleanup()
        if self.pipeline is not None:
            await self.pipeline.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.arena is not None:
            self.arena.close()
        if self.round_log is not None:
            self.round_log.close()
        if self.http.own_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.http.own_socket.unlink()
        self.instance.release()
        log.info("stopped")

    def _load_chat_template(self) -> None:
        target = self.config.target
        self.chat_template = load_chat_template(target.folder, target.gguf)
        if self.chat_template is None:
            log.warning("the target model has no chat template; /v1/chat/completions is off")

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

    def generation(self, body: GenerateRequest) -> AbstractAsyncContextManager[Run]:
        """A turn to generate: waits in the queue, then yields the run (its pieces are
        produced as the caller iterates). Client errors are ``ApiError``s. See
        ``api.generations``."""
        return self.generations.generation(body)


def _model_name(target: ModelPaths) -> str:
    """The name /v1/models serves: the target's folder name (the bundled pair: hetspec-demo),
    or its GGUF's name without ``.gguf`` where it has no folder."""
    if not target.folder:
        return Path(target.gguf).stem
    path = Path(target.folder).resolve()
    return "hetspec-demo" if path == (BUNDLED_MODELS / "target").resolve() else path.name
