"""``hetspec-stage``: a process holding a contiguous range of the target's layers, one stage of
FlowSpec's pipeline, reached over ZeroMQ on TCP with CURVE (docs/beyond-one-box.md).

    hetspec-stage keys DIR NAME...          # CURVE key pairs: DIR/NAME.key, DIR/NAME.key_secret
    hetspec-stage serve --model FOLDER --layers 0:8 --bind tcp://10.0.0.2:5601 \\
        --key DIR/stage1.key_secret --authorized DIR/clients/

Only clients whose public key file is in ``--authorized`` may connect (the coordinator, and
the stage before this one); traffic is encrypted. Rows come from the stage before (or the
coordinator, for the first stage) and commits straight from the coordinator; the stage's
bookkeeping (speculative/flow/stage_cache.py) makes their arrival order irrelevant.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

from hetspec.protocol.curve_keys import CurveKeyError, load_secret, make_keys
from hetspec.protocol.frames import Codec, MessageError, frame_array, frame_ref
from hetspec.protocol.pipeline_messages import (
    PIPELINE_PROTOCOL_VERSION,
    Commit,
    Output,
    Ready,
    Reset,
    Rows,
    StageFailed,
    ToStage,
)
from hetspec.speculative.flow.layer_split import SplitError, format_range, parse_range
from hetspec.speculative.flow.stage_cache import StageBook


class Sender(threading.Thread):
    """Owns the outgoing sockets (ZeroMQ sockets belong to one thread) and sends each message
    ``delay_s`` after it was queued: a link's latency, for tests and the bench."""

    def __init__(self, context: zmq.Context, public: bytes, secret: bytes, delay_s: float):
        super().__init__(daemon=True, name="stage-sender")
        self.context, self.public, self.secret, self.delay_s = context, public, secret, delay_s
        self.jobs: queue.Queue = queue.Queue()
        self.sockets: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, server_key: str, frames: list) -> None:
        self.jobs.put((time.monotonic() + self.delay_s, endpoint, server_key, frames))

    def run(self) -> None:
        while True:
            due, endpoint, server_key, frames = self.jobs.get()
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            self._socket(endpoint, server_key).send_multipart(frames, copy=False)

    def _socket(self, endpoint: str, server_key: str) -> zmq.Socket:
        key = f"{endpoint} {server_key}"
        if key not in self.sockets:
            socket = self.context.socket(zmq.PUSH)
            socket.curve_publickey, socket.curve_secretkey = self.public, self.secret
            socket.curve_serverkey = server_key.encode()
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(endpoint)
            self.sockets[key] = socket
        return self.sockets[key]


class Stage:
    """The message loop of one stage over a StageRuntime."""

    def __init__(self, runtime, name: str, sender: Sender) -> None:
        self.runtime, self.name, self.sender = runtime, name, sender
        self.codec: Codec = Codec(ToStage)
        self.session: int | None = None
        self.reset: Reset | None = None
        self.book: StageBook | None = None
        self.waiting: deque[tuple[Rows, np.ndarray]] = deque()

    def handle(self, frames: list) -> None:
        try:
            message = self.codec.decode(frames)
        except MessageError:
            return  # an authenticated client sent garbage: nothing to answer
        match message:
            case Reset():
                self._reset(message)
            case _ if message.session != self.session:
                return  # left over from an earlier request
            case Commit():
                self._commit(message)
            case Rows():
                try:
                    data = frame_array(message.data, frames)
                except MessageError as error:
                    self._fail(f"malformed rows: {error}")
                    return
                self._rows(message, data)

    def _reply(self, message, arrays=()) -> None:
        reset = self.reset
        self.sender.send(
            reset.coordinator, reset.coordinator_key, self.codec.encode(message, arrays)
        )

    def _reset(self, message: Reset) -> None:
        self.session, self.reset, self.book = message.session, message, None
        self.waiting.clear()
        self.runtime.clear()
        halves = self.runtime.halves
        if message.version != PIPELINE_PROTOCOL_VERSION:
            why = f"protocol {message.version}; this stage speaks {PIPELINE_PROTOCOL_VERSION}"
            self._reply(StageFailed(message.session, self.name, why))
            return
        self._reply(
            Ready(
                message.session,
                message.index,
                self.name,
                halves.start,
                halves.stop,
                self.runtime.config.num_layers,
                self.runtime.capacity,
            )
        )

    def _commit(self, message: Commit) -> None:
        if self.book is None or message.epoch != self.book.epoch + 1:
            applied = None if self.book is None else self.book.epoch
            self._fail(f"commit {message.epoch} out of order (applied: {applied})")
            return
        self.runtime.compact(self.book.commit(message.accepted, message.root))
        while self.waiting and self.book.ready(self.waiting[0][0].epoch):
            self._rows(*self.waiting.popleft())

    def _rows(self, rows: Rows, data: np.ndarray) -> None:
        try:
            start = time.perf_counter()
            if rows.prefill:
                out = self.runtime.prefill(np.array(data))
                self.book = StageBook(self.runtime.filled, rows.root)
                self._forward(rows, out, start)
                return
            if self.book is None or not self.book.ready(rows.epoch):
                self.waiting.append((rows, np.array(data)))
                return
            admission = self.book.admit(rows.ids, rows.parents, rows.epoch)
            keep = admission.keep
            if not keep:  # all pruned meanwhile: pass the empty segment on, so that the
                empty = np.zeros((0, self.runtime.config.hidden_size), np.float32)
                self._forward(rows, empty, start)  # the coordinator sees it come back
                return
            positions = np.asarray(rows.positions, np.int64)[keep]
            out = self.runtime.admit(
                admission, np.asarray(data)[keep], positions, self.book.committed
            )
            self._forward(
                rows,
                out,
                start,
                ids=[rows.ids[i] for i in keep],
                parents=[rows.parents[i] for i in keep],
                positions=positions.tolist(),
            )
        except (ValueError, RuntimeError) as error:
            self._fail(str(error))

    def _forward(
        self, rows: Rows, out: np.ndarray, start: float, *, ids=(), parents=(), positions=()
    ) -> None:
        """Pass the computed rows on (the last stage: logits to the coordinator), with this
        stage's compute time since ``start``."""
        ids, parents, positions = list(ids), list(parents), list(positions)
        costs = [*rows.costs_ms, (time.perf_counter() - start) * 1000]
        widths = [*rows.widths, len(out)]
        if self.runtime.last:
            logits = out[-1:] if rows.prefill else out
            self._reply(
                Output(rows.session, frame_ref(logits, 1), ids, rows.prefill, costs, widths),
                [logits],
            )
            return
        message = Rows(
            rows.session,
            frame_ref(out, 1),
            ids,
            parents,
            positions,
            rows.epoch,
            rows.prefill,
            rows.root,
            costs,
            widths,
        )
        self.sender.send(self.reset.next, self.reset.next_key, self.codec.encode(message, [out]))

    def _fail(self, why: str) -> None:
        self._reply(StageFailed(self.session, self.name, why))
        self.session = None  # everything else of this request is dropped


