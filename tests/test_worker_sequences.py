"""Several sequences in one worker (#72, protocol 23), with the real worker loop, command reader
and runtimes on the bundled target, in this process (and, marked ``process``, through the
daemon's client to a worker process and its bench): each sequence's commands give exactly
what they give on a worker serving that sequence alone, whatever the other sequences do
between them; verifications (and decodings alone) of several sequences queued together run in
one forward and answer bit for bit what they answer one by one; a queued command never passes
an earlier one of its own sequence."""

from __future__ import annotations

import asyncio
import os
import time
import types
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from hetspec.daemon.config import BUNDLED_MODELS
from hetspec.protocol import Arena, ArrayRef, Codec
from hetspec.protocol import worker_messages as m
from hetspec.workers.batched_handlers import PREFILL_BESIDE, PREFILL_JOINS_UP_TO
from hetspec.workers.command_reader import CommandReader
from hetspec.workers.runtimes.spare_cores import SpareCores
from hetspec.workers.worker import Worker

TARGET = BUNDLED_MODELS / "target"
GGUF = TARGET / "target-q8_0.gguf"
VOCAB = 4096
CONTEXT = 256
SLOTS = 8
GREEDY = m.SamplingParams()
SAMPLED = m.SamplingParams(temperature=0.9, top_k=40)


def settings(kind: str):
    if kind == "native":
        return str(GGUF), m.NativeSettings(n_ctx=CONTEXT, threads=1)
    if kind == "llama.cpp":
        return str(GGUF), m.LlamaCppSettings(n_ctx=CONTEXT, threads=1, n_seq_max=8)
    return str(TARGET), m.TorchSettings(max_context=CONTEXT, threads=1)


class InProcessWorker:
    """A ``Worker`` and its ``CommandReader`` in this process, over ipc sockets: ``run``
    queues commands (all read before the worker takes the first, as a burst the daemon sent
    while the worker computed) and serves them, returning the replies by request."""

    def __init__(self, tmp_path: Path, kind: str, arena: Arena, name: str) -> None:
        self.context = zmq.Context.instance()
        self.daemon_commands = self.context.socket(zmq.PUSH)
        self.daemon_commands.setsockopt(zmq.LINGER, 0)
        self.daemon_commands.bind(f"ipc://{tmp_path}/{name}-commands.sock")
        self.daemon_replies = self.context.socket(zmq.PULL)
        self.daemon_replies.setsockopt(zmq.LINGER, 0)
        self.daemon_replies.bind(f"ipc://{tmp_path}/{name}-replies.sock")
        self.replies = self.context.socket(zmq.PUSH)
        self.replies.setsockopt(zmq.LINGER, 0)
        self.replies.connect(f"ipc://{tmp_path}/{name}-replies.sock")
        self.worker = Worker(
            kind, self.replies, types.SimpleNamespace(busy=None), SpareCores((), ())
        )
        self.reader = CommandReader(
            self.context, f"ipc://{tmp_path}/{name}-commands.sock", 0.0, self.worker.send
        )
        self.arena = arena
        self.codec = Codec(m.Command)
        self.replies_codec = Codec(m.Reply)
        self._request = 0

    def request(self) -> int:
        self._request += 1
        return self._request

    def run(self, *commands: msgspec.Struct, expect: int | None = None) -> dict[int, object]:
        """Serve ``commands`` queued together; their replies by request (Failed included), in
        the order sent (``expect``: how many replies, where a Cancel answers for another)."""
        for command in (*commands, m.Shutdown()):
            self.daemon_commands.send_multipart(self.codec.encode(command))
        deadline = time.monotonic() + 10
        while len(self.reader.backlog) < len(commands) + 1 - sum(
            isinstance(c, m.Cancel) for c in commands
        ):
            assert time.monotonic() < deadline, "the commands did not arrive"
            self.reader._drain()
        self.worker.serve(self.reader)
        replies = {}
        for _ in range(len(commands) if expect is None else expect):
            assert self.daemon_replies.poll(10_000), "a reply is missing"
            reply = self.replies_codec.decode(self.daemon_replies.recv_multipart())
            replies[reply.request] = reply
        assert not self.daemon_replies.poll(0), "more replies than commands"
        return replies

    def call(self, command: msgspec.Struct):
        return self.run(command)[command.request]

    def load(self, kind: str, sequences: int) -> m.Ready:
        model, runtime_settings = settings(kind)
        command = m.Load(
            model=model, settings=runtime_settings, arena=self.arena.layout, sequences=sequences
        )
        for message in (command, m.Shutdown()):
            self.daemon_commands.send_multipart(self.codec.encode(message))
        self.worker.serve(self.reader)
        assert self.daemon_replies.poll(60_000)
        ready = self.replies_codec.decode(self.daemon_replies.recv_multipart())
        assert isinstance(ready, m.Ready), ready
        return ready

    def close(self) -> None:
        if self.worker.runtime is not None:
            getattr(self.worker.runtime, "close", lambda: None)()
        self.worker.runtime = None
        if self.worker.arena is not None:
            self.worker.arena.close()
        for socket in (self.reader.socket, self.replies, self.daemon_commands, self.daemon_replies):
            socket.close(linger=0)


