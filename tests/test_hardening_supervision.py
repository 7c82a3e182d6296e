"""Issue 18, part C: supervision that survives any failed restart, a backoff that grows,
heartbeats only from well-formed messages, calls that never wait for a lost command, and
worker endpoints only their owner can reach. Real daemons, real workers, real ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from test_daemon import CONTEXT, Daemon, UnixHTTPConnection, native, request
from test_worker_process import LOAD_TIMEOUT, spec
from tiny_models import write_tiny_pair

from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerError, WorkerStartError
from hetspec.protocol import worker_messages as m

pytestmark = pytest.mark.process

ROOT = os.geteuid() == 0
UMASK_000 = ["sh", "-c", 'umask 000 && exec "$@"', "sh"]
VOCAB = 320


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("models"), CONTEXT)


def open_fds() -> set[int]:
    """This process's descriptors (less the one listing them)."""
    listed = {int(fd) for fd in os.listdir("/proc/self/fd")}
    return {fd for fd in listed if os.path.exists(f"/proc/self/fd/{fd}")}


def limit_leaving(free: int) -> int:
    """The RLIMIT_NOFILE under which exactly ``free`` more descriptors can be opened (the
    limit bounds descriptor numbers, and a new one takes the lowest free number)."""
    taken = open_fds()
    return [fd for fd in range(max(taken) + free + 2) if fd not in taken][free]


def events(daemon: Daemon, event: str) -> list[dict]:
    lines = [
        json.loads(line) for line in daemon.log.read_text().splitlines() if line.startswith("{")
    ]
    return [line for line in lines if line.get("event") == event]


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def ready_health(daemon: Daemon) -> dict | None:
    with contextlib.suppress(OSError):
        status, health = request(daemon.socket, "GET", "/health")
        return health if status == 200 else None
    return None


# ------------------------------------------------------------------ item 3: supervision


async def test_a_start_that_fails_at_any_step_is_a_clear_error_and_leaves_nothing(
    gguf, tmp_path, arena
) -> None:
    """With the descriptors running out after 0, 1, 2, ... more, each step of a start fails
    in turn (sockets, binds, the death pipe, the spawn): always ``WorkerStartError``, never a
    socket file or a descriptor left behind."""
    zmq.Context.instance().socket(zmq.PUSH).close()  # the context's own descriptors, first
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spawned = False
    for extra in range(16):
        before = open_fds()
        client = WorkerClient(spec(gguf, "llama.cpp"), tmp_path, extra + 1, arena.layout)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit_leaving(extra), hard))
        try:
            await client.start(LOAD_TIMEOUT)
        except WorkerStartError as error:
            message = str(error)
        else:
            message = "cpu worker started"
            await client.stop()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert message.startswith(("cannot start the cpu worker", "cpu worker")), message
        assert not list(tmp_path.glob("*.sock")), extra
        for _ in range(200):  # ZeroMQ closes a socket's descriptors in its own threads
            if open_fds() == before:
                break
            await asyncio.sleep(0.01)
        assert open_fds() - before == set(), extra
        if client.pid is not None:  # every step before the spawn was covered
            spawned = True
            break
    assert spawned


def test_supervision_outlives_restarts_that_fail_for_want_of_descriptors(tmp_path, models) -> None:
    """The issue's case: a restart raises OSError/ZMQError (no descriptors left). It is
    logged and retried with a growing delay; a request meanwhile is answered 503 within
    restart_wait_s; once descriptors are back the worker is too, with no endpoint left over."""
    daemon = Daemon(tmp_path, models["target"], models["draft"], "--set", "restart_wait_s=1")
    try:
        health = daemon.wait_ready()
        held = UnixHTTPConnection(daemon.socket, timeout=10)  # accepted before the limit
        held.request("GET", "/health")
        assert held.getresponse().read()
        _, hard = resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (16, hard))
        try:
            os.kill(health["workers"]["cpu"]["pid"], signal.SIGKILL)
            wait_until(
                lambda: len(events(daemon, "worker restart failed")) >= 3,
                10,
                "three failed restarts",
            )
            started = time.monotonic()
            held.request("POST", "/api/generate", json.dumps(native("x", max_tokens=2)))
            response = held.getresponse()
            body = json.loads(response.read())
            assert time.monotonic() - started < 5
            assert response.status == 503, body
            message = body["error"]
            assert "the cpu worker is restarting and was not ready within 1 s" in message
        finally:
            resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (1024, hard))
            held.close()
        wait_until(lambda: ready_health(daemon), 20, "the worker back once descriptors are")
        failures = events(daemon, "worker restart failed")
        assert all(f["worker"] == "cpu" for f in failures)
        assert "Too many open files" in failures[0]["error"]
        delays = [e["in_s"] for e in events(daemon, "restarting worker")]
        assert delays[:3] == [0.2, 0.4, 0.8], delays
        assert ready_health(daemon)["workers"]["cpu"]["restarts"] == 1
        assert len(list(daemon.runtime_dir.glob("*.sock"))) == 4  # two per live worker
    finally:
        assert daemon.stop() == 0


