"""Worker messages, their framing, and the shared-memory arena (across a real second process)."""

from __future__ import annotations

import select
import stat
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from hetspec.protocol import (
    Arena,
    ArenaError,
    ArrayRef,
    Codec,
    MessageError,
    frame_array,
    frame_ref,
    mailbox,
)
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import ArenaLayout
from hetspec.workers.process import CommandReader

COMMANDS = [
    m.Load(model="/models/t", settings=m.TorchSettings(device="cpu"), arena=None),
    m.Load(
        model="/m.gguf",
        settings=m.LlamaCppSettings(n_seq_max=8),
        arena=ArenaLayout("/dev/shm/x", 4, 128),
    ),
    m.Prefill(request=1, tokens=[1, 2, 3], seed=7),
    m.Draft(
        request=2,
        shape=m.Chains(4, branches=2),
        sampling=m.SamplingParams(temperature=0.7, top_k=40),
        out=1,
    ),
    m.Draft(request=2, shape=m.RuleBranches(8, 4, 1.0), sampling=m.SamplingParams(), out=1),
    m.Draft(request=2, shape=m.DynamicTree(4, 2, 9, 0.7), sampling=m.SamplingParams(), out=1),
    m.Draft(request=2, shape=m.RunAhead(3, 17, 5), sampling=m.SamplingParams(), out=0),
    m.VerifyTree(request=3, tokens=[5, 6], parents=[-1, 0], out=0, extend=True),
    m.Commit(request=4, nodes=[0, 1], tokens=[9]),
    m.Rollback(request=5, length=3),
    m.Tokenize(request=6, text="héllo"),
    m.Echo(request=7, data=ArrayRef("<f4", (2, 3), frame=1), out=-1),
    m.Cancel(request=8),
    m.Shutdown(),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_round_trips_and_is_not_a_reply(command) -> None:
    frames = Codec(m.Reply).encode(command)
    assert Codec(m.Command).decode(frames) == command
    with pytest.raises(MessageError, match="not a valid message"):
        Codec(m.Reply).decode(frames)


def test_malformed_messages_are_refused_with_the_reason() -> None:
    commands = Codec(m.Command)
    encode = msgspec.msgpack.encode
    with pytest.raises(MessageError, match="Invalid value 'launch'"):
        commands.decode([encode({"op": "launch"})])
    with pytest.raises(MessageError, match="unknown field `speed`"):
        commands.decode([encode({"op": "rollback", "request": 1, "length": 2, "speed": 3})])
    with pytest.raises(MessageError, match=r"temperature must be 0 \(greedy\) or in"):
        commands.decode(
            [
                encode(
                    {
                        "op": "draft",
                        "request": 1,
                        "shape": {"shape": "chains", "steps": 2},
                        "out": 0,
                        "sampling": {"temperature": float("nan")},
                    }
                )
            ]
        )
    with pytest.raises(MessageError, match="empty message"):
        commands.decode([])
    # a draft is one shape with its own fields: a chain with a tree's field is refused
    draft = {"op": "draft", "request": 1, "out": 0, "sampling": {}}
    with pytest.raises(MessageError, match="unknown field `top_k`"):
        commands.decode([encode({**draft, "shape": {"shape": "chains", "steps": 2, "top_k": 3}})])
    with pytest.raises(MessageError, match="Invalid value 'branches'"):
        commands.decode([encode({**draft, "shape": {"shape": "branches", "steps": 2}})])
    with pytest.raises(ValueError, match="either in one frame"):
        ArrayRef("<f4", (3,), frame=1, slot=0)


def test_small_arrays_travel_as_their_own_frames() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    codec = Codec(m.Command)
    frames = codec.encode(m.Echo(request=1, data=frame_ref(array, 1)), [array])
    sent = [bytes(memoryview(frame)) for frame in frames]  # what the socket delivers
    message = codec.decode(sent)
    np.testing.assert_array_equal(frame_array(message.data, sent), array)
    with pytest.raises(MessageError, match="has 48 bytes, expected 52"):
        frame_array(ArrayRef("<f4", (13,), frame=1), sent)
    with pytest.raises(MessageError, match="has 2 frames"):
        frame_array(ArrayRef("<f4", (3,), frame=2), sent)


@pytest.mark.process
def test_the_arena_is_private_shared_with_another_process_and_unlinked(tmp_path) -> None:
    path = tmp_path / "hetspec-test-arena"
    with Arena.create(path, slots=3, slot_bytes=1000) as arena:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert arena.layout.slot_bytes == 1024  # rounded up to the alignment
        row = arena.empty(1, (250,))
        row[:] = np.arange(250)
        script = (
            "import sys, msgspec, numpy as np\n"
            "from hetspec.protocol import Arena, ArrayRef\n"
            "from hetspec.protocol.arena import ArenaLayout\n"
            "layout = msgspec.json.decode(sys.argv[1], type=ArenaLayout)\n"
            "arena = Arena.attach(layout)\n"
            "row = arena.view(ArrayRef('<f4', (250,), slot=1))\n"
            "arena.empty(2, (250,))[:] = row * 2\n"
        )
        layout = msgspec.json.encode(arena.layout).decode()
        subprocess.run([sys.executable, "-c", script, layout], check=True, timeout=60)
        np.testing.assert_array_equal(
            arena.view(ArrayRef("<f4", (250,), slot=2)), np.arange(250) * 2
        )
        with pytest.raises(ArenaError, match="does not fit in a 1024-byte slot"):
            arena.empty(0, (257,))
        with pytest.raises(ArenaError, match="slot 3 outside"):
            arena.empty(3, (1,))
        with pytest.raises(ArenaError, match="cannot create"):
            Arena.create(path, slots=1, slot_bytes=8)  # never reuses a segment
    assert not path.exists()
    with pytest.raises(ArenaError, match="cannot open"):
        Arena.attach(ArenaLayout(str(path), 3, 1024))


# ------------------------------------------------------------------ mailboxes


needs_mailboxes = pytest.mark.skipif(
    not mailbox.supported(), reason="mailboxes need Linux on x86-64"
)


@needs_mailboxes
def test_a_mailbox_delivers_every_message_in_order_across_its_wrap() -> None:
    """Random posts and takes through a small ring (it wraps many times): what comes out is
    what went in, in order; a full ring refuses without writing; a message bigger than half
    the ring is refused so that it can go by the socket; a marker says where it went."""
    producer = mailbox.Mailbox.create(4096)
    consumer = mailbox.Mailbox.attach(*producer.fds)
    rng = np.random.default_rng(0)
    sent, taken, refused = [], [], 0
    try:
        for _ in range(5000):
            if rng.random() < 0.6:
                frames = [rng.bytes(int(rng.integers(0, 300))) for _ in range(rng.integers(1, 4))]
                try:
                    assert producer.post(frames)
                    sent.append(frames)
                except mailbox.MailboxFull:
                    refused += 1
            elif (message := consumer.take()) is not None:
                taken.append(message)
        while (message := consumer.take()) is not None:
            taken.append(message)
        assert taken == sent
        assert refused > 0
        assert len(sent) > 1000
        assert not producer.post([b"x" * 2049])  # over half the ring: the socket's
        row = np.arange(8, dtype=np.float32)
        producer.divert()
        assert producer.post([b"after", row])
        assert consumer.take() is mailbox.DIVERTED_MESSAGE
        header, data = consumer.take()
        assert header == b"after"
        assert np.frombuffer(data, np.float32).tolist() == row.tolist()
    finally:
        producer.close()
        consumer.close()


@pytest.mark.process
@needs_mailboxes
def test_a_mailbox_reaches_another_process_and_rings_its_bell(tmp_path) -> None:
    """A child that inherited the descriptors sleeps on the bell, reads what was posted and
    answers through a second mailbox."""
    commands, replies = mailbox.Mailbox.create(), mailbox.Mailbox.create()
    script = (
        "import select, sys\n"
        "from hetspec.protocol.mailbox import Mailbox\n"
        "fds = [int(fd) for fd in sys.argv[1:]]\n"
        "inbox, outbox = Mailbox.attach(*fds[:2]), Mailbox.attach(*fds[2:])\n"
        "while True:\n"
        "    poll = select.poll(); poll.register(inbox.bell_fd, select.POLLIN); poll.poll()\n"
        "    inbox.clear()\n"
        "    while (frames := inbox.take()) is not None:\n"
        "        if frames == [b'stop']: sys.exit(0)\n"
        "        outbox.post([frames[0][::-1]]); outbox.ring()\n"
    )
    fds = [*commands.fds, *replies.fds]
    child = subprocess.Popen([sys.executable, "-c", script, *map(str, fds)], pass_fds=fds)
    try:
        for word in (b"first", b"second"):
            commands.post([word])
            commands.ring()
            poll = select.poll()
            poll.register(replies.bell_fd, select.POLLIN)
            assert poll.poll(10_000), "no answer within 10 s"
            replies.clear()
            assert replies.take() == [word[::-1]]
        commands.post([b"stop"])
        commands.ring()
        assert child.wait(10) == 0
    finally:
        child.kill()
        commands.close()
        replies.close()


@needs_mailboxes
def test_an_announced_command_finds_its_reader_awake_and_spends_the_announcement(
    tmp_path,
) -> None:
    """``announce`` rings the bell and counts; a reader woken by it with nothing to read
    waits awake for the command, and taking the command spends the announcement, so that a
    later wake-up with nothing (a bell left from a command read while spinning) does not
    keep the reader awake for nothing."""
    producer = mailbox.Mailbox.create()
    consumer = mailbox.Mailbox.attach(*producer.fds)
    context = zmq.Context.instance()
    reader = CommandReader(context, f"ipc://{tmp_path}/unused.sock", 0.0, print, consumer)
    codec = Codec(m.Command)
    try:
        producer.announce()
        assert consumer.announcements() == 1
        assert select.select([consumer.bell_fd], [], [], 0)[0], "the announcement rang"

        def post_later() -> None:
            time.sleep(0.02)
            producer.post(codec.encode(m.Tokenize(request=7, text="x")))
            producer.ring()

        poster = threading.Thread(target=post_later)
        poster.start()
        assert reader.next()[0].request == 7
        poster.join()
        assert not reader._announced()  # spent by the command it announced
        producer.announce()
        assert reader._announced()
    finally:
        reader.socket.close(linger=0)
        producer.close()
        consumer.close()