@pytest.fixture
def arena(tmp_path):
    name = f"/dev/shm/hetspec-test-{os.getpid()}-{tmp_path.name}"
    with Arena.create(name, SLOTS, 16 * VOCAB * 4) as arena:
        yield arena


@pytest.fixture
def workers(tmp_path, arena):
    """``start(kind, sequences)``: a loaded in-process worker, closed after the test."""
    started: list[InProcessWorker] = []

    def start(kind: str, sequences: int) -> InProcessWorker:
        worker = InProcessWorker(tmp_path, kind, arena, f"w{len(started)}")
        started.append(worker)
        worker.ready = worker.load(kind, sequences)
        return worker

    yield start
    for worker in started:
        worker.close()


# ---------------------------------------------------------------- what a sequence does


PROMPTS = ["def load(path):\n", "class Stack:\n    def", "for line in lines:\n"]


def script(worker: InProcessWorker, sequence: int, prompt: list[int], seed: int | None):
    """One request's commands on ``sequence``, as a generator: each yields a command and is
    sent what it answered (the next commands depend on it), collecting what to compare."""
    seen = []
    sampled = seed is not None
    reply = yield m.Prefill(worker.request(), prompt, seed=seed, sequence=sequence, out=sequence)
    seen.append(("prefill", reply.committed, worker.arena.view(reply.logits).copy()))
    first = int(np.argmax(worker.arena.view(reply.logits)[0]))
    tree = ([first, 7, 8, 9], [-1, 0, 1, 0])
    reply = yield m.VerifyTree(worker.request(), *tree, out=sequence, sequence=sequence)
    logits = worker.arena.view(reply.logits).copy()
    seen.append(("tree", logits))
    reply = yield m.Commit(worker.request(), nodes=[0, 1], sequence=sequence)
    seen.append(("commit", reply.committed))
    params = SAMPLED if sampled else GREEDY
    reply = yield m.Decode(
        worker.request(), 5, params, append=[int(logits[1].argmax())], sequence=sequence, logprobs=2
    )
    seen.append(("decode", reply.tokens, [(lp.token, lp.logprob) for lp in reply.logprobs]))
    chain = reply.tokens
    parents = list(range(-1, len(chain) - 1))
    if sampled:
        walk = m.SampledWalk(params, position=0, keyed=True)
        reply = yield m.VerifyTree(
            worker.request(), chain, parents, out=-1, walk=walk, sequence=sequence
        )
        seen.append(("walk", reply.path, reply.bonus))
    else:
        reply = yield m.VerifyTree(
            worker.request(),
            chain,
            parents,
            out=-1,
            argmax_only=True,
            root_row=True,
            sequence=sequence,
        )
        seen.append(("argmax", reply.argmax))
    reply = yield m.Rollback(worker.request(), len(prompt) + 1, sequence=sequence)
    seen.append(("rollback", reply.committed))
    return seen


def play(worker: InProcessWorker, scripts: dict[int, object], *, together: bool) -> dict:
    """Drive the scripts: one command of each in turn, sent one by one, or (``together``)
    each turn's commands queued at once, so that the worker may run them together."""
    results, answers = {}, dict.fromkeys(scripts)
    while scripts:
        turn = {}
        for sequence, running in list(scripts.items()):
            try:
                turn[sequence] = running.send(answers[sequence])
            except StopIteration as done:
                results[sequence] = done.value
                del scripts[sequence]
        if together and turn:
            replies = worker.run(*turn.values())
        else:
            replies = {c.request: worker.call(c) for c in turn.values()}
        for sequence, command in turn.items():
            answers[sequence] = replies[command.request]
            assert not isinstance(answers[sequence], m.Failed), answers[sequence]
    return results


