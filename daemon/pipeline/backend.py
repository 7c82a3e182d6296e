"""FlowSpec's pipeline inside hetspecd: the stages verify, the CPU worker's draft model drafts.

``PipelineBackend`` runs the daemon's local stages (``[pipeline] local``) as supervised
``hetspec-stage`` processes, restarted when they exit, reaches the other hosts' stages after
them, and decodes one request at a time through ``pipeline_tokens`` (the coordinator keeps
one session on the stages). The local stages and the coordinator share one key pair, so a
stage on another host admits just the coordinator's public key.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
import zmq

from hetspec.daemon.config import DaemonConfig
from hetspec.daemon.decode.requests import (
    GenerateRequest,
    GenerationResult,
    end_ids,
    token_budget,
)
from hetspec.daemon.decode.text_output import TextOutput
from hetspec.daemon.pipeline.coordinator import (
    FIRST_ANSWER_S,
    PipelineClient,
    PipelineError,
    StageAddress,
    StagesSilent,
    no_draft,
    pipeline_tokens,
)
from hetspec.daemon.pipeline.drafter import PipelineDrafter, TreeShape
from hetspec.daemon.pipeline.local_stages import LocalStages
from hetspec.daemon.supervision.supervisor import StartupError, config_number_of
from hetspec.daemon.supervision.worker_client import WorkerClient
from hetspec.protocol import Arena
from hetspec.protocol import worker_messages as m
from hetspec.protocol.curve_keys import CurveKeyError, load_secret, make_keys
from hetspec.speculative.flow.layer_split import SplitError, parse_range
from hetspec.speculative.verify.samplers import sampler_for

log = structlog.get_logger("hetspec.daemon")

# slots kept free for the tree's nodes beyond the committed context (segments in flight,
# computed nodes awaiting their commit, expansion chains), in the stages' caches and the
# drafter's: a request's prompt and tokens fit in the rest
TREE_SLOTS = 64


class PipelineStartError(RuntimeError):
    """The pipeline cannot serve: a stage did not start, or the stages do not fit together."""


class PipelineBackend:
    def __init__(self, config: DaemonConfig, runtime_dir: Path) -> None:
        self.config, self.settings = config, config.pipeline
        self.folder = runtime_dir / "pipeline"
        self.local: LocalStages | None = None
        # set once every stage said Ready (so ``context`` is known) until stop: the daemon
        # serves, and counts as ready, only while it is set
        self.client: PipelineClient | None = None
        self.context = 0  # the smallest stage cache's slots, as the stages said at start
        self.restarts = 0
        self._turn = asyncio.Lock()  # one session on the stages at a time
        self._watcher: asyncio.Task | None = None
        self._starting: set[int] = set()  # local stages being restarted (still loading)
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the local stages and check that every stage answers and that together they
        hold the target's layers once; ``PipelineStartError`` if not. ``client`` is set only
        after that, with ``context`` from the stages' ``Ready``."""
        settings = self.settings
        try:
            layers = config_number_of(self.config.target.folder, "num_hidden_layers")
            bounds = [parse_range(text, layers) for text in settings.local]
            if bounds and (
                bounds[0][0] != 0 or any(a != b for (_, a), (b, _) in itertools.pairwise(bounds))
            ):
                raise SplitError(
                    f"local stages {settings.local} are not consecutive ranges from layer 0"
                )
            identity = self._identity()
            remote = [StageAddress(s.endpoint, Path(s.key)) for s in settings.stages]
        except (SplitError, CurveKeyError, StartupError, OSError) as error:
            raise PipelineStartError(f"pipeline: {error}") from None
        addresses = list(remote)
        if bounds:
            local = self.folder / "local"  # what an earlier run left: its keys stay out
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir(parents=True)
            self.local = LocalStages(
                local,
                Path(self.config.target.folder),
                bounds,
                threads=settings.threads,
                identity=identity,
            )
            try:
                await asyncio.to_thread(self.local.wait, None, self.config.load_timeout_s)
            except RuntimeError as error:
                self.local.stop()
                raise PipelineStartError(f"pipeline: {error}") from None
            addresses = self.local.addresses + addresses
        client = None
        try:
            client = PipelineClient(addresses, identity, settings.listen, settings.timeout_s)
            ready = await client.reset(timeout_s=max(settings.timeout_s, FIRST_ANSWER_S))
        except BaseException as error:
            if client is not None:  # not published yet: stop() would not close it
                client.close()
            if not isinstance(error, (PipelineError, CurveKeyError, zmq.ZMQError)):
                raise  # cancelled: whoever cancels the start stops the backend
            await self.stop()
            raise PipelineStartError(f"pipeline: {error}") from None
        # published only now: until every stage's Ready (a remote stage's can take seconds)
        # the context is unknown, and a request sized by it would be refused as too long
        self.context = min(answer.context for answer in ready)
        self.client = client
        if self.local is not None:
            self._watcher = asyncio.create_task(self._watch(), name="watch-stages")
        log.info(
            "pipeline ready",
            stages=len(addresses),
            local=settings.local,
            remote=[s.endpoint for s in settings.stages],
        )

    def _identity(self) -> Path:
        """The coordinator's (and local stages') secret key: the configured one, else a
        new pair for this run."""
        if self.settings.key is not None:
            load_secret(Path(self.settings.key))  # CurveKeyError: missing, or readable by others
            return Path(self.settings.key)
        keys = self.folder / "keys"
        if keys.exists():  # left by an earlier run of this daemon: a new pair each run
            for old in keys.iterdir():
                old.unlink()
        make_keys(keys, ["coordinator"])
        return keys / "coordinator.key_secret"

    async def _watch(self) -> None:
        """Restart a local stage whenever it exits, with the workers' backoff."""
        first, largest = self.config.restart_backoff_s
        delay = first
        while not self._stopping:
            await asyncio.sleep(0.05)
            for index, process in enumerate(self.local.processes):
                if process is None or process.poll() is None:
                    continue
                log.warning(
                    "restarting pipeline stage", stage=index, code=process.returncode, in_s=delay
                )
                await asyncio.sleep(delay)
                started = time.monotonic()
                self._starting.add(index)
                self.local.start(index)
                try:
                    await asyncio.to_thread(self.local.wait, index, self.config.load_timeout_s)
                except RuntimeError as error:
                    log.error("pipeline stage restart failed", stage=index, error=str(error))
                    delay = min(delay * 2, largest)
                    continue
                finally:
                    self._starting.discard(index)
                self.restarts += 1
                delay = first
                log.info(
                    "pipeline stage restarted",
                    stage=index,
                    restarts=self.restarts,
                    took_s=round(time.monotonic() - started, 2),
                )

    def _end_hung(self, silent: list[int], asked: list) -> None:
        """Kill the local stages among ``silent`` that still run: a stage that served, is
        alive and does not answer a ``Reset`` is hung; the watcher restarts what exits (one
        it is restarting is only loading still). ``asked``: the stages' processes when the
        request began; one started since (a restart) never had the request's ``Reset``."""
        for index in silent:
            if self.local is None or index >= len(asked) or index in self._starting:
                continue
            process = self.local.processes[index]
            if process is not None and process is asked[index] and process.poll() is None:
                log.warning("pipeline stage hung: killing it", stage=index, pid=process.pid)
                process.kill()

    async def stop(self) -> None:
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.local is not None:
            self.local.stop()

    def health(self) -> dict:
        local = []
        if self.local is not None:
            for index, process in enumerate(self.local.processes):
                local.append(
                    {
                        "layers": self.settings.local[index],
                        "pid": process.pid if process else None,
                        "alive": process is not None and process.poll() is None,
                    }
                )
        return {
            "local": local,
            "remote": [s.endpoint for s in self.settings.stages],
            "restarts": self.restarts,
        }

    # ------------------------------------------------------------ requests

    async def generate(
        self,
        request: GenerateRequest,
        drafter: WorkerClient,
        result: GenerationResult,
        *,
        arena: Arena,
        slot: int,
        speculative: bool = True,
    ) -> AsyncIterator[str]:
        """Yield text pieces as tokens become final; ``result`` as the other modes fill it.
        Not ``speculative``: the target alone through the stages, one token at a time (the
        plain pipeline). A stage that fails or falls silent, or a backend not serving (still
        starting, or stopping), ends the request with ``PipelineError``."""
        if self.client is None:  # the stages' context is not known (yet, or any more)
            raise PipelineError("the pipeline is not serving: its stages are starting or stopping")
        ready = drafter.ready
        started = time.perf_counter()
        drafter.prompt_bound.check(request.prompt, min(ready.context, self.context))
        tokenized, _ = await drafter.call(
            m.Tokenize(request=drafter.next_request(), text=request.prompt)
        )
        prompt = tokenized.tokens
        max_tokens = token_budget(
            request, len(prompt), min(ready.context, self.context), room=TREE_SLOTS
        )
        async with self._turn:
            if self.client is None:
                raise PipelineError("the pipeline is stopping")
            if speculative:
                draft = PipelineDrafter(drafter, arena, TreeShape(), slot)
                await draft.start(prompt)
                schedule = {
                    "drafter": draft,
                    "segment_size": self.settings.segment,
                    "expand": draft.expand,
                }
            else:
                schedule = {"drafter": no_draft, "segment_size": 1, "in_flight": 1}
            asked = list(self.local.processes) if self.local is not None else []
            output = TextOutput(ready.token_bytes, request.stops, ready.special_tokens)
            ends = end_ids(request, ready.vocab)
            result.prompt_tokens = len(prompt)
            stream = pipeline_tokens(
                self.client,
                prompt,
                params=request.sampling,
                sampler=sampler_for(request.seed),
                **schedule,
            )
            decode_start = None
            try:
                async for tokens in stream:
                    if decode_start is None:
                        result.prompt_ms = (time.perf_counter() - started) * 1000
                        decode_start = time.perf_counter()
                    pieces = _take(tokens, result, output, ends, max_tokens)
                    if any(pieces):
                        yield "".join(pieces)
                    if result.done_reason == "stop" or len(result.tokens) >= max_tokens:
                        break
                if tail := output.flush():
                    yield tail
            except StagesSilent as error:
                self._end_hung(error.silent, asked)
                raise
            finally:
                await stream.aclose()
                if decode_start is not None:
                    result.decode_ms = (time.perf_counter() - decode_start) * 1000


def _take(
    tokens: list[int],
    result: GenerationResult,
    output: TextOutput,
    ends: frozenset[int],
    max_tokens: int,
) -> list[str]:
    """Add final ``tokens`` to ``result`` until the end of sequence, a stop string or the
    budget (``result.done_reason`` says which); their text pieces."""
    pieces = []
    for token in tokens:
        if token in ends:
            result.done_reason = "stop"
            break
        result.add(token)
        pieces.append(output.add(token))
        if output.stopped:
            result.done_reason = "stop"
            break
        if len(result.tokens) >= max_tokens:
            result.done_reason = "length"
            break
    return pieces