def test_the_backoff_grows_while_restarted_workers_keep_dying(tmp_path, models) -> None:
    """A worker that dies again right after each restart (a full /dev/shm, a bad driver) is
    restarted after 0.2, 0.4, 0.8 s, not every 0.2 s for ever."""
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    try:
        pid = daemon.wait_ready()["workers"]["cpu"]["pid"]
        for _ in range(3):
            os.kill(pid, signal.SIGKILL)
            wait_until(
                lambda old=pid: (h := ready_health(daemon)) and h["workers"]["cpu"]["pid"] != old,
                30,
                "the restarted worker",
            )
            pid = ready_health(daemon)["workers"]["cpu"]["pid"]
        delays = [e["in_s"] for e in events(daemon, "restarting worker")]
        assert delays == [0.2, 0.4, 0.8]
    finally:
        assert daemon.stop() == 0


def test_a_request_while_a_worker_restarts_waits_for_it(tmp_path, models) -> None:
    """A killed worker is back within a second or two: a request sent meanwhile waits for
    it (up to restart_wait_s) instead of being refused; so does one sent right after the
    kill, before the daemon noticed the death (it starts over with the restarted worker)."""
    daemon = Daemon(tmp_path, models["target"], models["draft"])
    body = native("x", max_tokens=4, mode="sequential")
    try:
        health = daemon.wait_ready()
        for name, noticed in (("cpu", True), ("cpu", False), ("gpu", False), ("gpu", True)):
            os.kill(health["workers"][name]["pid"], signal.SIGKILL)
            if noticed:
                wait_until(lambda: not ready_health(daemon), 10, "the death noticed")
            status, answer = request(daemon.socket, "POST", "/api/generate", body)
            assert status == 200, (name, noticed, answer)
            wait_until(lambda: ready_health(daemon), 30, "both workers up")
            health = ready_health(daemon)
        assert [w["restarts"] for w in health["workers"].values()] == [2, 2]
    finally:
        assert daemon.stop() == 0


# ------------------------------------------------------------------ item 8: heartbeats


async def test_junk_frames_do_not_keep_a_hung_worker_alive(gguf, tmp_path, arena) -> None:
    worker = spec(gguf, "llama.cpp", heartbeat_s=0.2, heartbeat_timeout_s=1.5)
    client = WorkerClient(worker, tmp_path, 1, arena.layout)
    await client.start(LOAD_TIMEOUT)
    junk = zmq.Context.instance().socket(zmq.PUSH)
    junk.setsockopt(zmq.LINGER, 0)
    junk.connect(client._link.endpoint("replies"))
    try:
        os.kill(client.pid, signal.SIGSTOP)  # hung: no more heartbeats
        stopped = time.monotonic()
        while not client.died.done() and time.monotonic() - stopped < 8:
            junk.send(b"\x00not a message")
            await asyncio.sleep(0.1)
        assert client.died.done(), "a junk frame every 0.1 s kept the hung worker alive"
        assert client.died.result() == "was killed by SIGKILL"
        assert time.monotonic() - stopped < 1.5 + 1.5
    finally:
        junk.close()
        await client.stop()


# ------------------------------------------------------------------ item 9: lost commands


