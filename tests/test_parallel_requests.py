"""Several requests at once, through the real daemon on the bundled models (issue #72).

Each request decodes on a seat of its own (a sequence in both workers), so its tokens must be
what it gives alone, whatever else decodes beside it: greedy and seeded, in every mode, at
every concurrency. Bursts beyond the queue are refused with 429, a client that leaves
mid-batch disturbs nobody, and nothing leaks: seats, arena slots, file descriptors.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_daemon import native, request, stream
from test_lossless import BundledDaemon, target_runtime

from hetspec.bench.compare import prompt_set
from hetspec.speculative.verify.distributions import SamplingParams
from hetspec.speculative.verify.samplers import DrawnSampler

pytestmark = pytest.mark.process

PARALLEL = 4
# verifiers that serve several sequences (the torch one on the CPU serves one)
RUNTIMES = ("native", "llama.cpp")
# mixed modes, temperatures and lengths: what a request asks changes nothing of another's
REQUESTS = [
    {"mode": "adaptive", "max_tokens": 40},
    {"mode": "sequential", "max_tokens": 24, "temperature": 0.8, "seed": 11},
    {"mode": "autoregressive", "max_tokens": 32},
    {"mode": "parallel", "gamma": 3, "max_tokens": 48},
    {"mode": "adaptive", "max_tokens": 16, "temperature": 0.9, "seed": 5},
    {"mode": "sequential", "gamma": 2, "max_tokens": 36},
    {"mode": "autoregressive", "max_tokens": 20, "temperature": 0.7, "seed": 3},
    {"mode": "adaptive", "max_tokens": 44, "temperature": 0.6, "seed": 9},
]


@pytest.fixture(scope="module", params=RUNTIMES)
def daemon(request, tmp_path_factory):
    daemon = BundledDaemon(
        tmp_path_factory.mktemp(f"parallel-{request.param}"),
        "draft-cpu",
        "--set",
        f'gpu_runtime="{request.param}"',
        "--set",
        f"max_parallel={PARALLEL}",
        "--set",
        "max_queue=6",
    )
    yield daemon
    daemon.stop()


def props(daemon) -> dict:
    status, body = request(daemon.socket, "GET", "/props")
    assert status == 200
    return body


class RunningPeak:
    """The most requests /props said were decoding at once while the block ran."""

    def __init__(self, daemon) -> None:
        self.daemon, self.peak, self._stop = daemon, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, props(self.daemon)["queue"]["running"])
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def body_of(index: int) -> dict:
    options = REQUESTS[index % len(REQUESTS)]
    return native(prompt_set(16)[index], ignore_eos=True, **options)


def generate(daemon, body: dict) -> dict:
    status, reply = request(daemon.socket, "POST", "/api/generate", body)
    assert status == 200, reply
    return reply


def test_each_request_gives_its_tokens_alone_at_every_concurrency(daemon) -> None:
    assert props(daemon)["queue"]["parallel"] == PARALLEL
    bodies = [body_of(index) for index in range(len(REQUESTS))]
    alone = [generate(daemon, body)["tokens"] for body in bodies]
    for body, tokens in zip(bodies, alone, strict=True):
        assert len(tokens) == body["options"]["num_predict"]
    for clients in (2, 4, 8):
        with RunningPeak(daemon) as running, ThreadPoolExecutor(clients) as pool:
            replies = list(pool.map(lambda body: generate(daemon, body), bodies))
        for index, reply in enumerate(replies):
            assert reply["tokens"] == alone[index], (clients, index, REQUESTS[index])
        assert running.peak >= 2, f"{clients} clients never decoded together"
    assert props(daemon)["queue"]["running"] == 0


def test_a_burst_waits_or_gets_429_and_nothing_leaks(daemon) -> None:
    fds = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
    body = native("def f(x):\n", max_tokens=24, ignore_eos=True, temperature=0)
    reference = generate(daemon, body)["tokens"]
    with ThreadPoolExecutor(40) as pool:
        results = list(
            pool.map(lambda _: request(daemon.socket, "POST", "/api/generate", body), range(40))
        )
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) > 0, "the queue never filled"
    assert statuses.count(200) >= PARALLEL + 6
    for status, reply in results:
        if status == 200:
            assert reply["tokens"] == reference
    queue = props(daemon)["queue"]
    assert (queue["running"], queue["waiting"]) == (0, 0)
    # every seat and arena slot came back: as many at once as before, with the same tokens
    with ThreadPoolExecutor(PARALLEL) as pool:
        again = list(pool.map(lambda _: generate(daemon, body)["tokens"], range(PARALLEL)))
    assert again == [reference] * PARALLEL
    assert len(os.listdir(f"/proc/{daemon.process.pid}/fd")) <= fds + 2


def test_a_client_that_leaves_mid_batch_disturbs_nobody(daemon) -> None:
    bodies = [body_of(index) for index in (0, 3, 5)]
    alone = [generate(daemon, body)["tokens"] for body in bodies]
    leaving = native("class Tree:\n", max_tokens=400, ignore_eos=True, temperature=0)
    connection, response = stream(daemon.socket, leaving)
    response.readline()  # decoding: it holds a seat
    with ThreadPoolExecutor(3) as pool:
        replies = pool.map(lambda body: generate(daemon, body), bodies)
        time.sleep(0.2)
        connection.close()  # gone while the others decode beside it
        replies = list(replies)
    for reply, tokens in zip(replies, alone, strict=True):
        assert reply["tokens"] == tokens
    deadline = time.monotonic() + 10
    while props(daemon)["queue"]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert props(daemon)["queue"]["running"] == 0


def test_a_long_prompt_prefilled_in_chunks_beside_others_is_the_targets_own(daemon, request):
    """A prompt longer than ``prefill_chunk`` is prefilled a chunk a call (others' rounds run
    between them): its greedy tokens are still the target's own, as this process runs it."""
    runtime = target_runtime(f"draft-cpu-{'native' if 'native' in request.node.name else 'llama'}")
    text = "".join(prompt_set(16))
    text = text[: len(text) * 600 // len(runtime.tokenize(text))]  # ~600 tokens
    tokens = runtime.tokenize(text)
    assert 512 < len(tokens) < 900  # three or four calls at the default 256 tokens a call
    runtime.prefill(tokens)
    expected = runtime.draft(17, SamplingParams(), DrawnSampler(0)).tokens[0, :16].tolist()
    beside = native("class Tree:\n", max_tokens=300, ignore_eos=True, temperature=0)
    connection, response = stream(daemon.socket, beside)
    try:
        response.readline()  # decoding beside the long prompt
        for mode in ("autoregressive", "adaptive"):
            body = native(text, max_tokens=16, ignore_eos=True, temperature=0, mode=mode)
            assert generate(daemon, body)["tokens"] == expected, mode
    finally:
        connection.close()
