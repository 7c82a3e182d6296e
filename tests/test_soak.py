"""A bounded soak and fault test (issue 18's probe, in the suite): a few hundred requests
from several clients, some left mid-stream, while workers are SIGKILLed and junk arrives on
the worker endpoints. Every request is answered within a bound (200, or an error with a JSON
body, never a hang), and the daemon's memory and descriptors stay flat."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
from test_daemon import CONTEXT, Daemon, UnixHTTPConnection, native, request
from tiny_models import write_tiny_pair

pytestmark = pytest.mark.process

REQUESTS = 400
CLIENTS = 4
ANSWER_WITHIN_S = 30  # a request not answered within this counts as a hang
KILL_EVERY = 50  # requests answered between two kills
FD_TOLERANCE = 6
RSS_TOLERANCE_KB = 24 * 1024
MODES = ("autoregressive", "sequential", "parallel", "adaptive")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("models"), CONTEXT)


def footprint(pid: int) -> tuple[int, int]:
    """(resident kB, open descriptors) of a process."""
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def one_request(sock: Path, index: int) -> tuple[str, int, str]:
    """(kind, status, what went wrong or "") for request ``index``; an error status must
    come with a JSON error object, a stream must end with a final document."""
    kind = (
        "generate",
        "generate",
        "generate",
        "generate",
        "left",
        "left",
        "stream",
        "bad",
        "health",
        "generate",
    )[index % 10]
    body = native(f"def f{index}(x):\n", max_tokens=8 + index % 17, mode=MODES[index % len(MODES)])
    connection = UnixHTTPConnection(sock, timeout=ANSWER_WITHIN_S)
    try:
        if kind == "health":
            connection.request("GET", "/health")
        elif kind == "bad":
            connection.request("POST", "/api/generate", b'{"prompt": ')
        else:
            connection.request(
                "POST", "/api/generate", json.dumps({**body, "stream": kind != "generate"})
            )
        response = connection.getresponse()
        if kind == "left" and response.status == 200:
            response.readline()  # one piece, then the client goes away
            return kind, 200, ""
        if kind == "stream" and response.status == 200:
            lines = [json.loads(line) for line in iter(response.readline, b"")]
            final = lines[-1] if lines else {}
            ok = final.get("done") and (final["done_reason"] != "error" or final.get("error"))
            return kind, 200, "" if ok else f"stream without a proper end: {final}"
        document = json.loads(response.read())
        if response.status == 200:
            return kind, 200, ""
        if kind == "health":  # 503 while a worker restarts: the document says so
            fine = document.get("status") in ("loading", "ready")
            return kind, response.status, "" if fine else f"not a health document: {document}"
        message = document.get("error")  # Ollama's shape: the message itself
        return kind, response.status, "" if message else f"no error message: {document}"
    except (OSError, ValueError) as error:  # socket.timeout is an OSError
        return kind, 0, f"{type(error).__name__}: {error}"
    finally:
        connection.close()


def chaos(daemon: Daemon, stop: threading.Event, answered: list, kills: list[str]) -> None:
    """Until ``stop``: every ``KILL_EVERY`` answered requests SIGKILL a worker (the two in
    turn), and throw junk at the worker endpoints: malformed frames on the replies sockets, a
    socket of the wrong type and raw garbage on the commands sockets."""
    context = zmq.Context.instance()
    names = itertools.cycle(("cpu", "gpu"))
    due = KILL_EVERY // 2
    while not stop.wait(0.05):
        if len(answered) < due:
            continue
        due += KILL_EVERY
        for path in daemon.runtime_dir.glob("*-replies.sock"):
            junk = context.socket(zmq.PUSH)
            junk.setsockopt(zmq.LINGER, 200)
            junk.connect(f"ipc://{path}")
            for frame in (b"", b"\xff" * 64, b'{"op": "heartbeat"}'):
                junk.send(frame)
            junk.close()
        for path in daemon.runtime_dir.glob("*-commands.sock"):
            wrong = context.socket(zmq.PUSH)  # PUSH to PUSH: ZeroMQ must refuse it
            wrong.setsockopt(zmq.LINGER, 0)
            wrong.connect(f"ipc://{path}")
            wrong.close()
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as raw:
                raw.connect(str(path))
                raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(256))
        with contextlib.suppress(OSError, ValueError):
            status, health = request(daemon.socket, "GET", "/health")
            if status == 200:
                name = next(names)
                os.kill(health["workers"][name]["pid"], signal.SIGKILL)
                kills.append(name)


@pytest.mark.slow
def test_soak_with_disconnects_worker_kills_and_junk(tmp_path, models) -> None:
    daemon = Daemon(tmp_path, models["target"], models["draft"], "--set", "restart_wait_s=20")
    try:
        daemon.wait_ready()
        pid = daemon.process.pid
        for index in range(20):  # warm up every path once, a restart included
            one_request(daemon.socket, index)
        os.kill(daemon.health()["workers"]["cpu"]["pid"], signal.SIGKILL)
        daemon.wait_ready()
        for index in range(20):
            one_request(daemon.socket, index)
        rss_before, fds_before = footprint(pid)

        stop, answered, kills = threading.Event(), [], []
        chaos_thread = threading.Thread(
            target=chaos, args=(daemon, stop, answered, kills), daemon=True
        )
        chaos_thread.start()
        started = time.monotonic()
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                list(
                    pool.map(
                        lambda i: answered.append(one_request(daemon.socket, i)), range(REQUESTS)
                    )
                )
            outcomes = list(answered)
        finally:
            stop.set()
            chaos_thread.join(timeout=30)
        soak_s = time.monotonic() - started

        assert len(outcomes) == REQUESTS
        problems = [outcome for outcome in outcomes if outcome[2]]
        assert not problems, problems[:10]
        statuses = {(kind, status) for kind, status, _ in outcomes}
        allowed = {200, 429, 500, 503}
        assert all(status == 400 for kind, status in statuses if kind == "bad")
        assert all(status in allowed for kind, status in statuses if kind != "bad"), statuses
        served = sum(status == 200 for kind, status, _ in outcomes if kind != "bad")
        assert served >= 0.6 * sum(kind != "bad" for kind, _, _ in outcomes), statuses
        assert len(kills) >= REQUESTS // KILL_EVERY // 2, f"only {len(kills)} kills"

        health = daemon.wait_ready()  # every worker back
        assert sum(w["restarts"] for w in health["workers"].values()) == 1 + len(kills)
        for index in range(10):  # and serving
            assert one_request(daemon.socket, index)[1] in (200, 400)
        time.sleep(0.5)  # closed connections and stopped workers released
        rss_after, fds_after = footprint(pid)
        assert fds_after <= fds_before + FD_TOLERANCE, (fds_before, fds_after)
        assert rss_after <= rss_before + RSS_TOLERANCE_KB, (rss_before, rss_after)
        counts = Counter(f"{kind} {status}" for kind, status, _ in outcomes)
        print(
            f"soak: {REQUESTS} requests in {soak_s:.1f} s ({dict(counts)}), {len(kills)} kills, "
            f"rss {rss_before} -> {rss_after} kB, fds {fds_before} -> {fds_after}"
        )
    finally:
        assert daemon.stop() == 0
