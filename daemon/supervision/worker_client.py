"""The daemon's side of one worker process: spawn, handshake, calls, death detection, stop.

A ``WorkerClient`` is one incarnation of a worker. It binds two fresh ZeroMQ endpoints in the
runtime directory (so nothing queued for a dead incarnation can reach the next one), starts
``python -m hetspec.workers.process`` as a new interpreter, and waits for ``Hello`` (protocol
version) and then ``Ready`` (model loaded). Death is noticed three ways: the process exits
(asyncio watches it), its heartbeats stop (it is killed), or, the other way round, the daemon
dies and the worker sees EOF on its death pipe. When the worker dies every call in flight
fails at once with ``WorkerDied``; nothing waits for a reply that cannot come. Nor does a call
whose command or reply was lost: while it is pending the worker's heartbeats say it is idle
(``Heartbeat.busy``), and after ``LOST_AFTER_IDLE_BEATS`` such beats the call fails.

A cancelled call is not over for the worker: its command may be running, writing the arena
slot it names. It is kept until the worker answers it (or is idle for those beats, or dies),
and ``settled`` says when every call in flight is over, so that a slot is lent again only
then.

Only a decoded, well-formed message refreshes the worker's liveness: junk on the replies
endpoint must not keep a hung worker alive. The endpoints are created with mode 0600 whatever
the umask: whoever can connect to them can take the worker's commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import structlog
import zmq

from hetspec.daemon.supervision.prompt_bound import PromptBound
from hetspec.daemon.supervision.worker_calls import LOST_AFTER_IDLE_BEATS, PendingCall, PendingCalls
from hetspec.daemon.supervision.worker_errors import WorkerDied, WorkerError, WorkerStartError
from hetspec.daemon.supervision.worker_link import WorkerLink, bind_private
from hetspec.daemon.supervision.worker_spec import WorkerSpec, worker_argv
from hetspec.protocol import Codec, MessageError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import ArenaLayout

# The parts, a module each: worker_spec (what a worker is, its command line), worker_errors,
# worker_link (the endpoints and mailboxes), worker_calls (the calls in flight). What callers
# imported from here stays importable here.
__all__ = [
    "LOST_AFTER_IDLE_BEATS",
    "WorkerClient",
    "WorkerDied",
    "WorkerError",
    "WorkerSpec",
    "WorkerStartError",
    "bind_private",
]

log = structlog.get_logger("hetspec.daemon.worker")


def _exit_reason(code: int) -> str:
    """A process's end in words, from its return code (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with code {code}"
    return f"was killed by {signal.Signals(-code).name}"


class _Expired(Exception):
    """A call's timer fired before its reply came."""


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(_Expired())