async def test_a_command_that_is_lost_fails_its_call_in_about_a_second(
    gguf, tmp_path, arena
) -> None:
    """A second PULL on the commands endpoint takes every other command (the issue's attack,
    as the same user): those calls fail after a few idle heartbeats, not at call_timeout_s.
    The link is ZeroMQ alone here: through mailboxes (memfds only the two processes hold)
    no command can be taken, but the detection must work whatever loses a command."""
    worker = spec(gguf, "llama.cpp", heartbeat_s=0.2, mailbox=False)
    client = WorkerClient(worker, tmp_path, 1, arena.layout)
    await client.start(LOAD_TIMEOUT)
    thief = zmq.Context.instance().socket(zmq.PULL)
    thief.setsockopt(zmq.LINGER, 0)
    thief.connect(client._link.endpoint("commands"))
    await asyncio.sleep(0.3)  # connected: PUSH now deals commands to both
    outcomes = []
    try:
        for _ in range(4):
            started = time.monotonic()
            command = m.Tokenize(request=client.next_request(), text="def f():")
            try:
                await asyncio.wait_for(client.call(command), 10)
                outcomes.append("answered")
            except WorkerError as error:
                outcomes.append(f"{error.kind}: {error}")
            assert time.monotonic() - started < 3
        lost = (
            "lost: cpu worker: no answer to Tokenize: the worker is idle, so the command or "
            "its reply was lost"
        )
        assert set(outcomes) == {"answered", lost}, outcomes
        assert client.alive  # the worker itself is fine
    finally:
        thief.close()
        await client.stop()


@pytest.mark.parametrize("unreadable", ["junk", "the call's own command"])
async def test_a_command_the_worker_cannot_read_fails_the_pending_calls_at_once(
    gguf, tmp_path, arena, unreadable
) -> None:
    """The worker answers an unreadable command (junk, or a command the daemon encoded but the
    worker cannot decode: a codec mismatch) with Failed(request=None); which call it was is
    unknown, so every pending one fails with the worker's message instead of waiting for
    call_timeout_s; the worker serves on."""
    client = WorkerClient(spec(gguf, "llama.cpp", call_timeout_s=30), tmp_path, 1, arena.layout)
    await client.start(LOAD_TIMEOUT)
    try:
        text = "x"
        if unreadable == "junk":
            client._link.send([b"garbage"])  # by the mailbox where there is one
        else:
            text = 123  # encodes, but the worker's codec wants a str
        started = time.monotonic()
        with pytest.raises(WorkerError) as failure:
            await client.call(m.Tokenize(request=client.next_request(), text=text))
        assert failure.value.kind == "protocol"
        if unreadable != "junk":
            assert "Expected `str`, got `int`" in str(failure.value)
        assert time.monotonic() - started < 1
        reply, _ = await client.call(m.Tokenize(request=client.next_request(), text="x"))
        assert reply.tokens
    finally:
        await client.stop()


# ------------------------------------------------------------------ item 7: ipc permissions


@pytest.mark.skipif(not ROOT, reason="connecting as another user needs root")
async def test_worker_endpoints_are_the_owners_alone_whatever_the_umask(gguf, arena) -> None:
    runtime_dir = Path(tempfile.mkdtemp(prefix="hetspec-ipc-"))  # under /tmp: nobody may enter
    runtime_dir.chmod(0o755)
    client = WorkerClient(spec(gguf, "llama.cpp"), runtime_dir, 1, arena.layout)
    previous = os.umask(0)
    try:
        await client.start(LOAD_TIMEOUT)
        assert os.umask(0) == 0  # the daemon's own umask is left as it was
        for role in ("commands", "replies"):
            path = client._link.endpoint(role).removeprefix("ipc://")
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, role
            probe = subprocess.run(
                [
                    "/usr/bin/python3",
                    "-c",
                    "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])",
                    path,
                ],
                user="nobody",
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert probe.returncode != 0
            assert "PermissionError" in probe.stderr, probe.stderr
    finally:
        os.umask(previous)
        await client.stop()
        runtime_dir.rmdir()


def test_the_daemons_worker_endpoints_are_0600_under_umask_000(tmp_path, models) -> None:
    daemon = Daemon(tmp_path, models["target"], models["draft"], launcher=UMASK_000)
    try:
        daemon.wait_ready()
        endpoints = list(daemon.runtime_dir.glob("*.sock"))
        assert len(endpoints) == 4
        for path in endpoints:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        assert daemon.stop() == 0
