"""Real worker processes driven by the daemon's WorkerClient over ZeroMQ and shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_models import TINY_VOCAB

from hetspec.daemon.supervision.worker_client import (
    WorkerClient,
    WorkerDied,
    WorkerError,
    WorkerSpec,
    WorkerStartError,
)
from hetspec.protocol import ArrayRef, frame_array
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import Arena
from hetspec.speculative.verify.distributions import distribution
from hetspec.speculative.verify.samplers import KeyedSampler
from hetspec.speculative.verify.verdicts import verify_sampled

pytestmark = pytest.mark.process

LOAD_TIMEOUT = 120
VOCAB = TINY_VOCAB


def spec(gguf, runtime: str, **overrides) -> WorkerSpec:
    if runtime == "torch":
        settings = m.TorchSettings(max_context=128, threads=1)
        model = str(gguf.parent)
    else:
        settings = m.LlamaCppSettings(n_ctx=128, threads=1, n_seq_max=4)
        model = str(gguf)
    options = {
        "name": "gpu" if runtime == "torch" else "cpu",
        "runtime": runtime,
        "model": model,
        "settings": settings,
        "cores": (0,),
        "log_format": "console",
    }
    return WorkerSpec(**{**options, **overrides})


async def started(spec: WorkerSpec, tmp_path, arena) -> WorkerClient:
    client = WorkerClient(spec, tmp_path, generation=1, arena=arena.layout)
    await client.start(LOAD_TIMEOUT)
    return client


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().split(") ")[1][0] != "Z"


async def test_both_engines_hand_shake_draft_and_verify_through_the_arena(
    gguf, tmp_path, arena
) -> None:
    cpu = await started(spec(gguf, "llama.cpp"), tmp_path, arena)
    gpu = await started(spec(gguf, "torch"), tmp_path, arena)
    try:
        assert cpu.ready.vocab == gpu.ready.vocab
        assert cpu.ready.token_bytes == gpu.ready.token_bytes
        # both runtimes name the same control tokens, which the daemon never renders as text
        assert cpu.ready.special_tokens == gpu.ready.special_tokens
        assert cpu.ready.special_tokens, "the tiny vocabulary's specials were not found"
        assert (cpu.ready.device, gpu.ready.device, cpu.ready.context) == ("cpu", "cpu", 128)
        assert os.sched_getaffinity(cpu.pid) == {0}

        reply, _ = await cpu.call(m.Tokenize(request=cpu.next_request(), text="def load(path):"))
        prompt = reply.tokens
        for client in (cpu, gpu):
            reply, _ = await client.call(m.Prefill(request=client.next_request(), tokens=prompt))
            assert reply.committed == len(prompt)
        draft, _ = await cpu.call(
            m.Draft(
                request=cpu.next_request(), shape=m.Chains(4, 2), sampling=m.SamplingParams(), out=0
            )
        )
        probs = arena.view(draft.probs)
        assert probs.shape == (2, 4, VOCAB)
        np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
        chain = draft.tokens[0]
        assert draft.forwards == 3  # the first token drawn from the prefill's logits
        verified, _ = await gpu.call(
            m.VerifyTree(request=gpu.next_request(), tokens=chain, parents=[-1, 0, 1, 2], out=1)
        )
        logits = arena.view(verified.logits).copy()
        # the same model on both sides: the target agrees with every greedy draft token
        assert logits[:3].argmax(-1).tolist() == chain[1:]
        # greedy verification's call: each row's argmax, and nothing written to the arena
        arena.view(verified.logits)[:] = np.nan
        command = m.VerifyTree(
            request=gpu.next_request(), tokens=chain, parents=[-1, 0, 1, 2], out=1, argmax_only=True
        )
        argmax, _ = await gpu.call(command)
        assert argmax.logits is None
        assert argmax.argmax == logits.argmax(-1).tolist()
        assert np.isnan(arena.view(verified.logits)).all()
        committed, _ = await gpu.call(
            m.Commit(request=gpu.next_request(), nodes=[0, 1], tokens=[7])
        )
        assert committed.committed == len(prompt) + 3

        # a round's draft appends the accepted path (pending nodes: no forward) and the bonus;
        # llama.cpp drafts no chain in one call, so the bonus is evaluated with the append
        # (timed apart), and the draft's forwards are the steps after its first token
        bonus = 9 if chain[2] != 9 else 10
        again, _ = await cpu.call(
            m.Draft(
                request=cpu.next_request(),
                shape=m.Chains(3),
                out=0,
                sampling=m.SamplingParams(),
                append=[*chain[:2], bonus],
            )
        )
        assert again.forwards == 2
        assert 0 < again.append_ms <= again.elapsed_ms

        with pytest.raises(WorkerError, match="cannot roll back to 99") as failure:
            await gpu.call(m.Rollback(request=gpu.next_request(), length=99))
        assert failure.value.kind == "usage"
        with pytest.raises(WorkerError, match="does not fit"):
            await gpu.call(
                m.VerifyTree(
                    request=gpu.next_request(), tokens=[1] * 17, parents=list(range(-1, 16)), out=2
                )
            )
        # still serving after refusing bad commands
        reply, _ = await gpu.call(m.Rollback(request=gpu.next_request(), length=2))
        assert reply.committed == 2
    finally:
        await asyncio.gather(cpu.stop(), gpu.stop())
    assert not pid_alive(cpu.pid)
    assert not pid_alive(gpu.pid)
    assert not list(tmp_path.glob("*.sock"))


@pytest.mark.parametrize("runtime", ["torch", "llama.cpp"])
async def test_a_verifier_walks_a_sampled_verdict_as_the_daemon_would(
    gguf, tmp_path, arena, runtime
) -> None:
    """``VerifyTree.walk``: the verifier takes a seeded request's keyed verdict and an
    unseeded one's speculative sampling (the draft's rows read from the drafter's slot), the
    same path and bonus the daemon takes from the rows written to the arena; nothing goes to
    the arena; a walk it cannot take is refused, and the worker serves on."""
    worker = await started(spec(gguf, runtime), tmp_path, arena)
    try:
        prompt = [1, 5, 9, 13, 17, 21]
        await worker.call(m.Prefill(request=worker.next_request(), tokens=prompt, seed=5))
        params = m.SamplingParams(temperature=0.7, top_k=8)
        rng = np.random.default_rng(0)
        tree = [3, 7, 11, 7, 4]  # the bonus, a chain of two and a branch of two
        parents = [-1, 0, 1, 0, 3]
        drafted = arena.empty(0, (2, 2, VOCAB))
        drafted[:] = distribution(rng.normal(size=(2, 2, VOCAB)) * 4, params)
        draft = ArrayRef("<f4", (2, 2, VOCAB), slot=0)
        position = len(prompt) + 1
        walks = {
            "keyed": m.SampledWalk(params, position, keyed=True),
            "drawn": m.SampledWalk(params, position, seed=11, draft=draft, draft_rows=[0, 1, 2, 3]),
        }
        for kind, walk in walks.items():
            rows, _ = await worker.call(
                m.VerifyTree(request=worker.next_request(), tokens=tree, parents=parents, out=1)
            )
            logits = arena.view(rows.logits).copy()
            arena.view(rows.logits)[:] = np.nan
            options = (
                {"keyed": KeyedSampler(5)}
                if kind == "keyed"
                else {"rng": np.random.default_rng(11), "draft": drafted.reshape(4, VOCAB)}
            )
            expected = verify_sampled(
                tree[1:], [-1, 0, -1, 2], logits, params, position=position, **options
            )
            command = m.VerifyTree(
                request=worker.next_request(), tokens=tree, parents=parents, out=1, walk=walk
            )
            walked, _ = await worker.call(command)
            assert walked.logits is None
            assert walked.argmax == []
            assert (walked.path, walked.bonus) == (expected.path, expected.bonus), kind
            assert np.isnan(arena.view(rows.logits)).all()
        refused = [
            (
                m.VerifyTree(
                    request=worker.next_request(),
                    tokens=tree,
                    parents=parents,
                    out=1,
                    argmax_only=True,
                    walk=walks["keyed"],
                ),
                "neither argmax_only",
            ),
            (
                m.VerifyTree(
                    request=worker.next_request(),
                    tokens=tree,
                    parents=parents,
                    out=1,
                    walk=m.SampledWalk(params, position, draft=draft, draft_rows=[0]),
                ),
                "needs as many draft rows",
            ),
            (
                m.VerifyTree(
                    request=worker.next_request(),
                    tokens=tree[1:],
                    parents=[-1, 0, -1, 2],
                    out=1,
                    walk=walks["keyed"],
                ),
                "one tree below its first node",
            ),
        ]
        for command, reason in refused:
            with pytest.raises(WorkerError, match=reason) as failure:
                await worker.call(command)
            assert failure.value.kind == "usage"
        again, _ = await worker.call(
            m.VerifyTree(
                request=worker.next_request(),
                tokens=tree,
                parents=parents,
                out=1,
                walk=walks["keyed"],
            )
        )
        assert again.bonus >= 0
    finally:
        await worker.stop()


async def test_a_native_drafter_evaluates_the_bonus_in_its_chain_call(tmp_path) -> None:
    """Where the drafter drafts a chain in one call (native), a round's draft appends the
    accepted path and the bonus and drafts in one kernel call: gamma tokens, gamma forwards
    timed apart from the catch-up."""
    draft = Path(__file__).parents[1] / "models" / "draft" / "draft-q8_0.gguf"
    native = spec(draft, "native", settings=m.NativeSettings(n_ctx=128, threads=1))
    name = f"/dev/shm/hetspec-test-{os.getpid()}-{tmp_path.name}"
    with Arena.create(name, 1, 8 * 4096 * 4) as arena:  # the bundled draft's 4096 tokens
        cpu = await started(native, tmp_path, arena)
        try:
            reply, _ = await cpu.call(
                m.Tokenize(request=cpu.next_request(), text="def load(path):")
            )
            await cpu.call(m.Prefill(request=cpu.next_request(), tokens=reply.tokens))
            first, _ = await cpu.call(
                m.Draft(
                    request=cpu.next_request(),
                    shape=m.Chains(4),
                    out=0,
                    sampling=m.SamplingParams(),
                )
            )
            assert first.forwards == 3  # its first token drawn from the prefill's logits
            chain = first.tokens[0]
            bonus = 9 if chain[2] != 9 else 10
            again, _ = await cpu.call(
                m.Draft(
                    request=cpu.next_request(),
                    shape=m.Chains(5),
                    out=0,
                    sampling=m.SamplingParams(),
                    append=[*chain[:2], bonus],
                )
            )
            assert again.forwards == 5
            assert 0 <= again.append_ms <= again.elapsed_ms
            assert len(again.tokens[0]) == 5
        finally:
            await cpu.stop()


async def test_arrays_travel_in_frames_and_in_slots(gguf, tmp_path, arena) -> None:
    cpu = await started(spec(gguf, "llama.cpp"), tmp_path, arena)
    try:
        row = np.random.default_rng(0).random(1000, dtype=np.float32)
        echoed, frames = await cpu.call(
            m.Echo(request=cpu.next_request(), data=m.ArrayRef("<f4", (1000,), frame=1)), (row,)
        )
        np.testing.assert_array_equal(frame_array(echoed.data, frames), row)
        arena.empty(2, (1000,))[:] = row
        echoed, _ = await cpu.call(
            m.Echo(request=cpu.next_request(), data=ArrayRef("<f4", (1000,), slot=2), out=3)
        )
        np.testing.assert_array_equal(arena.view(echoed.data), row)
    finally:
        await cpu.stop()


async def test_a_daemon_polling_for_replies_reads_them_and_then_lets_its_loop_sleep(
    gguf, tmp_path, arena
) -> None:
    """With ``reply_spin_us`` the client reads the replies mailbox on every pass of the event
    loop while a call is pending (an answer held 20 ms comes without the bell's callback),
    and stops polling once none is, or once the poll's time is up."""
    cpu = await started(spec(gguf, "llama.cpp", reply_spin_us=50_000.0), tmp_path, arena)
    try:
        arena.empty(2, (8,))[:] = np.arange(8, dtype=np.float32)
        data = ArrayRef("<f4", (8,), slot=2)
        bells = []
        link = cpu._link
        on_bell = link.on_bell
        link.on_bell = lambda: bells.append(len(cpu._pending.calls)) or on_bell()
        loop = asyncio.get_running_loop()
        loop.remove_reader(link.inbox.bell_fd)
        loop.add_reader(link.inbox.bell_fd, link.on_bell)
        echoed, _ = await cpu.call(
            m.Echo(request=cpu.next_request(), data=data, out=3, hold_us=20_000.0)
        )
        np.testing.assert_array_equal(arena.view(echoed.data), np.arange(8))
        assert all(pending == 0 for pending in bells)  # the poll read it before any bell
        await asyncio.sleep(0.01)
        assert link.polling_until is None  # no call pending: the loop may sleep again
        held = m.Echo(request=cpu.next_request(), data=data, out=3, hold_us=80_000.0)
        call = asyncio.ensure_future(cpu.call(held))
        await asyncio.sleep(0.065)
        assert link.polling_until is None  # 50 ms are up: the bell reads this one
        await call
        assert bells[-1] == 1  # the bell's callback found the call pending and answered it
    finally:
        await cpu.stop()


def threads_on(pid: int, cores: set[int]) -> dict[int, int]:
    """{thread id: nanoseconds it has run} for the process's threads that may run on
    ``cores`` only."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            if os.sched_getaffinity(int(tid)) <= cores:
                schedstat = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text()
                found[int(tid)] = int(schedstat.split()[0])
    return found


def ran_ns(before: dict[int, int], after: dict[int, int]) -> int:
    return sum(after[tid] - before.get(tid, 0) for tid in after)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("runtime", ["llama.cpp", "torch"])
async def test_a_worker_computes_on_the_spare_cores_only_when_a_command_says_so(
    gguf, tmp_path, arena, runtime
) -> None:
    """A command marked spare_cores computes on the own and the spare cores (the runtime's
    extra OpenMP thread sits on the spare core), the others on the own cores only (that
    thread idles); the logits do not depend on it (greedy output must not change with the
    cores)."""
    own, spare = sorted(os.sched_getaffinity(0))[:2]
    client = await started(spec(gguf, runtime, cores=(own,), spare_cores=(spare,)), tmp_path, arena)
    try:
        assert client.ready.threads == 1
        assert os.sched_getaffinity(client.pid) == {own}  # the main thread: OpenMP's master

        async def work(wide: bool) -> None:
            for _ in range(5):
                await client.call(
                    m.Prefill(
                        request=client.next_request(), tokens=list(range(100)), spare_cores=wide
                    )
                )

        async def verify(wide: bool) -> np.ndarray:
            await client.call(m.Rollback(request=client.next_request(), length=0))  # afresh
            await client.call(
                m.Prefill(request=client.next_request(), tokens=list(range(40)), spare_cores=wide)
            )
            verified, _ = await client.call(
                m.VerifyTree(
                    request=client.next_request(),
                    tokens=[5, 6, 7, 8],
                    parents=[-1, 0, 1, 0],
                    out=0,
                    spare_cores=wide,
                )
            )
            return arena.view(verified.logits).copy()

        await work(True)
        on_spare = threads_on(client.pid, {spare})
        assert on_spare, "no thread was placed on the spare core"
        await work(False)  # its thread on the spare core spins briefly, then sleeps
        main_before, spare_before = threads_on(client.pid, {own}), threads_on(client.pid, {spare})
        # schedstat advances at a context switch or a scheduler tick; a worker spinning on its
        # mailbox between commands may not switch at all, so work until a few ticks have passed
        main_ns, deadline = 0, time.monotonic() + 30
        while main_ns < 50_000_000 and time.monotonic() < deadline:
            await work(False)
            main_ns = ran_ns(main_before, threads_on(client.pid, {own}))
        spare_ns = ran_ns(spare_before, threads_on(client.pid, {spare}))
        assert main_ns > 0, "the worker's main thread never ran on its own core"
        assert spare_ns < 0.05 * main_ns, (spare_ns, main_ns)
        wide, narrow = await verify(True), await verify(False)
        np.testing.assert_array_equal(wide, narrow)
    finally:
        await client.stop()


@pytest.mark.parametrize("runtime", ["llama.cpp", "torch"])
async def test_a_model_that_cannot_load_is_a_clear_start_error(
    gguf, tmp_path, arena, runtime
) -> None:
    missing = tmp_path / "missing-model"
    started_at = time.monotonic()
    with pytest.raises(WorkerStartError, match=f"worker: .*{missing.name}"):
        await started(spec(gguf, runtime, model=str(missing)), tmp_path, arena)
    assert time.monotonic() - started_at < 30


async def test_a_killed_worker_fails_the_call_in_flight_at_once(gguf, tmp_path, arena) -> None:
    cpu = await started(spec(gguf, "llama.cpp"), tmp_path, arena)
    try:
        await cpu.call(m.Prefill(request=cpu.next_request(), tokens=[0, 5, 6]))
        calls = [
            asyncio.ensure_future(
                cpu.call(
                    m.Draft(
                        request=cpu.next_request(),
                        shape=m.Chains(16),
                        sampling=m.SamplingParams(),
                        out=i % 2,
                    )
                )
            )
            for i in range(500)
        ]
        await calls[0]  # the worker is busy with the queue now
        os.kill(cpu.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - killed_at < 2
        failures = [r for r in results if isinstance(r, WorkerDied)]
        assert failures, results[:3]
        assert "was killed by SIGKILL" in str(failures[0])
        with pytest.raises(WorkerDied):
            await cpu.call(m.Rollback(request=cpu.next_request(), length=0))
    finally:
        await cpu.stop()


async def test_a_hung_worker_is_killed_when_its_heartbeats_stop(gguf, tmp_path, arena) -> None:
    cpu = await started(
        spec(gguf, "llama.cpp", heartbeat_s=0.1, heartbeat_timeout_s=1.0), tmp_path, arena
    )
    try:
        os.kill(cpu.pid, signal.SIGSTOP)
        reason = await asyncio.wait_for(cpu.died, 10)
        assert reason == "was killed by SIGKILL"
    finally:
        await cpu.stop()


def test_a_worker_exits_when_the_daemon_dies(gguf, tmp_path) -> None:
    """The daemon is SIGKILLed with its worker loaded: the death pipe takes the worker down."""
    script = f"""
import asyncio, os, sys
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec
from hetspec.protocol import worker_messages as m
async def main():
    spec = WorkerSpec("cpu", "llama.cpp", {str(gguf)!r}, m.LlamaCppSettings(n_ctx=64, threads=1))
    client = WorkerClient(spec, __import__("pathlib").Path({str(tmp_path)!r}), 1)
    await client.start(120)
    print("worker pid", client.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    daemon = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = ""
    while not line.startswith("worker pid"):  # structlog's default output shares stdout
        line = daemon.stdout.readline()
        assert line, "the daemon stand-in exited early"
    worker_pid = int(line.split()[-1])
    assert pid_alive(worker_pid)
    daemon.kill()
    daemon.wait()
    deadline = time.monotonic() + 5
    while pid_alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(worker_pid)


async def test_a_call_that_takes_too_long_kills_the_wedged_worker(gguf, tmp_path, arena) -> None:
    cpu = await started(spec(gguf, "llama.cpp", call_timeout_s=0.5), tmp_path, arena)
    try:
        os.kill(cpu.pid, signal.SIGSTOP)  # wedged: it will not answer
        with pytest.raises(WorkerError, match=r"no answer to Rollback within 0\.5 s") as failure:
            await cpu.call(m.Rollback(request=cpu.next_request(), length=0))
        assert failure.value.kind == "timeout"
        assert await asyncio.wait_for(cpu.died, 5) == "was killed by SIGKILL"
    finally:
        await cpu.stop()


async def test_a_command_too_big_for_the_mailbox_keeps_its_place_in_line(
    gguf, tmp_path, arena
) -> None:
    """A command bigger than the mailbox's ring goes by the socket with a marker in the ring:
    the worker reads it where it was sent, between the small ones, and answers each."""
    cpu = await started(spec(gguf, "llama.cpp"), tmp_path, arena)
    try:
        big = np.random.default_rng(1).random(300_000, dtype=np.float32)  # 1.2 MB: the socket
        small = np.arange(4, dtype=np.float32)
        rows = (small, big, small)
        echoes = [
            m.Echo(request=cpu.next_request(), data=m.ArrayRef("<f4", row.shape, frame=1))
            for row in rows
        ]
        calls = [cpu.call(echo, (row,)) for echo, row in zip(echoes, rows, strict=True)]
        answers = await asyncio.gather(*calls)
        for (echoed, frames), row in zip(answers, rows, strict=True):
            np.testing.assert_array_equal(frame_array(echoed.data, frames), row)
    finally:
        await cpu.stop()


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_bench_verdict_times_both_walks_with_the_same_verdicts(tmp_path, runtime) -> None:
    """``bench_verdict`` (the GPU call's GEMMA step) on the bundled target: the target's own
    keyed tokens are accepted whole and a changed first token is rejected at once, by the
    daemon's walk and the verifier's alike (it checks every round's two verdicts agree)."""
    from hetspec.bench import verdict as bench_verdict  # noqa: PLC0415

    target = Path(__file__).parents[1] / "models" / "target"
    model = target / "target-q8_0.gguf" if runtime == "native" else target
    written = tmp_path / "verdict.json"
    cores = os.sched_getaffinity(0)
    arguments = [
        str(model),
        "--runtime",
        runtime,
        "--rounds",
        "5",
        "--nodes",
        "6",
        "--json",
        str(written),
    ]
    assert bench_verdict.main(arguments) == 0
    assert os.sched_getaffinity(0) == cores
    results = json.loads(written.read_text())["results"]
    accepted = {
        draft: {way: timed["accepted"] for way, timed in ways.items()}
        for draft, ways in results.items()
    }
    assert accepted == {
        "accepted whole (reads all)": {"daemon walks": 6, "verifier walks": 6},
        "rejected at once (reads one)": {"daemon walks": 0, "verifier walks": 0},
    }
    assert all(timed["round_ms"] > 0 for ways in results.values() for timed in ways.values())