@dataclass
class WorkerClient:
    spec: WorkerSpec
    runtime_dir: Path
    generation: int
    arena: ArenaLayout | None = None
    pid: int | None = None
    ready: m.Ready | None = None
    prompt_bound: PromptBound = field(default_factory=PromptBound)  # set at load
    died: asyncio.Future = field(init=False)  # resolves to the reason once the worker is gone

    def __post_init__(self) -> None:
        self._codec = Codec(m.Reply)
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._process: asyncio.subprocess.Process | None = None
        self._death_write: int | None = None
        self._last_beat = time.monotonic()
        self._last_reply = 0.0  # when the last call ended (time.monotonic())
        self._stopping = False
        self._handshake: asyncio.Future | None = None  # resolves to Hello
        self._loading: asyncio.Future | None = None  # resolves to Ready
        self.died = asyncio.get_running_loop().create_future()
        self._pending = PendingCalls(self.spec.name, self.died)
        self._link = WorkerLink(
            self.runtime_dir,
            self.spec.name,
            self.generation,
            self.died,
            reply_spin_us=self.spec.reply_spin_us,
            on_frames=self._dispatch,
            after_replies=self._pending.after_replies,
            awaiting=self._pending.awaiting,
        )

    # ------------------------------------------------------------ lifecycle

    async def start(self, load_timeout_s: float) -> m.Ready:
        """Spawn, handshake and load; raises ``WorkerStartError`` with the reason on failure
        (also when a resource runs out: descriptors, processes), and then leaves nothing
        behind: no process, no endpoint file, no descriptor."""
        started = time.perf_counter()
        try:
            ready = await self._start(load_timeout_s)
        except BaseException as error:
            await self.stop(grace_s=1.0)
            if isinstance(error, OSError | zmq.ZMQError):
                raise WorkerStartError(
                    f"cannot start the {self.spec.name} worker: {error}"
                ) from None
            raise
        log.info(
            "worker ready",
            worker=self.spec.name,
            pid=self.pid,
            device=ready.device,
            model=ready.model,
            load_ms=round(ready.load_ms),
            startup_ms=round((time.perf_counter() - started) * 1000),
        )
        return ready

    async def _start(self, load_timeout_s: float) -> m.Ready:
        self._link.bind()
        death_read, self._death_write = os.pipe()
        try:
            self._process = await self._spawn(death_read)
        finally:
            os.close(death_read)
        self.pid = self._process.pid
        loop = asyncio.get_running_loop()
        self._handshake = loop.create_future()
        self._link.listen()
        self._tasks = [
            asyncio.create_task(self._watch_exit(), name=f"{self.spec.name}-exit"),
            asyncio.create_task(self._watch_heartbeats(), name=f"{self.spec.name}-beats"),
        ]
        log.info(
            "worker started",
            worker=self.spec.name,
            pid=self.pid,
            runtime=self.spec.runtime,
            cores=list(self.spec.cores),
            spare_cores=list(self.spec.spare_cores),
        )
        hello = await self._wait(self._handshake, load_timeout_s, "say hello")
        if hello.protocol != m.PROTOCOL_VERSION:
            raise WorkerStartError(
                f"{self.spec.name} worker speaks protocol {hello.protocol}, the daemon "
                f"{m.PROTOCOL_VERSION}: reinstall hetspec so both come from one version"
            )
        load = m.Load(
            model=self.spec.model,
            settings=self.spec.settings,
            arena=self.arena,
            sequences=self.spec.sequences,
        )
        self._loading = loop.create_future()
        await self._link.send_first(self._codec.encode(load), load_timeout_s)
        try:
            self.ready = await self._wait(self._loading, load_timeout_s, "load its model")
            self.prompt_bound = PromptBound.of(self.ready.token_bytes, self.ready.special_tokens)
        except WorkerError as error:
            raise WorkerStartError(f"{self.spec.name} worker: {error.message}") from None
        return self.ready

    async def _spawn(self, death_read: int) -> asyncio.subprocess.Process:
        """Start the worker's interpreter, with the mailboxes when the link uses them."""
        link = self._link
        mailboxes = link.create_mailboxes(self.spec.mailbox)
        argv = worker_argv(
            self.spec, link.endpoint("commands"), link.endpoint("replies"), death_read, mailboxes
        )
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, pass_fds=[death_read, *mailboxes]
        )

    async def _wait(self, future: asyncio.Future, timeout_s: float, what: str):
        done, _ = await asyncio.wait(
            {future, self.died}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if future in done:
            return future.result()
        if self.died in done:
            raise WorkerStartError(
                f"{self.spec.name} worker {self.died.result()} before it could {what}"
            )
        raise WorkerStartError(f"{self.spec.name} worker did not {what} within {timeout_s:g} s")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the worker to exit; terminate, then kill, if it does not within ``grace_s``."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(zmq.ZMQError, WorkerError):  # no reader: signals follow
                self._link.send(self._codec.encode(m.Shutdown()))
            for action in (None, signal.SIGTERM, signal.SIGKILL):
                if action is not None:
                    with contextlib.suppress(ProcessLookupError):
                        process.send_signal(action)
                try:
                    await asyncio.wait_for(asyncio.shield(process.wait()), grace_s)
                    break
                except TimeoutError:
                    log.warning(
                        "worker slow to stop",
                        worker=self.spec.name,
                        pid=self.pid,
                        next_step=str(action or "SIGTERM"),
                    )
        await asyncio.sleep(0)  # let the exit watcher fail outstanding calls
        self._mark_dead("was stopped")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()

    def kill(self) -> None:
        """SIGKILL the worker now (a hung one); the exit watcher does the rest."""
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()

    def _close_sockets(self) -> None:
        """Close what ``_start`` got so far, however far it got."""
        self._link.close()
        if self._death_write is not None:
            os.close(self._death_write)
            self._death_write = None

    def _mark_dead(self, reason: str) -> None:
        if not self.died.done():
            self.died.set_result(reason)
        pending = self._pending
        pending.fail_all(lambda call: WorkerDied(self.spec.name, f"{reason} during {call.command}"))
        pending.abandoned.clear()  # a dead worker writes nothing more
        pending.wake_settled()

    async def _watch_exit(self) -> None:
        reason = _exit_reason(await self._process.wait())
        if self._stopping:
            log.info("worker exited", worker=self.spec.name, pid=self.pid, reason=reason)
        elif not self.died.done():
            log.warning("worker died", worker=self.spec.name, pid=self.pid, reason=reason)
        self._mark_dead(reason)

    async def _watch_heartbeats(self) -> None:
        """Kill the worker once it is silent for ``heartbeat_timeout_s``, counted from its
        Hello: until then its interpreter is starting (seconds on a busy box), and
        ``load_timeout_s`` bounds that."""
        await self._handshake
        while True:
            await asyncio.sleep(self.spec.heartbeat_s)
            silent = time.monotonic() - self._last_beat
            if silent > self.spec.heartbeat_timeout_s:
                log.error(
                    "worker stopped answering; killing it",
                    worker=self.spec.name,
                    pid=self.pid,
                    silent_s=round(silent, 1),
                )
                self.kill()
                return

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            reply = self._codec.decode(frames)
        except MessageError as error:
            log.error("malformed reply from worker", worker=self.spec.name, error=str(error))
            return
        self._last_beat = time.monotonic()  # only a well-formed message shows it is alive
        if self._control(reply):
            return
        request = getattr(reply, "request", None)
        if isinstance(reply, m.Failed) and request is None:
            # a command the worker could not read; which one is unknown, so none of those
            # pending is answered: fail them all now rather than at call_timeout_s
            log.error(
                "worker could not read a command",
                worker=self.spec.name,
                kind=reply.kind,
                error=reply.message,
                failing=len(self._pending.calls),
            )
            self._pending.fail_all(
                lambda call: WorkerError(self.spec.name, reply.kind, reply.message)
            )
            return
        self._pending.answer(request, reply, frames)

    def _control(self, reply: msgspec.Struct) -> bool:
        """Handle a message that answers no call (heartbeat, handshake, load); False if not."""
        if isinstance(reply, m.Heartbeat):
            if reply.busy is None and (self._pending.calls or self._pending.abandoned):
                self._pending.note_idle()
            return True
        if isinstance(reply, m.Hello):
            if self._handshake is not None and not self._handshake.done():
                self._handshake.set_result(reply)
            return True
        loading = self._loading is not None and not self._loading.done()
        if isinstance(reply, m.Ready) or (
            isinstance(reply, m.Failed) and reply.request is None and loading
        ):
            self._settle_load(reply)
            return True
        return False

    def _settle_load(self, reply: m.Ready | m.Failed) -> None:
        if self._loading is None or self._loading.done():
            return
        if isinstance(reply, m.Ready):
            self._loading.set_result(reply)
        else:
            self._loading.set_exception(WorkerError(self.spec.name, reply.kind, reply.message))

    # ------------------------------------------------------------ calls

    def next_request(self) -> int:
        return next(self._ids)

    def _send_call(self, request: int, command: msgspec.Struct, arrays=()) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.died.done():
            future.set_exception(WorkerDied(self.spec.name, self.died.result()))
            return future
        self._pending.calls[request] = PendingCall(future, type(command).__name__)
        # zero-copy pays only for big frames; pyzmq's zero-copy path costs more for small ones
        try:
            self._link.send(self._codec.encode(command, arrays), copy=not arrays)
        except WorkerError as refused:
            self._pending.calls.pop(request, None)
            # no reader because the process is gone, not because it is slow: ZeroMQ drops a
            # dead peer's pipe at once, often before the exit watcher runs
            ended = self._exit_status()
            if ended is None:
                future.set_exception(refused)
            else:
                log.warning("worker died", worker=self.spec.name, pid=self.pid, reason=ended)
                self._mark_dead(ended)
                future.set_exception(WorkerDied(self.spec.name, ended))
        return future

    def _exit_status(self) -> str | None:
        """How the worker's process ended, or None while it runs; leaves its exit status to
        the exit watcher (WNOWAIT)."""
        if self._process is None:
            return None
        try:
            ended = os.waitid(os.P_PID, self._process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already; the watcher's callback is still to run
            return "is gone"
        if ended is None:
            return None
        return _exit_reason(ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status)

    def announce(self) -> None:
        """Wake the worker to wait awake for a command about to be sent (the mailbox link's
        ``announce``; nothing over ZeroMQ alone), so that the command's own wake-up is off
        the path from now to its reply."""
        self._link.announce()

    async def call(self, command: msgspec.Struct, arrays: tuple[np.ndarray, ...] = ()):
        """Send ``command`` (whose ``request`` came from ``next_request``) and return the reply
        and its frames; raises ``WorkerError`` for a ``Failed`` reply and ``WorkerDied`` when
        the worker is gone. Cancelling the await sends ``Cancel`` to the worker where it can
        and always ends in ``CancelledError``; ``settled`` still counts the call until the
        worker is done with its command."""
        return await self._reply(command, self._send_call(command.request, command, arrays))

    def post(self, command: msgspec.Struct, arrays: tuple[np.ndarray, ...] = ()):
        """``call`` with its command sent now, not at the returned coroutine's first step
        (which waits for the event loop): await the coroutine, or wrap it in a task, for the
        reply, as from ``call``."""
        return self._reply(command, self._send_call(command.request, command, arrays))

    async def _reply(self, command: msgspec.Struct, future: asyncio.Future):
        request = command.request
        self._link.start_polling()
        # a timer handle instead of asyncio.wait_for, which costs ~50 us per call
        timer = asyncio.get_running_loop().call_later(self.spec.call_timeout_s, _expire, future)
        try:
            return await future
        except _Expired:
            log.error(
                "worker did not answer in time; killing it",
                worker=self.spec.name,
                pid=self.pid,
                op=type(command).__name__,
                timeout_s=self.spec.call_timeout_s,
            )
            self._pending.calls.pop(request, None)
            self.kill()
            raise WorkerError(
                self.spec.name,
                "timeout",
                f"no answer to {type(command).__name__} "
                f"within {self.spec.call_timeout_s:g} s; the worker is restarted",
            ) from None
        except asyncio.CancelledError:
            timer.cancel()
            call = self._pending.calls.pop(request, None)  # None: already answered
            if call is not None and not self.died.done():
                # until the worker is done with the command
                self._pending.abandoned[request] = call
                # best effort: a full queue (WorkerError "overloaded") or a closed socket must
                # not turn the cancellation into a failure; the command runs and is answered
                with contextlib.suppress(zmq.ZMQError, WorkerError):
                    self._link.send(self._codec.encode(m.Cancel(request=request)))
            raise
        finally:
            timer.cancel()
            self._last_reply = time.monotonic()

    def busy_within(self, seconds: float) -> bool:
        """Whether a call is in flight, or one ended less than ``seconds`` ago."""
        if self._pending.awaiting():
            return True
        return time.monotonic() - self._last_reply < seconds

    def settled(self) -> asyncio.Future:
        """A future that resolves once the worker is done with every call in flight now,
        awaited or cancelled: each answered, failed, given up as lost, or the worker gone.
        Until then a cancelled call's command may still run and write the slot it names."""
        return self._pending.settled()

    @property
    def alive(self) -> bool:
        return self.ready is not None and not self.died.done()

    def heard_within(self, seconds: float) -> bool:
        """Running (loading or ready) and heard from lately: what the systemd watchdog asks."""
        return not self.died.done() and time.monotonic() - self._last_beat <= seconds