def serve(args: argparse.Namespace) -> int:
    try:  # the model's layer count is checked at load
        first, end = parse_range(args.layers, 10**6)
    except SplitError as error:
        print(f"hetspec-stage: --layers: {error}", file=sys.stderr)
        return 2
    try:
        public, secret = load_secret(Path(args.key))
    except CurveKeyError as error:
        print(f"hetspec-stage: {error}", file=sys.stderr)
        return 2
    authorized = Path(args.authorized)
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        print(
            f"hetspec-stage: {authorized} holds no public keys (*.key) of clients to allow",
            file=sys.stderr,
        )
        return 2

    from hetspec.workers.runtimes.torch_runtime import ModelLoadError  # noqa: PLC0415
    from hetspec.workers.runtimes.torch_runtime.stage_runtime import StageRuntime  # noqa: PLC0415

    try:
        runtime = StageRuntime(
            args.model, first / 2, end / 2, max_context=args.max_context, threads=args.threads
        )
    except ModelLoadError as error:
        print(f"hetspec-stage: {error}", file=sys.stderr)
        return 2
    context = zmq.Context()
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    inbound = context.socket(zmq.PULL)
    inbound.curve_server = True
    inbound.curve_publickey, inbound.curve_secretkey = public, secret
    inbound.setsockopt(zmq.RCVHWM, 0)
    try:
        inbound.bind(args.bind)
    except zmq.ZMQError as error:
        print(f"hetspec-stage: cannot bind {args.bind}: {error}", file=sys.stderr)
        return 1
    sender = Sender(context, public, secret, args.link_ms / 1000)
    sender.start()
    name = f"layers {format_range(first, end)} of {Path(args.model).name}"
    stage = Stage(runtime, name, sender)
    print(f"hetspec-stage: {name} at {args.bind}", file=sys.stderr, flush=True)
    while True:
        stage.handle(inbound.recv_multipart(copy=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetspec-stage", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="make CURVE key pairs")
    keys.add_argument("folder")
    keys.add_argument("names", nargs="+")
    run = commands.add_parser("serve", help="serve a range of a model's layers")
    run.add_argument("--model", required=True, help="the target's model folder")
    run.add_argument(
        "--layers",
        required=True,
        help="FIRST:END in layers, END excluded: 0:8, or 0:2.5 (ending after layer 2's attention)",
    )
    run.add_argument("--bind", required=True, help="ZeroMQ endpoint, e.g. tcp://10.0.0.2:5601")
    run.add_argument("--key", required=True, help="this stage's NAME.key_secret (mode 0600)")
    run.add_argument(
        "--authorized", required=True, help="folder of the public keys (*.key) of clients to allow"
    )
    run.add_argument("--threads", type=int, default=None)
    run.add_argument("--max-context", type=int, default=2048)
    run.add_argument(
        "--link-ms",
        type=float,
        default=0.0,
        help="delay each message sent by this much (a slow link, for tests)",
    )
    args = parser.parse_args(argv)
    if args.command == "keys":
        try:
            for path in make_keys(Path(args.folder), args.names):
                print(path)
        except CurveKeyError as error:
            print(f"hetspec-stage: {error}", file=sys.stderr)
            return 2
        return 0
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