def same(a, b) -> bool:
    """Equal, numpy arrays bit for bit."""
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


SEEDS = [None, 11, None]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", ["native", "llama.cpp"])
def test_a_worker_serves_the_sequences_load_asks_for(workers, kind) -> None:
    worker = workers(kind, 3)
    assert worker.ready.sequences == 3
    assert worker.ready.context == CONTEXT  # each sequence's own
    assert len(worker.worker.sequences) == 3
    engines = [state.engine for state in worker.worker.sequences]
    assert len({id(engine) for engine in engines}) == 3


@pytest.mark.slow
def test_torch_serves_one_sequence(workers) -> None:
    worker = workers("torch", 3)
    assert worker.ready.sequences == 1
    reply = worker.call(m.Prefill(worker.request(), [1, 2, 3], sequence=1))
    assert isinstance(reply, m.Failed)
    assert reply.kind == "usage"


@pytest.mark.parametrize("kind", ["native", "llama.cpp"])
def test_a_sequence_outside_the_served_ones_is_a_usage_failure(workers, kind) -> None:
    worker = workers(kind, 3)
    for command in (
        m.Prefill(worker.request(), [1, 2, 3], sequence=3),
        m.Rollback(worker.request(), 0, sequence=-1),
        m.VerifyTree(worker.request(), [1], [-1], out=0, sequence=7),
    ):
        reply = worker.call(command)
        assert isinstance(reply, m.Failed)
        assert reply.kind == "usage"
        assert f"sequence {command.sequence} is not served" in reply.message
        assert "serves 3" in reply.message


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "queued-together"])
@pytest.mark.parametrize("kind", ["native", "llama.cpp"])
def test_interleaved_sequences_give_what_each_gives_alone(workers, kind, together) -> None:
    """Three requests (two greedy, one seeded) interleaved command by command on one worker
    give exactly the tokens and logits each gives alone on a worker of its own."""
    shared = workers(kind, 3)
    prompts = [shared.worker.runtime.tokenize(text) for text in PROMPTS]
    mixed = play(
        shared,
        {i: script(shared, i, prompts[i], SEEDS[i]) for i in range(3)},
        together=together,
    )
    for i in range(3):
        alone = workers(kind, 1)
        own = play(alone, {0: script(alone, 0, prompts[i], SEEDS[i])}, together=False)[0]
        assert same(mixed[i], own), f"sequence {i} differs from its request alone"
    batched = sum(count for (_, size), count in shared.worker.together.items())
    if together and kind == "native":
        # the tree, the decoding and the last verification of each turn ran together
        assert shared.worker.together[("VerifyTree", 3)] == 2
        assert shared.worker.together[("Decode", 3)] == 1
    else:
        assert batched == 0  # llama.cpp has no forward of several sequences


def prefilled(worker: InProcessWorker) -> list[list[int]]:
    prompts = [worker.worker.runtime.tokenize(text) for text in PROMPTS]
    for sequence, prompt in enumerate(prompts):
        worker.call(m.Prefill(worker.request(), prompt, seed=5, sequence=sequence))
    return prompts


def verifications(worker: InProcessWorker, flavour: str) -> list[m.VerifyTree]:
    trees = [([5, 6, 7, 8], [-1, 0, 1, 2]), ([9, 10], [-1, -1]), ([3, 4, 5], [-1, 0, 0])]
    commands = []
    for sequence, (tokens, tree) in enumerate(trees):
        parents = tree
        options = {"out": sequence, "sequence": sequence}
        if flavour == "argmax":
            options |= {"argmax_only": True, "root_row": True}
        elif flavour == "walk":
            options |= {"walk": m.SampledWalk(SAMPLED, position=0, keyed=True), "out": -1}
            parents = [-1, *range(len(tokens) - 1)]
        else:
            options |= {"root_row": True}
        commands.append(m.VerifyTree(worker.request(), tokens, parents, **options))
    return commands


def answers(worker: InProcessWorker, replies: dict, commands) -> list:
    out = []
    for command in commands:
        reply = replies[command.request]
        assert isinstance(reply, m.Verified), reply
        logits = worker.arena.view(reply.logits).copy() if reply.logits else None
        out.append((logits, reply.argmax, reply.path, reply.bonus))
    return out


