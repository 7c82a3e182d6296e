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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import structlog
import zmq

from hetspec.daemon.supervision.prompt_bound import PromptBound
from hetspec.protocol import Codec, MessageError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import ArenaLayout
from hetspec.protocol.mailbox import Mailbox, MailboxFull
from hetspec.protocol.mailbox import supported as mailboxes_supported

log = structlog.get_logger("hetspec.daemon.worker")


class WorkerError(RuntimeError):
    """A worker answered a command with ``Failed``; ``kind`` says what sort of failure."""

    def __init__(self, worker: str, kind: str, message: str, text: str | None = None) -> None:
        super().__init__(text or f"{worker} worker: {message}")
        self.worker, self.kind, self.message = worker, kind, message


class WorkerDied(WorkerError):
    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(worker, "died", reason, f"the {worker} worker {reason}")


def _exit_reason(code: int) -> str:
    """A process's end in words, from its return code (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with code {code}"
    return f"was killed by {signal.Signals(-code).name}"


class WorkerStartError(RuntimeError):
    """A worker could not be started or could not load its model."""


# Idle heartbeats received while a call is pending before the call counts as lost. The first
# may have been sent before the command arrived, and a reply may trail the beat that followed
# it by a moment (they travel on different connections): three span at least two intervals.
LOST_AFTER_IDLE_BEATS = 3


def bind_private(sock: zmq.Socket, endpoint: str) -> None:
    """Bind an ``ipc://`` endpoint that only this user can connect to, whatever the umask.

    libzmq creates the socket file inside ``bind`` in this thread, so a restrictive umask
    around it leaves no moment in which the file is open to others; the chmod repeats it in
    case the file system ignored the umask. (The umask is process-wide: the daemon's event
    loop is single-threaded and nothing else creates files while this runs.)
    """
    previous = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(previous)
    os.chmod(endpoint.removeprefix("ipc://"), 0o600)


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # "cpu" or "gpu": how logs and errors name it
    runtime: str  # "llama.cpp" or "torch"
    model: str
    settings: m.RuntimeSettings
    cores: tuple[int, ...] = ()
    # the other worker's cores, computed on too when a command says that worker is idle
    spare_cores: tuple[int, ...] = ()
    heartbeat_s: float = 0.5  # the worker's beat interval
    heartbeat_timeout_s: float = 10.0  # silence after which the worker is killed
    call_timeout_s: float = 300.0  # a command taking longer means a wedged engine: kill it
    log_format: str = "json"
    spin_us: float = 100.0  # how long the worker polls for its next command before it sleeps
    # after a call is sent, how long the daemon reads the replies mailbox on every pass of its
    # event loop, which then never sleeps (0: it waits for the bell, a wake-up per reply)
    reply_spin_us: float = 0.0
    # commands and replies through shared-memory mailboxes (protocol/mailbox.py) where they
    # work (x86-64 Linux); False, or elsewhere: through the ZeroMQ sockets alone
    mailbox: bool = True


class _Expired(Exception):
    """A call's timer fired before its reply came."""


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(_Expired())


