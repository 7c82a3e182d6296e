"""Issue 19: the daemon/worker plumbing under cancellation and restarts. A cancel on a full
command queue, a restarted worker with another vocabulary, late cancels in the worker, and
arena slots lent again while a cancelled call may still write them. Real workers, real
ZeroMQ, real daemons."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest
import zmq
from test_daemon import CONTEXT, Daemon, request
from test_hardening_supervision import events, ready_health, wait_until
from test_worker_process import LOAD_TIMEOUT, spec
from tiny_models import write_tiny_gguf_llama, write_tiny_pair

from hetspec.daemon.worker_client import WorkerClient, WorkerError
from hetspec.protocol import Arena, Codec
from hetspec.protocol import worker_messages as m
from hetspec.workers.process import CommandReader

VOCAB = 320


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def arena(tmp_path):
    with Arena.create(
        f"/dev/shm/hetspec-test-{os.getpid()}-{tmp_path.name}", 4, 16 * VOCAB * 4
    ) as arena:
        yield arena


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return write_tiny_pair(root, CONTEXT) | {
        "other": write_tiny_gguf_llama(
            root / "other", seed=1, layers=1, vocab_size=300, context=CONTEXT
        ),
    }


async def settle(calls: list[asyncio.Future]) -> None:
    """Retrieve the outcome of calls a test abandoned (their worker is gone)."""
    await asyncio.gather(*calls, return_exceptions=True)


# ------------------------------------------------------------------ 1: cancel on a full queue


async def test_a_call_cancelled_while_the_command_queue_is_full_stays_cancelled(
    gguf, tmp_path, arena
) -> None:
    """The worker stops reading until its command queue is full; cancelling a call then
    cannot send Cancel, and the call must still end cancelled, not as ``WorkerError``."""
    worker = spec(gguf, "llama.cpp", heartbeat_timeout_s=60)
    client = WorkerClient(worker, tmp_path, 1, arena.layout)
    await client.start(LOAD_TIMEOUT)
    calls: list[asyncio.Future] = []
    try:
        os.kill(client.pid, signal.SIGSTOP)  # it reads nothing more: the queue fills
        text = "x" * 4096
        while True:
            command = m.Tokenize(request=client.next_request(), text=text)
            call = asyncio.ensure_future(client.call(command))
            await asyncio.sleep(0)  # sent, or refused
            if call.done():
                with pytest.raises(WorkerError, match="command queue is full"):
                    call.result()
                break
            calls.append(call)
            assert len(calls) < 50_000, "the command queue never filled"
        calls[-1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await calls[-1]
    finally:
        client.kill()
        await client.stop()
        await settle(calls)


# ------------------------------------------------------------------ 2: vocabulary on restart


def test_a_worker_restarted_with_another_vocabulary_is_not_used(tmp_path, models) -> None:
    """The draft model is replaced on disk by one with another tokenizer, then the CPU
    worker (the drafter) dies: the restarted worker is refused like a failed restart, with
    the differences logged, requests meanwhile get a clear 503, and once the right model is
    back so is the worker."""
    draft_folder = tmp_path / "draft"
    shutil.copytree(models["draft"].parent, draft_folder)
    draft = draft_folder / models["draft"].name
    original = tmp_path / "original.gguf"
    shutil.copy(draft, original)
    daemon = Daemon(tmp_path / "daemon", models["target"], draft, "--set", "restart_wait_s=1")
    try:
        health = daemon.wait_ready()
        swapped = tmp_path / "swapped.gguf"
        shutil.copy(models["other"], swapped)
        os.replace(swapped, draft)
        os.kill(health["workers"]["cpu"]["pid"], signal.SIGKILL)
        wait_until(lambda: events(daemon, "worker restart failed"), 20,
                   "the restarted worker refused")  # fmt: skip
        failure = events(daemon, "worker restart failed")[0]
        assert failure["worker"] == "cpu"
        assert "token texts differ" in failure["error"], failure
        status, body = request(daemon.socket, "POST", "/api/generate",
                               {"prompt": "x", "max_tokens": 2, "stream": False})  # fmt: skip
        assert status == 503, body
        assert "the cpu worker is restarting" in body["error"]["message"]
        assert not events(daemon, "worker restarted")

        os.replace(original, draft)
        wait_until(lambda: ready_health(daemon), 30, "the worker back with the right model")
        assert ready_health(daemon)["workers"]["cpu"]["restarts"] == 1
        assert len(list(daemon.runtime_dir.glob("*.sock"))) == 4  # the refused ones stopped
        status, body = request(daemon.socket, "POST", "/api/generate",
                               {"prompt": "x", "max_tokens": 2, "stream": False})  # fmt: skip
        assert status == 200, body
    finally:
        assert daemon.stop() == 0


# ------------------------------------------------------------------ 3: late cancels


def test_the_worker_keeps_nothing_of_a_cancel_that_came_after_its_answer(tmp_path) -> None:
    """A Cancel for a command the worker already answered has nothing left to stop and must
    leave nothing behind (a daemon cancelling late on every request would grow the worker
    without bound); one for a command still queued is answered at once as cancelled."""
    context = zmq.Context.instance()
    daemon_side = context.socket(zmq.PUSH)
    daemon_side.setsockopt(zmq.LINGER, 0)
    daemon_side.bind(f"ipc://{tmp_path}/commands.sock")
    answers: list[m.Failed] = []
    reader = CommandReader(context, f"ipc://{tmp_path}/commands.sock", 0.0, answers.append)
    codec = Codec(m.Command)

    def send(command) -> None:
        daemon_side.send_multipart(codec.encode(command))

    try:
        for request_id in range(1, 101):
            send(m.Tokenize(request=request_id, text="x"))
            command, _ = reader.next()
            assert command.request == request_id  # the worker runs it and answers, then:
            send(m.Cancel(request=request_id))
        send(m.Tokenize(request=101, text="x"))
        assert reader.next()[0].request == 101  # the late cancels are read by now
        assert not getattr(reader, "cancelled", ()), "late cancels are remembered for ever"
        assert not answers  # nothing to answer: their commands were answered

        send(m.Tokenize(request=102, text="x"))
        send(m.Cancel(request=102))  # still queued: it never runs
        send(m.Tokenize(request=103, text="x"))
        assert reader.next()[0].request == 103
        assert [(a.request, a.kind) for a in answers] == [(102, "cancelled")]
        assert not reader.backlog
    finally:
        reader.socket.close(linger=0)
        daemon_side.close()