@pytest.mark.parametrize("flavour", ["logits", "argmax", "walk"])
def test_queued_verifications_run_in_one_forward_bit_for_bit(workers, flavour) -> None:
    batched, single = workers("native", 3), workers("native", 3)
    prefilled(batched), prefilled(single)
    commands = verifications(batched, flavour)
    replies = batched.run(*commands)
    assert batched.worker.together == {("VerifyTree", 3): 1}
    assert len({replies[c.request].elapsed_ms for c in commands}) == 1  # the batch's time
    # each says how wide the forward that paid for it was: every sequence's nodes
    width = sum(len(c.tokens) for c in commands)
    assert {replies[c.request].batch_rows for c in commands} == {width}
    got = answers(batched, replies, commands)
    for command, mine in zip(verifications(single, flavour), got, strict=True):
        alone = answers(single, single.run(command), [command])[0]
        assert same(list(mine), list(alone))
    assert not single.worker.together


def test_verifications_and_decodings_alone_share_the_first_forward(workers) -> None:
    """Two sequences' verifications queued with a third's decoding alone: their trees ride
    in the decoding's first step, each reply what its command gives alone, and the
    verifications answered before the decoding's later steps (their own time)."""
    batched, single = workers("native", 3), workers("native", 3)
    prefilled(batched), prefilled(single)

    def commands(worker):
        verify = verifications(worker, "logits")[:2]
        return [*verify, m.Decode(worker.request(), 6, GREEDY, append=[4, 6], sequence=2)]

    sent = commands(batched)
    replies = batched.run(*sent)
    assert batched.worker.together == {("Decode + VerifyTree", 3): 1}
    decoded = replies[sent[2].request]
    assert replies[sent[0].request].elapsed_ms < decoded.elapsed_ms
    trees = sum(len(c.tokens) for c in sent[:2])
    assert replies[sent[0].request].batch_rows == trees + 1  # and the decoding's token
    got = answers(batched, replies, sent[:2])
    for command, mine in zip(commands(single), [*got, decoded], strict=True):
        reply = single.call(command)
        if isinstance(command, m.Decode):
            assert reply.tokens == mine.tokens
        else:
            assert same(list(mine), list(answers(single, {command.request: reply}, [command])[0]))


def test_commands_queued_while_a_batch_decodes_join_its_next_step(workers) -> None:
    """A verification and a decoding that come while two sequences decode alone join the
    batch's next forward (not after its last step): each answers what it answers alone,
    the verification with the rows of the forward it rode in and its own time."""
    batched, single = workers("native", 4), workers("native", 4)
    prompts = [*PROMPTS, "import os\n"]

    def prefill(worker):
        for sequence, text in enumerate(prompts):
            prompt = worker.worker.runtime.tokenize(text)
            worker.call(m.Prefill(worker.request(), prompt, seed=5, sequence=sequence))

    def commands(worker):
        decodes = [m.Decode(worker.request(), 8, GREEDY, sequence=s) for s in (0, 1)]
        verify = verifications(worker, "logits")[2]
        late = m.Decode(worker.request(), 3, GREEDY, append=[6], sequence=3)
        return decodes, verify, late

    prefill(batched), prefill(single)
    decodes, verify, late = commands(batched)
    asked: list[set[int]] = []

    def more(busy: set[int]) -> list:
        asked.append(set(busy))
        return [verify, late] if len(asked) == 2 else []  # they come after the first step

    batch = list(decodes)
    results = batched.worker.run_together(batch, more=more)
    assert batch == [*decodes, verify, late]
    assert len(results) == 4
    assert asked[0] == {0, 1}
    assert asked[2] == {0, 1, 2, 3}  # never a sequence twice
    assert batched.worker.together[("joined VerifyTree", 2)] == 1
    verified = results[2][0]
    assert verified.batch_rows == len(verify.tokens) + 3  # beside three decodings' tokens
    decoded = [result[0] for result in results[:2]]
    assert verified.elapsed_ms < decoded[0].elapsed_ms  # its own time, not the batch's
    logits = batched.arena.view(verified.logits).copy()  # the arena is both workers'
    alone_decodes, alone_verify, alone_late = commands(single)
    for mine, command in zip([*decoded, results[3][0]], [*alone_decodes, alone_late], strict=True):
        assert mine.tokens == single.call(command).tokens
    reply = single.call(alone_verify)
    assert same(logits, single.arena.view(reply.logits).copy())