@dataclass
class _Call:
    future: asyncio.Future
    command: str
    idle_beats: int = 0  # heartbeats saying the worker is idle since this was sent


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
        self._context = zmq.Context.instance()
        self._codec = Codec(m.Reply)
        self._calls: dict[int, _Call] = {}
        # cancelled calls the worker has not answered: it may still run them
        self._abandoned: dict[int, _Call] = {}
        self._settling: list[tuple[set[int], asyncio.Future]] = []  # see settled()
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._process: asyncio.subprocess.Process | None = None
        self._death_write: int | None = None
        self._last_beat = time.monotonic()
        self._reading = False  # the replies socket is registered with the event loop
        self._stopping = False
        self._handshake: asyncio.Future | None = None  # resolves to Hello
        self._outbox: Mailbox | None = None  # commands, when the link uses mailboxes
        self._inbox: Mailbox | None = None  # replies from the compute thread
        self._polling_until: float | None = None  # perf_counter; None: not polling (see call)
        self._loading: asyncio.Future | None = None  # resolves to Ready
        self.died = asyncio.get_running_loop().create_future()

    # ------------------------------------------------------------ lifecycle

    def _endpoint(self, role: str) -> str:
        return f"ipc://{self.runtime_dir}/{self.spec.name}-{self.generation}-{role}.sock"

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
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        bind_private(self._commands, self._endpoint("commands"))
        self._replies = self._context.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        bind_private(self._replies, self._endpoint("replies"))
        death_read, self._death_write = os.pipe()
        try:
            self._process = await self._spawn(death_read)
        finally:
            os.close(death_read)
        self.pid = self._process.pid
        loop = asyncio.get_running_loop()
        self._handshake = loop.create_future()
        loop.add_reader(self._replies.FD, self._on_readable)
        if self._inbox is not None:
            loop.add_reader(self._inbox.bell_fd, self._on_bell)
        self._reading = True
        self._on_readable()  # anything that arrived before the reader was registered
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
        load = m.Load(model=self.spec.model, settings=self.spec.settings, arena=self.arena)
        self._loading = loop.create_future()
        await self._send_first(self._codec.encode(load), load_timeout_s)
        try:
            self.ready = await self._wait(self._loading, load_timeout_s, "load its model")
            self.prompt_bound = PromptBound.of(self.ready.token_bytes, self.ready.special_tokens)
        except WorkerError as error:
            raise WorkerStartError(f"{self.spec.name} worker: {error.message}") from None
        return self.ready

    async def _spawn(self, death_read: int) -> asyncio.subprocess.Process:
        """Start the worker's interpreter, with the mailboxes when the link uses them."""
        inherited = [death_read]
        if self.spec.mailbox and mailboxes_supported():
            self._outbox = Mailbox.create()
            self._inbox = Mailbox.create()
            inherited += [*self._outbox.fds, *self._inbox.fds]
        argv = [
            sys.executable,
            "-m",
            "hetspec.workers.process",
            "--runtime",
            self.spec.runtime,
            "--name",
            self.spec.name,
            "--commands",
            self._endpoint("commands"),
            "--replies",
            self._endpoint("replies"),
            "--death-fd",
            str(death_read),
            "--parent",
            str(os.getpid()),
            "--cores",
            ",".join(map(str, self.spec.cores)),
            "--spare-cores",
            ",".join(map(str, self.spec.spare_cores)),
            "--heartbeat",
            str(self.spec.heartbeat_s),
            "--log-format",
            self.spec.log_format,
            "--spin-us",
            str(self.spec.spin_us),
        ]
        if self._outbox is not None:
            argv += ["--mailboxes", ",".join(map(str, inherited[1:]))]
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, pass_fds=inherited
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
                self._send(self._codec.encode(m.Shutdown()))
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
        replies = getattr(self, "_replies", None)
        if self._reading and not replies.closed:
            asyncio.get_running_loop().remove_reader(replies.FD)
            if self._inbox is not None:
                asyncio.get_running_loop().remove_reader(self._inbox.bell_fd)
            self._reading = False
        for box in (self._outbox, self._inbox):
            if box is not None:
                box.close()
        self._outbox = self._inbox = None
        for sock in (getattr(self, "_commands", None), getattr(self, "_replies", None)):
            if sock is not None:
                sock.close(linger=0)
        for role in ("commands", "replies"):
            with contextlib.suppress(OSError):  # never bound, or not ours to remove
                os.unlink(self._endpoint(role).removeprefix("ipc://"))
        if self._death_write is not None:
            os.close(self._death_write)
            self._death_write = None

    def _mark_dead(self, reason: str) -> None:
        if not self.died.done():
            self.died.set_result(reason)
        self._fail_calls(lambda call: WorkerDied(self.spec.name, f"{reason} during {call.command}"))
        self._abandoned.clear()  # a dead worker writes nothing more
        self._wake_settled()

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

    def _on_readable(self) -> None:
        """The replies socket's FD fired. ZeroMQ signals edges, so drain until it is empty.

        A plain socket with a reader callback, rather than zmq.asyncio: each reply then costs
        one callback instead of several futures and task switches (~100 us less a round trip).
        """
        while self._replies.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._dispatch(self._replies.recv_multipart(zmq.NOBLOCK))
        if self._settling:
            self._wake_settled()

    def _on_bell(self) -> None:
        """The replies mailbox's bell rang: reset it, then read every reply posted."""
        self._inbox.clear()
        self._read_inbox()

    def _read_inbox(self) -> None:
        while (frames := self._inbox.take()) is not None:
            if isinstance(frames, list):  # the worker never diverts: big replies just use zmq
                self._dispatch(frames)
        if self._settling:
            self._wake_settled()

    def _poll_replies(self) -> None:
        """Read the replies mailbox, and again on the event loop's next pass while a call is
        pending and the poll lasts: the loop then never sleeps, so a reply is read without
        waiting to be woken. Its bell still rings; ``_on_bell`` then finds nothing new."""
        until = self._polling_until
        if self._inbox is None or until is None:
            self._polling_until = None
            return
        self._read_inbox()
        if self._calls and time.perf_counter() < until and not self.died.done():
            asyncio.get_running_loop().call_soon(self._poll_replies)
        else:
            self._polling_until = None

    def _start_polling(self) -> None:
        """Poll the replies mailbox for ``reply_spin_us`` from now (``_poll_replies``)."""
        if self._inbox is None or self.spec.reply_spin_us <= 0:
            return
        polling = self._polling_until is not None
        self._polling_until = time.perf_counter() + self.spec.reply_spin_us / 1e6
        if not polling:
            asyncio.get_running_loop().call_soon(self._poll_replies)

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
                failing=len(self._calls),
            )
            self._fail_calls(lambda call: WorkerError(self.spec.name, reply.kind, reply.message))
            return
        call = self._calls.pop(request, None) if request is not None else None
        if call is None:
            if self._abandoned.pop(request, None) is None:  # else: a cancelled call's answer
                log.warning(
                    "reply nobody waits for",
                    worker=self.spec.name,
                    op=type(reply).__name__,
                    request=request,
                )
            return
        if call.future.done():
            return
        if isinstance(reply, m.Failed):
            call.future.set_exception(WorkerError(self.spec.name, reply.kind, reply.message))
        else:
            call.future.set_result((reply, frames))

    def _control(self, reply: msgspec.Struct) -> bool:
        """Handle a message that answers no call (heartbeat, handshake, load); False if not."""
        if isinstance(reply, m.Heartbeat):
            if reply.busy is None and (self._calls or self._abandoned):
                self._note_idle()
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

    def _note_idle(self) -> None:
        """The worker says it computes nothing while calls are pending: after enough such
        beats their commands (or replies) were lost; fail them instead of waiting for
        ``call_timeout_s``."""
        lost = []
        for request, call in self._calls.items():
            call.idle_beats += 1
            if call.idle_beats >= LOST_AFTER_IDLE_BEATS:
                lost.append(request)
        for request in lost:
            call = self._calls.pop(request)
            log.error(
                "command lost: the worker is idle and never answered",
                op=call.command,
                worker=self.spec.name,
                request=request,
            )
            if not call.future.done():
                call.future.set_exception(
                    WorkerError(
                        self.spec.name,
                        "lost",
                        f"no answer to {call.command}: the worker is idle, "
                        "so the command or its reply was lost",
                    )
                )
        # a cancelled command the idle worker never answered is not running either
        for request, call in list(self._abandoned.items()):
            call.idle_beats += 1
            if call.idle_beats >= LOST_AFTER_IDLE_BEATS:
                del self._abandoned[request]

    def _fail_calls(self, error_for) -> None:
        """Fail every pending call with ``error_for(call)``."""
        calls, self._calls = self._calls, {}
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(error_for(call))

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
        self._calls[request] = _Call(future, type(command).__name__)
        # zero-copy pays only for big frames; pyzmq's zero-copy path costs more for small ones
        try:
            self._send(self._codec.encode(command, arrays), copy=not arrays)
        except WorkerError as refused:
            self._calls.pop(request, None)
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

    async def _send_first(self, frames: list, timeout_s: float) -> None:
        """The first command: the worker's commands connection may still be in its handshake
        when its Hello arrives (a different socket), and until then PUSH has nowhere to send.
        A mailbox is there from the start."""
        if self._outbox is not None:
            self._send(frames)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._commands.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() > deadline or self.died.done():
                    raise WorkerStartError(
                        f"{self.spec.name} worker never connected its command socket"
                    ) from None
                await asyncio.sleep(0.001)

    def _send(self, frames: list, copy: bool = True) -> None:
        """Queue frames for the worker; zero-copy only for big arrays (pyzmq's zero-copy path
        costs more than a copy for small frames). Never blocks the event loop.

        With mailboxes, a message too big for the ring goes by the socket, and a marker in
        the ring says where it was, so that the worker reads commands in the order sent."""
        try:
            if self._outbox is None:
                self._commands.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                return
            if not self._outbox.post(frames):
                self._commands.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                self._outbox.divert()
            self._outbox.ring()
        except (zmq.Again, MailboxFull):
            raise WorkerError(
                self.spec.name, "overloaded", "its command queue is full (it stopped reading)"
            ) from None

    def announce(self) -> None:
        """Wake the worker to wait awake for a command about to be sent (the mailbox link's
        ``announce``; nothing over ZeroMQ alone), so that the command's own wake-up is off
        the path from now to its reply."""
        if self._outbox is not None and not self.died.done():
            with contextlib.suppress(OSError):  # a bell gone with the worker: nothing to wake
                self._outbox.announce()

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
        self._start_polling()
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
            self._calls.pop(request, None)
            self.kill()
            raise WorkerError(
                self.spec.name,
                "timeout",
                f"no answer to {type(command).__name__} "
                f"within {self.spec.call_timeout_s:g} s; the worker is restarted",
            ) from None
        except asyncio.CancelledError:
            timer.cancel()
            call = self._calls.pop(request, None)  # None: already answered
            if call is not None and not self.died.done():
                self._abandoned[request] = call  # until the worker is done with the command
                # best effort: a full queue (WorkerError "overloaded") or a closed socket must
                # not turn the cancellation into a failure; the command runs and is answered
                with contextlib.suppress(zmq.ZMQError, WorkerError):
                    self._send(self._codec.encode(m.Cancel(request=request)))
            raise
        finally:
            timer.cancel()

    def settled(self) -> asyncio.Future:
        """A future that resolves once the worker is done with every call in flight now,
        awaited or cancelled: each answered, failed, given up as lost, or the worker gone.
        Until then a cancelled call's command may still run and write the slot it names."""
        future = asyncio.get_running_loop().create_future()
        waiting = self._calls.keys() | self._abandoned.keys()
        if waiting and not self.died.done():
            self._settling.append((waiting, future))
        else:
            future.set_result(None)
        return future

    def _wake_settled(self) -> None:
        outstanding = self._calls.keys() | self._abandoned.keys()
        waiting = []
        for requests, future in self._settling:
            if future.done():  # given up by whoever waited
                continue
            if self.died.done() or not requests & outstanding:  # ids are never reused
                future.set_result(None)
            else:
                waiting.append((requests, future))
        self._settling = waiting

    @property
    def alive(self) -> bool:
        return self.ready is not None and not self.died.done()

    def heard_within(self, seconds: float) -> bool:
        """Running (loading or ready) and heard from lately: what the systemd watchdog asks."""
        return not self.died.done() and time.monotonic() - self._last_beat <= seconds
