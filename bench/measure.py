"""Running ``hetspec bench``'s requests: a daemon to send them to, their order, the load.

Contract: ``daemon`` yields a ready client (of the daemon at ``--socket``, or of a fresh
``hetspecd`` it starts and stops); ``run_requests`` sends every (system, prompt) pair
``repeats`` times, interleaved (prompt by prompt, each system in turn, the order rotating) so
that a box whose speed drifts slows every system alike, and before each daemon request has
the workers prefill another prompt (``forget_prompt``), so that no system reuses the prefix
the one before it left. Sampled requests get prompt i's seed ``SEED_BASE`` + i in every system
(unless unseeded). ``BusyCore`` is the other tenant of the load run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from hetspec.bench.records import Record
from hetspec.bench.systems import Peers, systems
from hetspec.bench.targets import BenchTarget
from hetspec.client.clients import Client
from hetspec.client.daemon_process import DaemonProcess
from hetspec.client.types import HetspecError
from hetspec.models.corpus import FORGET_PROMPT, prompt_set

SEED_BASE = 1000  # a sampled bench's seed for prompt i: SEED_BASE + i, in every system


class BusyCore:
    """A process that keeps one core busy (another tenant of the box)."""

    def __init__(self, core: int) -> None:
        self.core = core
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        if self.process is None:
            self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            os.sched_setaffinity(self.process.pid, {self.core})

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@contextlib.contextmanager
def daemon(
    placement: str,
    socket: str | None,
    log_dir: Path,
    target: BenchTarget | None = None,
    *,
    settings: Sequence[str] = (),
    name: str | None = None,
) -> Iterator[Client]:
    """A ready daemon: the one at ``socket``, or a fresh ``hetspecd`` at its defaults (the
    GPU worker's runtime measured at load) on ``target`` (default: the bundled pair), with
    ``settings`` ("key=value" for ``--set``); ``name`` names its log."""
    if socket:
        client = Client(socket)
        client.wait_ready(10)
        yield client
        return
    name = name or (f"{target.name}-{placement}" if target else placement)
    command = ["--placement", placement.removesuffix("-llama")]
    if placement.endswith("-llama"):  # both workers in llama.cpp
        command += ["--set", 'gpu_runtime="llama.cpp"']
    if target is not None:
        for key, path in (
            ("target.folder", target.target.folder_setting),
            ("target.gguf", target.target.gguf),
            ("draft.folder", target.draft.folder_setting),
            ("draft.gguf", target.draft.gguf),
        ):
            command += ["--set", f"{key}={json.dumps(str(path))}"]
    for item in settings:
        command += ["--set", item]
    run = Path(tempfile.mkdtemp(prefix="hetspec-bench-"))
    hetspecd = DaemonProcess(run, *command, log=log_dir / f"hetspecd-{name}.log")
    try:
        try:
            hetspecd.wait_ready(900)  # a first start measures the runtimes: minutes
        except HetspecError as error:
            raise HetspecError(f"hetspecd did not start on {name}: {error}") from None
        with Client(f"unix://{hetspecd.socket}") as client:
            yield client
    finally:
        hetspecd.stop()


def drafter_core(client: Client, placement: str) -> int:
    """A core the drafting worker owns (where another tenant hurts drafting)."""
    workers = client.health()["workers"]
    pid = workers["cpu" if placement.startswith("draft-cpu") else "gpu"]["pid"]
    return min(os.sched_getaffinity(pid))


def forget_prompt(client: Client) -> None:
    """Have both workers prefill another prompt, so that the next request's prompt is
    prefilled in full, as the peers' are: otherwise every system after the first on a prompt
    reused its cached prefix, and TTFT told the order the systems ran in, not the systems."""
    client.generate(FORGET_PROMPT, max_tokens=2, ignore_eos=True, mode="sequential", gamma=1)


def run_requests(
    client, plan, prompts, options, *, repeats, loaded_from=None, busy=None, progress=None
):
    """Every (system, prompt) ``repeats`` times, interleaved; returns the records. Sampled
    ``options`` with ``seeded`` give prompt i the seed ``SEED_BASE`` + i; without, outputs
    are not compared (each request draws its own). ``progress(records)``, where given, after
    each prompt every system has run."""
    options = dict(options)
    seeded, sampled = options.pop("seeded", True), bool(options.get("temperature"))
    records = []
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            loaded = loaded_from is not None and index >= loaded_from
            if busy is not None:
                busy.start() if loaded else busy.stop()
            shift = index + repeat
            seed = SEED_BASE + index if sampled and seeded else None
            for system in plan[shift % len(plan) :] + plan[: shift % len(plan)]:
                if system.peer is not None:
                    records.append(
                        system.peer.record(
                            system.name, prompt, index, repeat, options["max_tokens"], seed=seed
                        )
                    )
                    continue
                forget_prompt(client)
                given = {**options, **({} if seed is None else {"seed": seed})}
                done = client.generate(prompt, **given, **system.options)
                record = Record.of(system.name, index, repeat, loaded, done)
                records.append(replace(record, output="") if sampled and not seeded else record)
            if progress is not None:
                progress(records)
        print(f"  repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
    if busy is not None:
        busy.stop()
    return records


def measure_modes(
    client: Client, placement: str, args, peers: Peers | None, progress=None
) -> list[Record]:
    """Every system on every prompt, after a warm-up; ``progress`` as ``run_requests``'s
    (not during the warm-up)."""
    prompts = prompt_set(args.prompts)
    plan = systems(args.gammas) + (peers.systems if peers else [])
    print(f"{placement}: warm-up", file=sys.stderr, flush=True)
    run_requests(client, plan, prompts[: args.warmup], request_options(args), repeats=1)
    chat = len(prompts) - args.prompts
    print(
        f"{placement}: modes, {args.prompts} code + {chat} chat prompts x {len(plan)} systems",
        file=sys.stderr,
    )
    return run_requests(
        client, plan, prompts, request_options(args), repeats=args.repeats, progress=progress
    )


def measure_load(client: Client, placement: str, args) -> list[Record]:
    """The overlapped systems again, a busy process on the drafter's core from mid-run."""
    prompts = prompt_set(args.prompts)
    loaded_plan = [s for s in systems(args.gammas) if s.overlapped]
    busy = BusyCore(drafter_core(client, placement))
    print(f"{placement}: load on core {busy.core} from prompt {len(prompts) // 2}", file=sys.stderr)
    return run_requests(
        client,
        loaded_plan,
        prompts,
        request_options(args),
        repeats=1,
        loaded_from=len(prompts) // 2,
        busy=busy,
    )


def request_options(args) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": args.temperature,
        "seeded": args.seeded,
    }


def sampling_note(args) -> str:
    """How the bench's requests choose their tokens, for the report's first lines."""
    if not args.temperature:
        return "greedy"
    seeds = f"prompt i seeded {SEED_BASE} + i in every system" if args.seeded else "unseeded"
    return f"sampled at temperature {args.temperature:g} (no top-k, top-p or min-p), {seeds}"