def test_a_prompt_queued_with_decodings_rides_in_their_steps_as_alone(workers) -> None:
    """A new request's prompt queued beside two sequences' decodings is evaluated in their
    steps, PREFILL_BESIDE tokens a step (so they never wait for the whole prompt): answered
    once its last chunk is, with what the prompt alone answers (tokens reused, committed, the
    next-token logits), and every sequence decodes on as it does alone."""
    batched, single = workers("native", 3), workers("native", 3)
    long_prompt = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n"
    prompt = batched.worker.runtime.tokenize(long_prompt * 2)
    assert len(prompt) > 2 * PREFILL_BESIDE  # three steps at least

    def commands(worker):
        for sequence, text in enumerate(PROMPTS[:2]):
            worker.call(
                m.Prefill(
                    worker.request(),
                    worker.worker.runtime.tokenize(text),
                    seed=5,
                    sequence=sequence,
                )
            )
        decodes = [m.Decode(worker.request(), 10, GREEDY, sequence=s) for s in (0, 1)]
        return [*decodes, m.Prefill(worker.request(), prompt, seed=5, out=2, sequence=2)]

    sent = commands(batched)
    replies = batched.run(*sent)
    assert batched.worker.together == {("Decode + Prefill", 3): 1}
    prefilled = replies[sent[2].request]
    assert isinstance(prefilled, m.Prefilled), prefilled
    assert prefilled.elapsed_ms < replies[sent[0].request].elapsed_ms  # answered early
    logits = batched.arena.view(prefilled.logits).copy()
    alone = commands(single)
    for mine, command in zip([replies[c.request] for c in sent[:2]], alone[:2], strict=True):
        assert mine.tokens == single.call(command).tokens
    reply = single.call(alone[2])
    assert (
        (prefilled.reused, prefilled.committed)
        == (reply.reused, reply.committed)
        == (0, len(prompt))
    )
    assert same(logits, single.arena.view(reply.logits).copy())
    after = [m.Decode(w.request(), 6, SAMPLED, sequence=2) for w in (batched, single)]
    assert batched.call(after[0]).tokens == single.call(after[1]).tokens  # its sampler too


def test_a_long_prompt_or_one_with_log_probabilities_runs_alone(workers) -> None:
    worker = workers("native", 2)
    handlers = worker.worker
    decode = m.Decode(1, 4, GREEDY, sequence=0)
    assert handlers.joins(decode, m.Prefill(2, [1] * PREFILL_JOINS_UP_TO, sequence=1))
    assert not handlers.joins(decode, m.Prefill(2, [1] * (PREFILL_JOINS_UP_TO + 1), sequence=1))
    assert not handlers.joins(decode, m.Prefill(2, [1, 2], prompt_logprobs=0, sequence=1))
    assert not handlers.joins(decode, m.Prefill(2, [1, 2], report_features=True, sequence=1))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_queued_drafts_of_several_sequences_are_drafted_together_as_alone(workers, params):
    """Chain drafts of three sequences queued together: their catch-ups in one forward, then
    one forward a step (chains of different lengths each stop at its own); each reply's
    tokens and nodes are what its draft alone gives, its probability rows too within float
    rounding (a chain alone is drafted in one C call, which normalizes its rows itself)."""
    batched, single = workers("native", 3), workers("native", 3)
    prefilled(batched), prefilled(single)

    def commands(worker):
        shapes = [(5, [4, 6]), (3, []), (7, [9])]
        return [
            m.Draft(worker.request(), m.Chains(steps), params, out=s, append=append, sequence=s)
            for s, (steps, append) in enumerate(shapes)
        ]

    sent = commands(batched)
    replies = batched.run(*sent)
    assert batched.worker.together == {("Draft", 3): 1}
    drafted = []
    for command in sent:
        reply = replies[command.request]
        assert isinstance(reply, m.Drafted), reply
        drafted.append((reply, batched.arena.view(reply.probs).copy()))
    assert drafted[1][0].elapsed_ms < drafted[2][0].elapsed_ms  # the shorter answered first
    for command, (mine, rows) in zip(commands(single), drafted, strict=True):
        alone = single.call(command)
        assert (mine.tokens, mine.nodes, mine.root) == (alone.tokens, alone.nodes, alone.root)
        assert mine.forwards == len(alone.tokens[0]) - 1  # the catch-up's forward apart
        np.testing.assert_allclose(rows, single.arena.view(alone.probs), rtol=1e-5, atol=1e-9)
    assert not single.worker.together


