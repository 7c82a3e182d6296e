"""A request's turn to generate: from the HTTP layers' ``service.generation(body)`` to its run.

Contract: ``Generations.generation(body)`` is an async context manager that
- refuses what cannot run with an ``ApiError``: 503 while hetspecd drains or its workers
  load, 400 for a mode or gamma the configuration cannot serve, 429 when the queue is full;
- waits for the request's turn in the admission queue, then leases the arena slots of its run
  (each comes back once no call of the run may still write it, cancelled ones too);
- yields a ``Run`` whose pieces are decoded as the caller iterates them: by the target alone,
  in speculative rounds, or through the pipeline's stages; started over once, with the
  restarted workers, where a worker died before anything reached the client;
- however the run ends, stops its decoding and counts it in the metrics.
``in_flight`` counts the generations from their admission to their end; ``idle`` is set while
there are none (a drain waits for it). What a run decodes with (the workers, the arena, the
controllers, the pipeline) is the service's, as loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog

from hetspec.daemon.api.errors import ApiError
from hetspec.daemon.api.runs import Run
from hetspec.daemon.decode.admission import QueueFull, Seat
from hetspec.daemon.decode.autoregressive import generate
from hetspec.daemon.decode.engine import Decoder, WorkerPair
from hetspec.daemon.decode.requests import GenerateRequest, GenerationResult
from hetspec.daemon.decode.round_stats import SpeculativeStats
from hetspec.daemon.supervision.supervisor import WorkerUnavailable
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerDied
from hetspec.speculative.constrain.grammars import GrammarError
from hetspec.speculative.control.budget import BudgetController, ControllerConfig
from hetspec.speculative.control.rounds import Plan

if TYPE_CHECKING:
    from hetspec.daemon.service import Service

log = structlog.get_logger("hetspec.daemon")


class Generations:
    """The generations of ``service``: started, counted, and stopped however they end."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._run_ids = itertools.count(1)

    @contextlib.asynccontextmanager
    async def generation(self, body: GenerateRequest) -> AsyncIterator[Run]:
        """A turn to generate: waits in the queue, then yields the run (its pieces are
        produced as the caller iterates). Client errors are ``ApiError``s."""
        service = self.service
        if service.draining:
            raise ApiError(503, "hetspecd is shutting down", retry_after_s=5)
        try:
            mode = body.resolve_mode(service.config.mode)
        except ValueError as error:
            raise ApiError(400, f"invalid request: {error}") from None
        gamma = body.gamma or (service.config.gamma if mode == "parallel" else None)
        if service.config.draft is None and (gamma or mode in ("sequential", "parallel")):
            raise ApiError(
                400,
                f"mode {mode} with a draft length needs a draft model, and hetspecd serves "
                "its target without one: use mode adaptive (drafts from the text itself) "
                "or autoregressive",
            )
        if gamma and gamma * (body.branches or 1) + 1 > service.config.max_tree_nodes:
            raise ApiError(
                400,
                f"gamma x branches + 1 = {gamma * (body.branches or 1) + 1} "
                f"exceeds max_tree_nodes ({service.config.max_tree_nodes})",
            )
        if body.grammar is not None and service.pipeline is not None:
            raise ApiError(400, "structured output is not served by the pipeline placement yet")
        if service.supervisor is None or not service.supervisor.workers:
            raise ApiError(503, "the workers are still loading", retry_after_s=5)
        self.in_flight += 1
        self.idle.clear()
        try:
            async with service.admission.turn() as seat:
                service.metrics.queue_wait.observe(seat.waited_s)
                with service.batch_board.seated(seat.sequence):
                    async with self._start(body, mode, gamma, seat) as run:
                        yield run
        except QueueFull as error:
            raise ApiError(429, str(error), retry_after_s=error.retry_after_s) from None
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    @contextlib.asynccontextmanager
    async def _start(
        self, body: GenerateRequest, mode: str, gamma: int | None, seat: Seat
    ) -> AsyncIterator[Run]:
        service, waited_s = self.service, seat.waited_s
        if service.pipeline is not None:
            async with self._start_pipeline(body, mode, waited_s) as run:
                yield run
            return
        try:
            verifier, drafter = await self._workers()
        except WorkerUnavailable as error:
            raise ApiError(503, str(error), retry_after_s=5) from None
        constraint = await self._constraint(body, verifier)
        run_id = f"{int(service.started_wall):x}-{next(self._run_ids)}"
        devices = {"target": verifier.ready.device}
        if drafter is not None:
            devices["draft"] = drafter.ready.device
        # a slot comes back once no call of this run may still write it (cancelled ones too)
        settled = service.supervisor.settled
        head = drafter is not None and drafter.spec.runtime == "head"  # reads the features
        async with (
            service.slots.lease(run_id, settled) as draft_slot,
            service.slots.lease(run_id, settled) as verify_slot,
            service.slots.lease(run_id, settled) if head else _no_slot() as feature_slot,
        ):
            result = GenerationResult()
            stats, controller = SpeculativeStats(), service.controller(mode, seat.sequence)
            fixed = None  # the request's gamma fixes every round's plan
            if constraint is not None and mode == "autoregressive":
                # the worker decoding alone would draw unmasked: one masked choice a round,
                # with a controller of its own (it learns nothing of the modes')
                width = service.config.max_tree_nodes - 1
                fixed, controller = Plan(0), BudgetController(ControllerConfig.of(max_width=width))
            if gamma:
                overlap = mode != "sequential"
                branches = body.branches or (controller.limits.max_branches if body.dynamic else 1)
                if service.chains_only:  # see _load: one branch keeps the target's own output
                    branches = 1
                fixed = Plan(gamma, 1 if overlap else branches, overlap, body.dynamic)

            # with others beside it, a long prompt must not hold their rounds up for long
            chunk = service.config.prefill_chunk if service.admission.parallel > 1 else 0

            def pieces(verifier: WorkerClient, drafter: WorkerClient) -> AsyncIterator[str]:
                if mode == "autoregressive" and constraint is None:
                    return generate(
                        body,
                        verifier,
                        draft_slot,
                        result,
                        arena=service.arena,
                        cores=service.spare_cores,
                        sequence=seat.sequence,
                        prefill_chunk=chunk,
                    )
                pair = WorkerPair(
                    drafter,
                    verifier,
                    service.arena,
                    draft_slot,
                    verify_slot,
                    service.spare_cores,
                    service.verify_cores,
                    feature_slot,
                    seat.sequence,
                    chunk,
                    service.batch_board,
                )
                log = service.round_log and functools.partial(service.round_log.write, run_id, mode)
                lookup = service.lookup_source() if mode == "adaptive" else None
                grammar = None if constraint is None else constraint.fresh()  # per attempt
                decoder = Decoder(
                    body,
                    pair,
                    controller,
                    stats,
                    plan=fixed,
                    log=log,
                    lookup=lookup,
                    constraint=grammar,
                )
                return decoder.stream(result)

            def reset() -> None:  # for a start over: what the first attempt counted goes
                started = result.started  # (the time to the first token counts the wait)
                result.__init__()
                result.started = started
                stats.__init__()

            # a grammar's rounds are counted in every mode (its forced tokens, its masks' cost)
            counted = mode != "autoregressive" or constraint is not None
            speculative = (stats, controller) if counted else (None, None)
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

    async def _constraint(self, body: GenerateRequest, verifier: WorkerClient):
        """The request's grammar compiled for the verifier's vocabulary (None: none asked);
        a 400 naming what is wrong with it."""
        if body.grammar is None:
            return None
        try:
            return await self.service.grammars.compile(body.grammar, verifier.ready)
        except GrammarError as error:
            raise ApiError(400, f"{body.grammar.field}: {error}") from None

    async def _workers(self) -> tuple[WorkerClient, WorkerClient | None]:
        """The live verifier and drafter (None: no draft model), waiting for a restarting
        one up to ``restart_wait_s`` (``WorkerUnavailable``)."""
        service = self.service
        roles, wait_s = service.supervisor.roles, service.config.restart_wait_s
        verifier = await service.supervisor.worker(roles.verifier, wait_s)
        if service.config.draft is None:
            return verifier, None
        return verifier, await service.supervisor.worker(roles.drafter, wait_s)

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
                self.service.metrics.observe_generation(
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
        service = self.service
        if body.logprobs is not None:
            raise ApiError(400, "logprobs are not available through the pipeline")
        if body.prompt_tokens is not None:
            raise ApiError(400, "prompt: the pipeline takes text, not token ids")
        try:
            drafter = await service.supervisor.worker(
                service.supervisor.roles.drafter, service.config.restart_wait_s
            )
        except WorkerUnavailable as error:
            raise ApiError(503, str(error), retry_after_s=5) from None
        run_id = f"{int(service.started_wall):x}-{next(self._run_ids)}"
        devices = {"target": "pipeline", "draft": drafter.ready.device}
        async with service.slots.lease(run_id, service.supervisor.settled) as slot:
            result = GenerationResult()
            pieces = service.pipeline.generate(
                body,
                drafter,
                result,
                arena=service.arena,
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


@contextlib.asynccontextmanager
async def _no_slot() -> AsyncIterator[int]:
    """The feature slot of a pair whose drafter reads no features: none (-1)."""
    yield -1
