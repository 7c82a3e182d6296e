"""Issue 19: the daemon/worker plumbing under cancellation and restarts. A cancel on a full
command queue, a restarted worker with another vocabulary, late cancels in the worker, and
arena slots lent again while a cancelled call may still write them. Real workers, real
ZeroMQ, real daemons."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time

import numpy as np
import pytest
import zmq
from test_daemon import Daemon, native, request, stream, target_greedy
from test_hardening_supervision import events, ready_health, wait_until
from test_worker_process import LOAD_TIMEOUT, VOCAB, spec
from tiny_models import write_tiny_gguf_llama

from hetspec.daemon.supervision.slots import SlotPool
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerDied, WorkerError
from hetspec.protocol import ArrayRef, Codec
from hetspec.protocol import worker_messages as m
from hetspec.workers.process import CommandReader

pytestmark = pytest.mark.process  # worker processes, for all but one


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


async def test_a_call_to_a_worker_killed_a_moment_ago_fails_as_its_death(
    gguf, tmp_path, arena
) -> None:
    """ZeroMQ drops a dead worker's pipe before the exit watcher runs: a command sent then
    finds no reader, and must fail as the worker's death (which the service starts over
    from), not as a full command queue."""
    worker = spec(gguf, "llama.cpp", heartbeat_timeout_s=60)
    client = WorkerClient(worker, tmp_path, 1, arena.layout)
    await client.start(LOAD_TIMEOUT)
    try:
        os.kill(client.pid, signal.SIGKILL)
        time.sleep(0.5)  # blocking: the event loop, and so the exit watcher, does not run
        with pytest.raises(WorkerDied, match=r"the cpu worker (is gone|was killed by SIGKILL)"):
            await client.call(m.Tokenize(request=client.next_request(), text="x"))
        assert client.died.done()
    finally:
        await client.stop()


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
        wait_until(
            lambda: events(daemon, "worker restart failed"), 20, "the restarted worker refused"
        )
        failure = events(daemon, "worker restart failed")[0]
        assert failure["worker"] == "cpu"
        assert "token texts differ" in failure["error"], failure
        status, body = request(daemon.socket, "POST", "/api/generate", native("x", max_tokens=2))
        assert status == 503, body
        assert "the cpu worker is restarting" in body["error"]
        assert not events(daemon, "worker restarted")

        os.replace(original, draft)
        wait_until(lambda: ready_health(daemon), 30, "the worker back with the right model")
        assert ready_health(daemon)["workers"]["cpu"]["restarts"] == 1
        assert len(list(daemon.runtime_dir.glob("*.sock"))) == 4  # the refused ones stopped
        status, body = request(daemon.socket, "POST", "/api/generate", native("x", max_tokens=2))
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
        time.sleep(0.1)  # ipc delivers asynchronously: let all three arrive before the read
        assert reader.next()[0].request == 103
        assert [(a.request, a.kind) for a in answers] == [(102, "cancelled")]
        assert not reader.backlog
    finally:
        reader.socket.close(linger=0)
        daemon_side.close()


# ------------------------------------------------------------------ 4: slots and cancels


async def test_a_slot_whose_call_was_cancelled_is_not_lent_before_the_worker_is_done(
    gguf, tmp_path, arena
) -> None:
    """One slot, so no rotation hides it: a call writing the slot is cancelled while the
    worker cannot answer (stopped, as if computing), and the slot goes back. It is lent
    again only once the worker is done with that call; then nothing overwrites it."""
    client = WorkerClient(
        spec(gguf, "llama.cpp", heartbeat_timeout_s=60), tmp_path, 1, arena.layout
    )
    await client.start(LOAD_TIMEOUT)
    pool = SlotPool(1)
    rows = np.full((16, VOCAB), 1.0, np.float32)
    second: asyncio.Future | None = None
    try:
        async with pool.lease("run 1", client.settled) as slot:
            os.kill(client.pid, signal.SIGSTOP)
            echo = m.Echo(
                request=client.next_request(), data=ArrayRef("<f4", rows.shape, frame=1), out=slot
            )
            call = asyncio.ensure_future(client.call(echo, (rows,)))
            await asyncio.sleep(0)  # sent
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

        lent_again = asyncio.Event()

        async def run_two() -> int:
            async with pool.lease("run 2", client.settled) as slot:
                lent_again.set()
                arena.empty(slot, rows.shape)[:] = 2.0  # this run's rows
                # a round trip: whatever the worker had queued is done by its answer
                await client.call(m.Tokenize(request=client.next_request(), text="x"))
                return int(arena.view(ArrayRef("<f4", rows.shape, slot=slot)).min())

        second = asyncio.ensure_future(run_two())
        await asyncio.sleep(0.3)
        assert not lent_again.is_set(), "the slot was lent again while the cancelled call may write"
        assert pool.free == 0
        os.kill(client.pid, signal.SIGCONT)
        assert await asyncio.wait_for(second, 10) == 2  # not overwritten by the cancelled call
        assert pool.free == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(client.pid, signal.SIGCONT)
        await client.stop()
        if second is not None:
            await settle([second])


async def test_a_slot_comes_back_when_the_worker_dies_with_the_cancelled_call(
    gguf, tmp_path, arena
) -> None:
    """The worker never answers the cancelled call because it dies: the slot is free again
    at once, not held for ever."""
    client = WorkerClient(
        spec(gguf, "llama.cpp", heartbeat_timeout_s=60), tmp_path, 1, arena.layout
    )
    await client.start(LOAD_TIMEOUT)
    pool = SlotPool(1)
    try:
        async with pool.lease("run 1", client.settled) as slot:
            os.kill(client.pid, signal.SIGSTOP)
            command = m.Prefill(request=client.next_request(), tokens=[1, 2, 3], out=slot)
            call = asyncio.ensure_future(client.call(command))
            await asyncio.sleep(0)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        assert pool.free == 0
        client.kill()
        assert await asyncio.wait_for(client.died, 5) == "was killed by SIGKILL"
        started = time.monotonic()
        async with pool.lease("run 2", client.settled) as slot:
            assert slot == 0
        assert time.monotonic() - started < 1
        with pytest.raises(WorkerDied):
            await client.call(m.Tokenize(request=client.next_request(), text="x"))
    finally:
        await client.stop()


def test_with_two_slots_requests_after_clients_left_mid_stream_are_exact(tmp_path, models) -> None:
    """The daemon's own path with only the two slots one request holds, so each request gets
    the slots the one before left: clients leave streams in every speculative mode (their
    calls are cancelled mid-round), and the next request still gets the target's own greedy
    tokens, without waiting long for its slots."""
    daemon = Daemon(tmp_path, models["target"], models["draft"], "--set", "arena_slots=2")
    prompt = "def load(path):\n"
    try:
        daemon.wait_ready()
        for mode in ("sequential", "parallel", "adaptive"):
            endless = native("class A:\n", mode=mode, max_tokens=4000, ignore_eos=True)
            connection, response = stream(daemon.socket, endless)
            for _ in range(3):
                assert json.loads(response.readline())["done"] is False
            connection.close()
            response.close()
            started = time.monotonic()
            status, body = request(
                daemon.socket,
                "POST",
                "/api/generate",
                native(prompt, max_tokens=24, ignore_eos=True, mode=mode),
            )
            assert status == 200, body
            assert body["tokens"] == target_greedy(models["target"], prompt, 24).tolist(), mode
            assert time.monotonic() - started < 10
        assert "no free arena slot" not in daemon.log.read_text()
    finally:
        assert daemon.stop() == 0


# ------------------------------------------------------------------ 5: a long prefill cancelled


async def test_a_prefill_cancelled_while_it_runs_stops_between_its_chunks(tmp_path, arena) -> None:
    """A client that leaves during a long prompt's prefill once kept the worker evaluating
    the whole prompt (~60 s for 7,200 tokens of SmolLM2 on 2 cores), and every request behind
    it waited. The Cancel is read between chunks: the prefill stops there, keeps what it
    evaluated (the same prompt again reuses it), and the worker is free at once."""
    gguf = write_tiny_gguf_llama(tmp_path / "model", context=4096)
    settings = m.LlamaCppSettings(n_ctx=4096, n_batch=8, threads=1, n_seq_max=4)
    client = WorkerClient(spec(gguf, "llama.cpp", settings=settings), tmp_path, 1, arena.layout)
    await client.start(LOAD_TIMEOUT)
    prompt = [(index * 7) % (VOCAB - 4) + 3 for index in range(4000)]  # 500 chunks of 8
    try:
        started = time.monotonic()
        whole = await client.call(m.Prefill(request=client.next_request(), tokens=prompt))
        whole_s = time.monotonic() - started
        await client.call(m.Rollback(request=client.next_request(), length=1))

        call = asyncio.ensure_future(
            client.call(m.Prefill(request=client.next_request(), tokens=prompt))
        )
        await asyncio.sleep(whole_s / 4)  # well into the prefill, far from its end
        call.cancel()
        cancelled_at = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(client.settled(), 10)
        settled_s = time.monotonic() - cancelled_at
        again, _ = await client.call(m.Prefill(request=client.next_request(), tokens=prompt))
    finally:
        await client.stop()
    assert whole[0].reused == 0
    # it had begun, and it stopped well before the end (cancelled at a quarter of the whole
    # prefill's time; a busy 2-core box reads the Cancel a few chunks late)
    assert 1 < again.reused < len(prompt) * 3 // 4, again
    assert settled_s < whole_s / 2, (settled_s, whole_s)