def test_a_draft_refused_in_a_batch_of_drafts_fails_alone(workers) -> None:
    batched = workers("native", 3)
    prefilled(batched)
    good = m.Draft(batched.request(), m.Chains(4), GREEDY, out=0, append=[5], sequence=0)
    bad = m.Draft(batched.request(), m.Chains(4), GREEDY, out=SLOTS + 3, sequence=1)
    replies = batched.run(good, bad)
    assert batched.worker.together == {("Draft", 2): 1}
    assert isinstance(replies[good.request], m.Drafted)
    assert len(replies[good.request].tokens[0]) == 4
    failed = replies[bad.request]
    assert isinstance(failed, m.Failed)
    assert failed.kind == "usage", failed


def test_queued_decodings_stop_each_at_its_own_end(workers) -> None:
    batched, single = workers("native", 3), workers("native", 3)
    prefilled(batched), prefilled(single)

    def decodes(worker):
        alone_tokens = [9, 3, 6]
        return [
            m.Decode(worker.request(), 6, GREEDY, sequence=0, logprobs=1),
            m.Decode(worker.request(), 2, SAMPLED, append=[alone_tokens[1]], sequence=1),
            m.Decode(worker.request(), 8, GREEDY, append=[4, 6], sequence=2, ends=[0, 1, 2]),
        ]

    commands = decodes(batched)
    replies = batched.run(*commands)
    assert batched.worker.together == {("Decode", 3): 1}
    for command, own in zip(decodes(single), commands, strict=True):
        alone = single.call(command)
        mine = replies[own.request]
        assert (mine.tokens, mine.logprobs) == (alone.tokens, alone.logprobs)
    assert len(replies[commands[1].request].tokens) == 2


def test_a_queued_command_never_passes_one_of_its_own_sequence(workers) -> None:
    """A's verification is taken with C's but not B's, which waits behind B's Commit; a
    command of no sequence (Tokenize) stops the search for more."""
    worker = workers("native", 3)
    prefilled(worker)
    worker.call(m.VerifyTree(worker.request(), [5, 6], [-1, 0], out=1, sequence=1))
    a, b, c = verifications(worker, "argmax")
    commit = m.Commit(worker.request(), nodes=[0, 1], sequence=1)
    replies = worker.run(a, commit, b, c)
    assert worker.worker.together == {("VerifyTree", 2): 1}
    assert all(not isinstance(reply, m.Failed) for reply in replies.values())
    assert replies[commit.request].committed == worker.worker.sequences[1].engine.committed

    a, b, _ = verifications(worker, "argmax")
    tokenize = m.Tokenize(worker.request(), "x")
    worker.run(a, tokenize, b)
    assert worker.worker.together == {("VerifyTree", 2): 1}  # nothing more ran together


def test_a_failure_in_a_batch_is_that_commands_own(workers) -> None:
    """One sequence's tree is refused (a parent after its node): the others are answered."""
    worker = workers("native", 3)
    prefilled(worker)
    a, b, c = verifications(worker, "logits")
    b = msgspec.structs.replace(b, parents=[1, -1])
    replies = worker.run(a, b, c)
    assert worker.worker.together == {("VerifyTree", 3): 1}
    assert isinstance(replies[b.request], m.Failed)
    assert isinstance(replies[a.request], m.Verified)
    assert isinstance(replies[c.request], m.Verified)


