"""``python -m hetspec.workers.process``: a worker process hosting one engine.

The daemon starts this as a fresh interpreter (never a fork: a process forked after llama.cpp
has decoded hangs, and forking after CUDA is unsafe) and talks to it over two ZeroMQ sockets
the daemon binds: commands (PUSH -> our PULL) and replies (our PUSH -> its PULL).

Two threads, so that liveness never depends on compute:
- the watchdog thread sends heartbeats (on its own socket: no socket is shared between
  threads) and exits the process when the daemon dies (the death pipe reaches EOF);
- the main thread receives commands (``CommandReader``: malformed ones are answered, ``Cancel``
  answers a queued command in its place), runs the engine one command at a time and sends
  each reply.
Torch and llama.cpp release the GIL while they compute, so heartbeats flow during long work.
Receiving on the compute thread instead of handing each command over from an I/O thread saves
a thread wake-up per command, which this project's round-trip budget cannot afford.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import structlog
import zmq

from hetspec.logs import configure_logging
from hetspec.protocol import Arena, ArenaError, Codec, MessageError, frame_array, frame_ref
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import SHM_DIR
from hetspec.protocol.mailbox import Mailbox, MailboxFull
from hetspec.protocol.sampling import SamplingError
from hetspec.speculative.verify.samplers import DrawnSampler, KeyedSampler, Sampler, sampler_for
from hetspec.speculative.verify.verdicts import RowsOnDemand, Verdict, verify_sampled
from hetspec.workers.runtimes.spare_cores import SPARE_CORES_SPIN_COUNT, SpareCores, openmp_places
from hetspec.workers.runtimes.tree_runtime import Interrupted, RuntimeUsageError

RUNTIMES = ("llama.cpp", "torch", "native", "head")
PR_SET_PDEATHSIG = 1
log = structlog.get_logger("hetspec.worker")


class LoadError(RuntimeError):
    """The model could not be loaded; the message says why."""


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL us when the daemon dies (a second guard besides the death pipe)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the death pipe alone guards
    if os.getppid() != parent:  # the daemon died before prctl took effect
        os._exit(1)


def load_runtime(kind: str, model: str, settings: m.RuntimeSettings):
    """Import and build the engine only now, in this process, after the cores are set."""
    options = {k: v for k, v in msgspec.structs.asdict(settings).items() if v is not None}
    if kind == "llama.cpp":
        from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppError, LlamaCppRuntime  # noqa: PLC0415

        if not isinstance(settings, m.LlamaCppSettings):
            raise LoadError("the llama.cpp worker takes llama.cpp settings")
        try:
            runtime = LlamaCppRuntime(model, **options)
            return runtime, "gpu (llama.cpp)" if runtime.offloaded else "cpu"
        except LlamaCppError as error:
            raise LoadError(str(error)) from None
    if kind == "native":
        from hetspec.native.kernels import NativeUnavailable  # noqa: PLC0415
        from hetspec.workers.runtimes.native_runtime import NativeRuntime  # noqa: PLC0415

        if not isinstance(settings, m.NativeSettings):
            raise LoadError("the native worker takes native settings")
        try:
            runtime = NativeRuntime(model, **options)
            return runtime, f"cpu (native, {runtime.kernels})"
        except NativeUnavailable as error:
            raise LoadError(str(error)) from None
    from hetspec.workers.runtimes.torch_runtime import ModelLoadError  # noqa: PLC0415

    if kind == "head":
        from hetspec.workers.runtimes.torch_runtime.head_runtime import HeadRuntime  # noqa: PLC0415

        if not isinstance(settings, m.HeadSettings):
            raise LoadError("the draft head's worker takes draft-head settings")
        try:
            runtime = HeadRuntime(model, **options)
        except ModelLoadError as error:
            raise LoadError(str(error)) from None
        return runtime, f"{runtime.device} (draft head)"
    if not isinstance(settings, m.TorchSettings):
        raise LoadError("the torch worker takes torch settings")
    return load_torch(model, settings, options)


def load_torch(model: str, settings: m.TorchSettings, options: dict):
    import torch  # noqa: PLC0415

    from hetspec.workers.runtimes.torch_runtime import ModelLoadError, TorchRuntime  # noqa: PLC0415

    if settings.matmul_tiling is not None:  # the fields it changes, as plain values
        tiling = msgspec.structs.asdict(settings.matmul_tiling)
        options["matmul_tiling"] = {k: v for k, v in tiling.items() if v is not None}
    try:
        runtime = TorchRuntime(model, **options)
        runtime.vocab_info()  # a folder without a usable tokenizer fails here, at load
    except ModelLoadError as error:
        raise LoadError(str(error)) from None
    except torch.cuda.OutOfMemoryError as error:  # weights, KV cache and graphs: say what helps
        why = (str(error).splitlines() or ["out of memory"])[0]
        raise LoadError(
            f"{model} does not fit in the GPU's free memory ({why}): a smaller gpu_worker."
            'max_context shrinks its KV cache, gpu_worker.weights = "int8" halves its weights'
        ) from None
    notes = ["int8 weights"] if runtime.weights == "int8" else []
    if runtime.matmul_refused:  # slower, never wrong: say so
        notes.append(f"matmul torch: the Triton kernel refused: {runtime.matmul_refused}")
    if runtime.in_place_differed:  # slower, never wrong: say so
        notes.append("chains gather their paths: in place differed")
    if runtime.attention == "split":
        how = "Triton kernel" if runtime.split_kernel else "torch"
        if runtime.split_kernel_refused:  # slower, never wrong: say so
            how += f"; its kernel refused: {runtime.split_kernel_refused}"
        notes.append(f"split attention, {how}")
    return runtime, f"{runtime.device} ({', '.join(notes)})" if notes else str(runtime.device)


def preload_runtime(kind: str) -> None:
    """Load the runtime's native libraries now. OpenMP (libgomp) counts the CPUs this
    process may use once, as it loads; loaded while the spare cores are allowed, its threads
    between two wide calls wait by spinning briefly, as they should. Loaded with the own
    cores only, it sees more threads than CPUs whenever a call computes wide and puts its
    threads to sleep after every step: 3 ms a demo-target token instead of 0.4."""
    modules = {
        "llama.cpp": "llama_cpp",
        "torch": "torch",
        "native": "hetspec.native._hsnative",
        "head": "torch",
    }
    with contextlib.suppress(ImportError):  # kernels not built: loading the model says so
        importlib.import_module(modules[kind])


class Watchdog(threading.Thread):
    """Sends heartbeats and exits the process when the daemon dies, whatever compute is doing."""

    def __init__(self, context: zmq.Context, args: argparse.Namespace) -> None:
        super().__init__(name="worker-watchdog", daemon=True)
        self.beats = context.socket(zmq.PUSH)
        self.beats.setsockopt(zmq.LINGER, 0)
        self.beats.connect(args.replies)
        self.codec = Codec(m.Command)
        self.death_fd = args.death_fd
        self.interval = args.heartbeat
        self.busy: int | None = None  # written by the compute thread, read here

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.death_fd, zmq.POLLIN)
        while True:
            beat = m.Heartbeat(sent=time.monotonic(), busy=self.busy)
            self.beats.send(self.codec.encode(beat)[0])
            if poller.poll(timeout=int(self.interval * 1000)):
                os._exit(3)  # EOF on the death pipe: the daemon is gone, and so is our purpose


class CommandReader:
    """The command socket, read by the compute thread itself.

    A hand-off from a receiving thread would cost a thread wake-up per command, and on an idle
    (virtual) CPU a wake-up costs tens of microseconds; so the compute thread receives, and
    after each command it spins for ``spin_s`` before it blocks, because in a speculative
    round the next command follows within a fraction of a millisecond. Whatever arrived
    with a command is drained into the backlog too, so a ``Cancel`` read there stops a
    command still queued.

    A ``Cancel`` for the command running now is remembered until the next one starts: a long
    one (a prompt's prefill) asks ``running_cancelled`` between its chunks. Any other
    ``Cancel`` for a command not in the backlog is dropped: the daemon sends a command before
    its ``Cancel``, on this one connection, so that command was answered already.
    Remembering such late cancels would grow without bound.

    With a ``mailbox`` the commands come through it (a socket message only where a marker in
    it says so), and spinning reads shared memory instead of asking ZeroMQ. A wake-up that
    announced a command (``Mailbox.announce``: the daemon knows the next draft follows a
    verification's verdict) but brought none is followed by a spin of ``ANNOUNCED_SPIN_S``,
    so that the command finds the reader awake.
    """

    ANNOUNCED_SPIN_S = 0.001  # the daemon posts the command ~0.1-0.5 ms after announcing it

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        spin_s: float,
        failed,
        mailbox: Mailbox | None = None,
    ) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.connect(endpoint)
        self.mailbox = mailbox
        self._bell = select.poll()  # where a sleeping reader waits for the mailbox's bell
        if mailbox is not None:
            self._bell.register(mailbox.bell_fd, select.POLLIN)
        self.spin_s = spin_s
        self.codec = Codec(m.Command)
        self.failed = failed  # how to answer a malformed or cancelled command
        self.backlog: deque[tuple[msgspec.Struct, list[bytes]]] = deque()
        self._announcements = 0  # announcements seen when the last command was taken
        self._running: int | None = None  # the request of the command taken last
        self._running_cancelled = False

    def _take(self, frames: list[bytes]) -> None:
        try:
            command = self.codec.decode(frames)
        except MessageError as error:
            self.failed(m.Failed(request=None, kind="protocol", message=str(error)))
            return
        if isinstance(command, m.Cancel):
            self._cancel(command.request)
        else:
            self.backlog.append((command, frames))

    def _cancel(self, request: int) -> None:
        """Answer the queued command ``request`` as cancelled and drop it; none queued: it
        was answered already, and the Cancel has nothing left to do."""
        for entry in self.backlog:
            if getattr(entry[0], "request", None) == request:
                self.backlog.remove(entry)
                self.failed(m.Failed(request=request, kind="cancelled", message="cancelled"))
                return
        if request == self._running:
            self._running_cancelled = True

    def running_cancelled(self) -> bool:
        """Whether the daemon has cancelled the command taken last (reads what came since)."""
        self._drain()
        return self._running_cancelled

    def _drain(self) -> None:
        if self.mailbox is not None:
            while (frames := self.mailbox.take()) is not None:
                # diverted: the daemon sent it on the socket before it posted the marker
                self._take(frames if isinstance(frames, list) else self.socket.recv_multipart())
            return
        while True:
            try:
                self._take(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _wait(self) -> None:
        """Sleep until a command may have come."""
        if self.mailbox is None:
            self._take(self.socket.recv_multipart())
            return
        self._bell.poll()
        self.mailbox.clear()  # before draining: a command posted after the drain rings again

    def next(self) -> tuple[msgspec.Struct, list[bytes]]:
        self._drain()  # a Cancel that came while the last command ran stops a queued one
        self._spin(self.spin_s)
        while not self.backlog:
            self._wait()
            self._drain()
            if not self.backlog and self._announced():
                self._spin(self.ANNOUNCED_SPIN_S)
        if self.mailbox is not None:  # announcements made before it are this command's
            self._announcements = self.mailbox.announcements()
        command = self.backlog.popleft()
        self._running = getattr(command[0], "request", None)
        self._running_cancelled = False
        return command

    def _spin(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        while not self.backlog and time.perf_counter() < deadline:
            self._drain()

    def _announced(self) -> bool:
        """Whether a command was announced since the last one was taken."""
        return self.mailbox is not None and self.mailbox.announcements() != self._announcements


class Worker:
    """The compute side: one engine, the arena, and the handlers for each command."""

    def __init__(
        self,
        kind: str,
        replies: zmq.Socket,
        watchdog: Watchdog,
        spare: SpareCores,
        outbox: Mailbox | None = None,
    ) -> None:
        self.kind = kind
        self.replies = replies
        self.outbox = outbox  # replies go here when the link uses mailboxes
        self.watchdog = watchdog
        self.spare = spare
        self.codec = Codec(m.Command)
        self.runtime = None
        self.arena: Arena | None = None
        self.sampler: Sampler = DrawnSampler()  # a request's, from its Prefill's seed
        # whether the daemon cancelled the command running now (see serve)
        self.cancelled: Callable[[], bool] = lambda: False
        self.handlers: dict[type, Callable] = {
            m.Load: self.load,
            m.Prefill: self.prefill,
            m.Draft: self.draft,
            m.Decode: self.decode,
            m.VerifyTree: self.verify,
            m.Commit: self.commit,
            m.Rollback: self.rollback,
            m.Tokenize: self.tokenize,
            m.Echo: self.echo,
        }

    def send(self, message: msgspec.Struct, arrays=()) -> None:
        frames = self.codec.encode(message, arrays)
        if self.outbox is not None:
            # replies are matched by request, not order: one too big for the ring (or one
            # the daemon has no room for yet) may overtake others by the socket
            with contextlib.suppress(MailboxFull):
                if self.outbox.post(frames):
                    self.outbox.ring()
                    return
        # zero-copy only pays for big frames; pyzmq's zero-copy path costs more for small ones
        self.replies.send_multipart(frames, copy=not arrays)

    def serve(self, commands: CommandReader) -> None:
        self.cancelled = commands.running_cancelled
        while True:
            command, frames = commands.next()
            if isinstance(command, m.Shutdown):
                return
            request = getattr(command, "request", None)
            self.watchdog.busy = request
            try:
                reply, arrays = self.handlers[type(command)](command, frames)
            except Exception as error:
                reply, arrays = self.failure(command, error), ()
            finally:
                self.watchdog.busy = None
            self.send(reply, arrays)

    def failure(self, command: msgspec.Struct, error: Exception) -> m.Failed:
        request = getattr(command, "request", None)
        if isinstance(error, LoadError):
            return m.Failed(request=request, kind="load", message=str(error))
        if isinstance(error, Interrupted):
            return m.Failed(request=request, kind="cancelled", message=str(error))
        if isinstance(error, RuntimeUsageError | SamplingError | ArenaError | MessageError):
            return m.Failed(request=request, kind="usage", message=str(error))
        where = traceback.extract_tb(error.__traceback__)[-1]
        log.error("command failed", op=type(command).__name__, exc_info=error)
        message = f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})"
        return m.Failed(request=request, kind="internal", message=message)

    # ------------------------------------------------------------ handlers

    def _engine(self, spare_cores: bool | None = None):
        """The runtime, computing on the spare cores too when a compute command says so
        (None: light work, which leaves the cores as they are)."""
        if self.runtime is None:
            raise LoadError("no model is loaded")
        if spare_cores is not None:
            self.spare.use(spare_cores, self.runtime.set_extra_threads)
        return self.runtime

    def _slot(self, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        if self.arena is None:
            raise ArenaError("no shared-memory arena was given at load")
        return self.arena.empty(slot, shape)

    def load(self, command: m.Load, frames) -> tuple:
        start = time.perf_counter()
        if self.runtime is not None:
            self.spare.use(False, self.runtime.set_extra_threads)
            getattr(self.runtime, "close", lambda: None)()
            self.runtime = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if command.arena is not None:
            # only a shared-memory object: never a file elsewhere the command happens to name
            if Path(command.arena.path).parent != SHM_DIR:
                raise LoadError(
                    f"the arena must be a shared-memory object in {SHM_DIR}, not "
                    f"{command.arena.path}"
                )
            self.arena = Arena.attach(command.arena)
        self.runtime, device = load_runtime(self.kind, command.model, command.settings)
        runtime = self.runtime
        if self.arena is not None:  # the widest tree a verification can send
            runtime.warm_up(self.arena.layout.slot_bytes // (runtime.vocab_size * 4))
            runtime.pin_host_memory(self.arena.memory())  # logits straight into the arena
        ready = m.Ready(
            model=command.model,
            device=device,
            vocab=runtime.vocab_info(),
            context=runtime.capacity,
            threads=runtime.threads,
            load_ms=(time.perf_counter() - start) * 1000,
            token_bytes=[runtime.token_bytes(i) for i in range(runtime.vocab_size)],
            special_tokens=runtime.special_tokens(),
        )
        log.info("model loaded", model=command.model, device=device, ms=round(ready.load_ms))
        return ready, ()

    def _features_in(self, engine, ref: m.ArrayRef, frames) -> np.ndarray:
        if not hasattr(engine, "provide_features"):
            raise RuntimeUsageError("this worker drafts without the target's features")
        if ref.frame < 1:
            raise MessageError("input features travel in a frame")
        return frame_array(ref, frames)

    @contextlib.contextmanager
    def _reporting(self, engine, wanted: bool):
        """Collect the features of what is evaluated inside the block, when ``wanted``."""
        if not wanted:
            yield None
            return
        with engine.features_captured() as sink:
            yield sink

    @staticmethod
    def _stacked(engine, sink: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(sink) if sink else np.zeros((0, engine.feature_size), np.float32)

    def _reported(self, reply, engine, sink: list[np.ndarray] | None) -> tuple:
        """``reply`` with the features ``sink`` collected, ending at the committed end, in a
        frame (none asked: as it is)."""
        if sink is None:
            return reply, ()
        rows = self._stacked(engine, sink)
        reply = msgspec.structs.replace(
            reply, features=frame_ref(rows, 1), features_start=engine.committed - len(rows)
        )
        return reply, (rows,)

    def prefill(self, command: m.Prefill, frames) -> tuple:
        start = time.perf_counter()
        engine = self._engine(command.spare_cores)
        engine.interrupt = self.cancelled  # a long prompt stops between chunks when cancelled
        try:
            with self._reporting(engine, command.report_features) as sink:
                if command.features is not None:
                    features = self._features_in(engine, command.features, frames)
                    reused = engine.prefill(
                        command.tokens, features=features, start=command.features_start
                    )
                else:
                    reused = engine.prefill(command.tokens)
        finally:
            engine.interrupt = None
        self.sampler = sampler_for(command.seed)
        logits = None
        if command.out >= 0:
            row = self._slot(command.out, (1, engine.vocab_size))
            row[0] = engine.last_logits()
            logits = m.ArrayRef(row.dtype.str, row.shape, slot=command.out)
        elapsed = (time.perf_counter() - start) * 1000
        committed = engine.committed
        reply = m.Prefilled(command.request, reused, committed, elapsed, logits)
        return self._reported(reply, engine, sink)

    def draft(self, command: m.Draft, frames) -> tuple:
        start = time.perf_counter()
        engine = self._engine(command.spare_cores)
        dynamic = command.dynamic is not None and command.after is None
        # a dynamic draft's shape is known only once drafted: it is copied to the slot then
        shape = (command.branches, command.steps, engine.vocab_size)
        out = None if dynamic else self._slot(command.out, shape)
        first = None  # the append's last token to evaluate: the draft's first forward
        one_chain = (
            command.tree is None
            and command.after is None
            and engine.chains_in_one_call(command.sampling, command.branches, command.dynamic)
        )
        if command.features is not None:
            features = self._features_in(engine, command.features, frames)
            if len(features) != len(command.append):
                raise RuntimeUsageError(
                    f"{len(command.append)} tokens to append but {len(features)} feature rows"
                )
            engine.append_after_features(command.append, features)
        elif command.append and one_chain:
            first = engine.catch_up(command.append)
        elif command.append:
            engine.append(command.append)  # what is new in one forward (llama.cpp: a batch)
        append_ms = (time.perf_counter() - start) * 1000
        forwards = engine.forwards
        if command.tree is not None:
            depth, top_k = command.tree
            tree = engine.draft_tree(
                depth,
                top_k,
                command.steps,
                command.sampling,
                self.sampler,
                first_accept=command.tree_first_accept,
            )
            probs = m.ArrayRef("<f4", (1, 0, engine.vocab_size), slot=command.out)
            reply = m.Drafted(
                command.request,
                [tree.tokens.tolist()],
                [tree.nodes.tolist()],
                probs,
                (time.perf_counter() - start) * 1000,
                append_ms,
                engine.forwards - forwards,
                parents=tree.parents.tolist(),
                acceptance=tree.acceptance.tolist(),
            )
            return reply, ()
        result = engine.draft(
            command.steps,
            command.sampling,
            self.sampler,
            branches=command.branches,
            out=out,
            after=command.after,
            dynamic=command.dynamic,
            first=first,
        )
        if out is None:
            out = self._slot(command.out, result.probs.shape)
            np.copyto(out, result.probs)
        probs = m.ArrayRef(out.dtype.str, out.shape, slot=command.out)
        elapsed = (time.perf_counter() - start) * 1000
        reply = m.Drafted(
            command.request,
            result.tokens.tolist(),
            result.nodes.tolist(),
            probs,
            elapsed,
            append_ms,
            engine.forwards - forwards,
            result.root,
        )
        return reply, ()

    def decode(self, command: m.Decode, frames) -> tuple:
        start = time.perf_counter()
        engine = self._engine(command.spare_cores)
        logprobs = [] if command.logprobs is not None else None
        with self._reporting(engine, command.report_features) as sink:
            if command.append:
                engine.append(command.append)
            tokens = engine.decode(
                command.steps,
                command.sampling,
                self.sampler,
                logprobs=logprobs,
                top=command.logprobs or 0,
            )
        elapsed = (time.perf_counter() - start) * 1000
        reply = m.Decoded(command.request, tokens, elapsed, logprobs or [])
        return self._reported(reply, engine, sink)

    def verify(self, command: m.VerifyTree, frames) -> tuple:
        start = time.perf_counter()
        engine = self._engine(command.spare_cores)
        first = 1 if command.root_row else 0
        out, logits, argmax, verdict = None, None, [], None
        walk = command.walk
        if walk is not None and (command.argmax_only or command.root_row):
            raise RuntimeUsageError("a sampled walk takes neither argmax_only nor root_row")
        if not command.argmax_only and walk is None:
            out = self._slot(command.out, (first + len(command.tokens), engine.vocab_size))
        if command.commit:
            engine.commit(command.commit)
        if command.root_row:
            root = engine.last_logits()
            if out is None:
                argmax.append(int(np.argmax(root)))
            else:
                out[0] = root
        with self._reporting(engine, command.features_out >= 0) as sink:
            tree = (command.tokens, command.parents)
            if walk is not None:
                rows = engine.evaluate_rows(*tree, extend=command.extend)
                verdict = self._walk(walk, command.tokens, command.parents, rows)
            elif out is None:
                argmax.extend(engine.evaluate_argmax(*tree, extend=command.extend))
            else:
                engine.evaluate_tree(*tree, extend=command.extend, out=out[first:])
        if command.spare_cores:  # give the drafter its cores back before it drafts
            self._engine(False)
        if out is not None:
            logits = m.ArrayRef(out.dtype.str, out.shape, slot=command.out)
        features = None
        if sink is not None:
            rows = self._stacked(engine, sink)
            target = self._slot(command.features_out, rows.shape)
            np.copyto(target, rows)
            features = m.ArrayRef(rows.dtype.str, rows.shape, slot=command.features_out)
        elapsed = (time.perf_counter() - start) * 1000
        path, bonus = (verdict.path, verdict.bonus) if verdict is not None else ([], -1)
        return m.Verified(command.request, logits, elapsed, features, argmax, path, bonus), ()

    def _walk(self, walk: m.SampledWalk, tokens: list[int], parents: list[int], rows) -> Verdict:
        """The verdict of ``walk`` over the draft below node 0 (the last round's bonus)."""
        if not parents or parents[0] != -1 or -1 in parents[1:]:
            raise RuntimeUsageError("a sampled walk needs one tree below its first node")
        draft_tokens, draft_parents = tokens[1:], [parent - 1 for parent in parents[1:]]
        if walk.keyed:
            if not isinstance(self.sampler, KeyedSampler):
                raise RuntimeUsageError("a keyed walk needs the request's Prefill with a seed")
            return verify_sampled(
                draft_tokens,
                draft_parents,
                rows,
                walk.sampling,
                position=walk.position,
                keyed=self.sampler,
            )
        if walk.draft is None or len(walk.draft_rows) != len(draft_tokens):
            raise RuntimeUsageError(
                f"a drawn walk over {len(draft_tokens)} drafted nodes needs "
                f"as many draft rows, not {len(walk.draft_rows)}"
            )
        if self.arena is None:
            raise ArenaError("no shared-memory arena was given at load")
        drafted = self.arena.view(walk.draft)
        drafted = drafted.reshape(-1, drafted.shape[-1])
        if not all(0 <= row < len(drafted) for row in walk.draft_rows):
            raise RuntimeUsageError(
                f"draft rows {walk.draft_rows} outside the draft's {len(drafted)}"
            )
        return verify_sampled(
            draft_tokens,
            draft_parents,
            rows,
            walk.sampling,
            position=walk.position,
            rng=np.random.default_rng(walk.seed),
            draft=RowsOnDemand.at(drafted, walk.draft_rows),
        )

    def commit(self, command: m.Commit, frames) -> tuple:
        start = time.perf_counter()
        engine = self._engine()
        engine.commit(command.nodes)
        if command.tokens:
            engine.append(command.tokens)
        elapsed = (time.perf_counter() - start) * 1000
        return m.Committed(command.request, engine.committed, elapsed), ()

    def rollback(self, command: m.Rollback, frames) -> tuple:
        start = time.perf_counter()
        engine = self._engine()
        engine.rollback(command.length)
        elapsed = (time.perf_counter() - start) * 1000
        return m.Committed(command.request, engine.committed, elapsed), ()

    def tokenize(self, command: m.Tokenize, frames) -> tuple:
        tokens = self._engine().tokenize(command.text, add_special=command.add_special)
        return m.Tokenized(command.request, tokens), ()

    def echo(self, command: m.Echo, frames) -> tuple:
        """Copy the array back: into slot ``out``, or as a frame when ``out`` is -1, after
        computing ``hold_us`` (a busy wait)."""
        until = time.perf_counter() + min(max(command.hold_us, 0.0), 1e6) / 1e6  # <= 1 s
        while time.perf_counter() < until:
            pass
        if command.data.frame >= 1:
            data = frame_array(command.data, frames)
        else:
            if self.arena is None:
                raise ArenaError("no shared-memory arena was given at load")
            data = self.arena.view(command.data)
        if command.out < 0:
            return m.Echoed(command.request, frame_ref(data, 1)), (data,)
        target = self._slot(command.out, data.shape)
        np.copyto(target, data, casting="no")
        return m.Echoed(
            command.request, m.ArrayRef(data.dtype.str, data.shape, slot=command.out)
        ), ()


def core_list(text: str) -> set[int]:
    return {int(core) for core in text.split(",") if core}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hetspec.workers.process")
    parser.add_argument("--runtime", choices=RUNTIMES, required=True)
    parser.add_argument("--name", required=True, help="how logs name this worker")
    parser.add_argument("--commands", required=True, help="ZeroMQ endpoint the daemon pushes to")
    parser.add_argument("--replies", required=True, help="ZeroMQ endpoint the daemon pulls from")
    parser.add_argument("--death-fd", type=int, required=True, help="read end of the death pipe")
    parser.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    parser.add_argument("--cores", default="", help="comma-separated cores this worker owns")
    parser.add_argument(
        "--spare-cores",
        default="",
        help="comma-separated cores of the other worker, used too when a command says so",
    )
    parser.add_argument("--heartbeat", type=float, default=0.5, help="seconds between beats")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=100,
        help="how long to poll for the next command before sleeping",
    )
    parser.add_argument(
        "--mailboxes",
        default="",
        help="inherited descriptors COMMANDS_MEMORY,COMMANDS_BELL,REPLIES_MEMORY,REPLIES_BELL "
        "of the shared-memory mailboxes (protocol/mailbox.py); none: ZeroMQ alone",
    )
    parser.add_argument("--log-format", choices=["json", "console"], default="json")
    args = parser.parse_args(argv)
    fds = [int(fd) for fd in args.mailboxes.split(",") if fd]
    if len(fds) not in (0, 4):
        parser.error("--mailboxes takes four descriptors")
    args.mailboxes = fds
    return args


def claim_cores(runtime: str, own: set[int], spare: set[int]) -> None:
    """Run on ``own`` cores, with OpenMP placed so that a wide call's extra threads run on the
    ``spare`` ones (see spare_cores.py); before any runtime is imported, since thread pools
    size themselves from the affinity and OpenMP reads its places as it loads."""
    if not own:
        return
    os.sched_setaffinity(0, own | spare)
    if spare - own:
        # replacing a user's OMP_PROC_BIND=false, which would stack the threads on one core
        os.environ.update(openmp_places(own, spare))
        os.environ.setdefault("GOMP_SPINCOUNT", SPARE_CORES_SPIN_COUNT)
        preload_runtime(runtime)
    os.sched_setaffinity(0, own)  # this thread, OpenMP's master, and threads it starts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    die_with_parent(args.parent)
    claim_cores(args.runtime, core_list(args.cores), core_list(args.spare_cores))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    configure_logging(log_format=args.log_format, worker=args.name, pid=os.getpid())

    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 2000)
    replies.connect(args.replies)
    watchdog = Watchdog(context, args)
    cores = sorted(os.sched_getaffinity(0))
    spare = SpareCores(cores, core_list(args.spare_cores))
    inbox = outbox = None
    if args.mailboxes:
        inbox, outbox = Mailbox.attach(*args.mailboxes[:2]), Mailbox.attach(*args.mailboxes[2:])
    worker = Worker(args.runtime, replies, watchdog, spare, outbox)
    commands = CommandReader(context, args.commands, args.spin_us / 1e6, worker.send, inbox)
    hello = m.Hello(
        protocol=m.PROTOCOL_VERSION,
        pid=os.getpid(),
        runtime=args.runtime,
        cores=cores,
        spare_cores=sorted(spare.spare),
    )
    worker.send(hello)
    watchdog.start()
    log.info("worker started", runtime=args.runtime, cores=cores)
    worker.serve(commands)
    log.info("worker stopping")
    if worker.arena is not None:
        worker.arena.close()
    replies.close()  # lingers until the last replies are out
    sys.stderr.flush()
    os._exit(0)  # the watchdog's socket would make a normal exit wait on zmq_ctx_term


if __name__ == "__main__":
    sys.exit(main())