def test_a_cancel_for_a_command_taken_along_is_remembered_not_answered(tmp_path) -> None:
    context = zmq.Context.instance()
    daemon_side = context.socket(zmq.PUSH)
    daemon_side.setsockopt(zmq.LINGER, 0)
    daemon_side.bind(f"ipc://{tmp_path}/commands.sock")
    answered: list[m.Failed] = []
    reader = CommandReader(context, f"ipc://{tmp_path}/commands.sock", 0.0, answered.append)
    codec = Codec(m.Command)
    try:
        for sequence in (0, 1):
            command = m.VerifyTree(sequence + 1, [1], [-1], out=0, sequence=sequence)
            daemon_side.send_multipart(codec.encode(command))
        time.sleep(0.1)  # ipc delivers asynchronously
        first, _ = reader.next()
        assert [c.request for c, _ in reader.take_along(first, lambda _: True)] == [2]
        daemon_side.send_multipart(codec.encode(m.Cancel(request=2)))
        time.sleep(0.1)
        assert reader.running_cancelled()
        assert not answered  # it runs, and its reply is its answer
    finally:
        reader.socket.close(linger=0)
        daemon_side.close()


@pytest.mark.process
async def test_a_worker_process_verifies_commands_posted_together_in_one_forward(
    tmp_path, arena
) -> None:
    """Through the daemon's client: three sequences' verifications posted while the worker
    holds an Echo are read together and run in one forward (their replies share the batch's
    elapsed_ms), answering what each answers alone."""
    from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec  # noqa: PLC0415

    spec = WorkerSpec(
        name="gpu",
        runtime="native",
        model=str(GGUF),
        settings=m.NativeSettings(n_ctx=CONTEXT, threads=1),
        cores=(0,),
        log_format="console",
        sequences=3,
    )
    client = WorkerClient(spec, tmp_path, generation=1, arena=arena.layout)
    ready = await client.start(120)
    try:
        assert ready.sequences == 3
        for sequence, text in enumerate(PROMPTS):
            prompt, _ = await client.call(m.Tokenize(client.next_request(), text))
            await client.call(m.Prefill(client.next_request(), prompt.tokens, sequence=sequence))

        def commands() -> list[m.VerifyTree]:
            trees = [([5, 6, 7, 8], [-1, 0, 1, 2]), ([9, 10], [-1, 0]), ([3, 4, 5], [-1, 0, 0])]
            return [
                m.VerifyTree(
                    client.next_request(), *tree, out=-1, argmax_only=True, sequence=sequence
                )
                for sequence, tree in enumerate(trees)
            ]

        data = np.zeros(1, np.float32)
        hold = m.Echo(client.next_request(), ArrayRef("<f4", (1,), frame=1), hold_us=300_000)
        held = client.post(hold, (data,))
        posted = [client.post(command) for command in commands()]
        await held
        together = [reply for reply, _ in await asyncio.gather(*posted)]
        assert len({reply.elapsed_ms for reply in together}) == 1  # one batch
        alone = [(await client.call(command))[0] for command in commands()]
        assert [reply.argmax for reply in together] == [reply.argmax for reply in alone]
        assert len({reply.elapsed_ms for reply in alone}) == 3
    finally:
        await client.stop()


@pytest.mark.process
def test_the_bench_times_verifications_posted_together_through_a_worker(capsys) -> None:
    """bench/batched_verify.py --worker on the bundled target: a row for every k and w, the
    argmax posted together and one by one checked equal as it times them."""
    from hetspec.bench import batched_verify  # noqa: PLC0415

    argv = ["--worker", "--models", "bundled", "--sequences", "1,2", "--widths", "2"]
    assert batched_verify.main([*argv, "--passes", "1", "--prefix", "16", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for k in (1, 2):
        assert f"\n| {k} | 2 | " in out
    assert "through a worker process" in out


def test_the_reader_gathers_the_sequences_about_to_send_until_they_have(tmp_path) -> None:
    """``gather`` returns once a command of each sequence waited for is queued, or after its
    time when one never comes; it takes nothing out of the backlog."""
    context = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"ipc://{tmp_path}/gather.sock")
    reader = CommandReader(context, f"ipc://{tmp_path}/gather.sock", 0.0, lambda *_: None)
    codec = Codec(m.Command)
    try:
        for sequence in (1, 2):
            push.send_multipart(codec.encode(m.Rollback(sequence, 0, sequence=sequence)))
        start = time.perf_counter()
        reader.gather({1, 2}, 5.0)
        assert time.perf_counter() - start < 2.5  # both came: no waiting out the 5 s
        assert [c.sequence for c, _ in reader.backlog] == [1, 2]
        start = time.perf_counter()
        reader.gather({1, 2, 3}, 0.05)  # sequence 3 never sends
        assert time.perf_counter() - start >= 0.05
        assert len(reader.backlog) == 2
    finally:
        reader.socket.close()
        push.close()
