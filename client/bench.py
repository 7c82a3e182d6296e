"""``hetspec bench``: the decoding modes side by side on one daemon, and the controller under load.

    hetspec bench [--placement draft-cpu,draft-gpu] [--gammas 2,4,6] [--out bench-results]

For each placement it starts its own ``hetspecd`` on the bundled models (or uses ``--socket``),
then:

1. Modes: a fixed prompt set (held-out standard-library files cut at function starts, plus a few
   chat prompts) through every system: autoregressive (the target alone), sequential,
   parallel at each fixed gamma, and adaptive; and the peers (transformers' assisted
   generation, llama.cpp-only speculative decoding: ``hetspec.workers.peers``, a process of
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
ignored) so that every system decodes the same amount.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hetspec.client.clients import Client
from hetspec.client.types import Completion, HetspecError
from hetspec.models.corpus import stdlib_sources

CHAT_PROMPTS = [
    "Write a function that returns the n-th Fibonacci number.",
    "Write a function that reads a file and returns its lines without trailing whitespace.",
    "Write a function that merges two sorted lists.",
    "Write a function that checks whether a string is a palindrome.",
]
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
FORGET_PROMPT = "# -*- coding: utf-8 -*-\n"  # shares no prefix with the prompts that matter


def code_prompts(count: int, context_lines: int = 30) -> list[str]:
    """The first substantial function of each held-out file, cut after its signature (and its
    docstring, which says what to write), with up to ``context_lines`` lines before it."""
    prompts = []
    for path, text in stdlib_sources()[1]:
        if path.startswith(("encodings/", "idlelib/")):  # codec tables, GUI glue: untypical
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(node.body) >= 3:
                first = node.body[0]
                has_docstring = isinstance(first, ast.Expr) and isinstance(
                    getattr(first, "value", None), ast.Constant
                )
                end = first.end_lineno if has_docstring else first.lineno - 1
                start = max(0, node.lineno - 1 - context_lines)
                prompts.append("\n".join(lines[start:end]) + "\n")
                break
        if len(prompts) == count:
            break
    return prompts


def prompt_set(code: int) -> list[str]:
    return code_prompts(code) + [CHAT.format(prompt) for prompt in CHAT_PROMPTS]


@dataclass(frozen=True)
class System:
    name: str
    options: dict
    peer: Peers | None = None  # a peer system, run by that process instead of the daemon

    @property
    def overlapped(self) -> bool:
        return self.options.get("mode") in ("parallel", "adaptive")


class Peers:
    """The peer systems' process (``hetspec.workers.peers``), asked one request at a time so
    that their requests interleave with hetspec's."""

    def __init__(self, log: Path) -> None:
        # its stderr goes to a file: a pipe nobody reads would fill with warnings and stall it
        self.log = log
        command = [sys.executable, "-m", "hetspec.workers.peers"]
        with log.open("w") as errors:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
            )
        self.systems = [System(name, {}, self) for name in self._reply()["systems"]]

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

    def record(self, system: str, prompt: str, index: int, repeat: int, max_tokens: int):
        request = {"system": system, "prompt": prompt, "max_tokens": max_tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        row = self._reply()
        return Record(system, index, repeat, False, row["tokens"], row["decode_ms"],
                      row["ttft_ms"])  # fmt: skip

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
    gammas: list[int] = field(default_factory=list)
    by_depth: list[int] = field(default_factory=list)  # rounds accepting >= depth 1, 2, ...

    @classmethod
    def of(cls, system: str, prompt: int, repeat: int, loaded: bool, done: Completion) -> Record:
        timings, spec = done.timings, done.speculative or {}
        gammas = spec.get("gamma_history", [])
        return cls(
            system, prompt, repeat, loaded, timings["predicted_n"], timings["predicted_ms"],
            timings["ttft_ms"], spec.get("rounds", 0), timings.get("draft_n_accepted", 0),
            statistics.fmean(gammas) if gammas else 0.0, spec.get("t_draft_ms"),
            spec.get("t_verify_ms"), spec.get("run_ahead", 0), gammas,
            spec.get("acceptance_by_depth", []),
        )  # fmt: skip

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


def summarise(records: list[Record]) -> dict:
    """Per repeat: all tokens over all decode time (each prompt weighs its length); then the
    median over repeats. TTFT: median over requests."""
    by_repeat: dict[int, list[Record]] = {}
    for record in records:
        by_repeat.setdefault(record.repeat, []).append(record)
    rates = [sum(r.decoded for r in rs) / sum(r.decode_ms for r in rs) * 1000
             for rs in by_repeat.values()]  # fmt: skip
    rounds = sum(r.rounds for r in records)
    ideal = [r.tokens_per_s / r.ideal_tokens_per_s for r in records if r.ideal_tokens_per_s]
    return {
        "tokens_per_s": statistics.median(rates),
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
def daemon(placement: str, socket: str | None, log_dir: Path) -> Iterator[Client]:
    """A ready daemon: the one at ``socket``, or a fresh ``hetspecd`` on the bundled models."""
    if socket:
        client = Client(socket)
        client.wait_ready(10)
        yield client
        return
    run = Path(tempfile.mkdtemp(prefix="hetspec-bench-"))
    log = (log_dir / f"hetspecd-{placement}.log").open("w")
    hetspecd = Path(sys.executable).with_name("hetspecd")
    command = [str(hetspecd), "--socket", str(run / "hetspecd.sock"),
               "--runtime-dir", str(run / "run"),
               "--placement", placement.removesuffix("-llama")]  # fmt: skip
    if placement.endswith("-llama"):  # both workers in llama.cpp
        command += ["--set", 'gpu_runtime="llama.cpp"']
    process = subprocess.Popen(command, stderr=log)
    try:
        client = Client(f"unix://{run / 'hetspecd.sock'}")
        client.wait_ready(300)
        yield client
    finally:
        process.terminate()
        process.wait(60)
        log.close()


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


def run_requests(client, plan, prompts, options, *, repeats, loaded_from=None, busy=None):
    """Every (system, prompt) ``repeats`` times, interleaved; returns the records."""
    records = []
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            loaded = loaded_from is not None and index >= loaded_from
            if busy is not None:
                busy.start() if loaded else busy.stop()
            shift = index + repeat
            for system in plan[shift % len(plan) :] + plan[: shift % len(plan)]:
                if system.peer is not None:
                    records.append(system.peer.record(system.name, prompt, index, repeat,
                                                      options["max_tokens"]))  # fmt: skip
                    continue
                forget_prompt(client)
                done = client.generate(prompt, **options, **system.options)
                records.append(Record.of(system.name, index, repeat, loaded, done))
        print(f"  repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
    if busy is not None:
        busy.stop()
    return records


def measure_modes(client: Client, placement: str, args, peers: Peers | None) -> list[Record]:
    prompts = prompt_set(args.prompts)
    plan = systems(args.gammas) + (peers.systems if peers else [])
    print(f"{placement}: warm-up", file=sys.stderr, flush=True)
    run_requests(client, plan, prompts[: args.warmup], request_options(args), repeats=1)
    print(f"{placement}: modes, {len(prompts)} prompts x {len(plan)} systems", file=sys.stderr)
    return run_requests(client, plan, prompts, request_options(args), repeats=args.repeats)


def measure_load(client: Client, placement: str, args) -> list[Record]:
    """The overlapped systems again, a busy process on the drafter's core from mid-run."""
    prompts = prompt_set(args.prompts)
    loaded_plan = [s for s in systems(args.gammas) if s.overlapped]
    busy = BusyCore(drafter_core(client, placement))
    print(f"{placement}: load on core {busy.core} from prompt {len(prompts) // 2}",
          file=sys.stderr)  # fmt: skip
    return run_requests(client, loaded_plan, prompts, request_options(args), repeats=1,
                        loaded_from=len(prompts) // 2, busy=busy)  # fmt: skip


def request_options(args) -> dict:
    return {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}


# ---------------------------------------------------------------- report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def modes_table(records: list[Record]) -> tuple[str, dict]:
    names = list(dict.fromkeys(r.system for r in records))
    summaries = {name: summarise([r for r in records if r.system == name]) for name in names}
    base = summaries["autoregressive"]
    sequential = summaries["sequential"]
    lines = [
        "| system | decode tokens/s | x autoregressive | x sequential | mean accepted | "
        "gamma | overlapped rounds | TTFT ms | x TTFT | efficiency |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {s['tokens_per_s']:.1f} | "
            f"{s['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{s['tokens_per_s'] / sequential['tokens_per_s']:.2f} | "
            f"{_fmt(s['mean_accepted'], '.2f')} | {_fmt(s['gamma_mean'], '.1f')} | "
            f"{_fmt(s['overlapped'], '.0%')} | {s['ttft_ms']:.2f} | "
            f"{s['ttft_ms'] / base['ttft_ms']:.2f} | "
            f"{_fmt(s['efficiency'], '.2f')} |"
        )
    return "\n".join(lines), summaries


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
    lines = ["| system | tokens/s before load | after | whole run | x best fixed |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
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
    figure, axes = plt.subplots(len(placements), 3, figsize=(18, 4 * len(placements)),
                                squeeze=False)  # fmt: skip
    for row, placement in enumerate(placements):
        summaries = results[placement]["summary"]
        names = list(summaries)
        axes[row][0].barh(names, [summaries[n]["tokens_per_s"] for n in names])
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
    """P(the first d drafted tokens are accepted) for d = 1..8, per speculative system."""
    depths = range(1, 9)
    for system in dict.fromkeys(r.system for r in records if r.rounds):
        mine = [r for r in records if r.system == system]
        rounds = sum(r.rounds for r in mine)
        reach = [sum(r.by_depth[d - 1] for r in mine if len(r.by_depth) >= d) / rounds
                 for d in depths]  # fmt: skip
        axis.plot(list(depths), reach, marker="o", label=system)
    axis.set_xlabel("draft position")
    axis.set_ylabel("share of rounds accepted up to it")
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
        f"{time.strftime('%Y-%m-%d %H:%M')}; {args.max_tokens} tokens per request.\n"
    ]
    try:
        with contextlib.ExitStack() as stack:
            peers = None
            if args.peers:
                print("peers: loading transformers and llama.cpp", file=sys.stderr, flush=True)
                peers = Peers(out / "peers.log")
                stack.callback(peers.close)
            _measure(args, out, peers, report, results)
    except HetspecError as error:
        print(f"hetspec bench: {error}", file=sys.stderr)
        return 1
    plotted = plot(out / "bench.png", results)
    print("\n".join(report))
    print(f"\nwritten: {out / 'bench.md'}, {out / 'bench.json'}"
          + (f", {out / 'bench.png'}" if plotted else " (no matplotlib: no plot)"))  # fmt: skip
    return 0


def _measure(args, out: Path, peers: Peers | None, report: list[str], results: dict) -> None:
    """Every placement's tables, the peers' requests among hetspec's in each."""
    for placement in args.placement:
        with daemon(placement, args.socket, out) as client:
            modes = measure_modes(client, placement, args, peers)
            table, summary = modes_table(modes)
            report += [f"## {placement}: modes\n", table, ""]
            results[placement] = {"summary": summary, "load_records": [], "records": modes}
            write_reports(out, report, results)  # a run cut short keeps what it measured
            print(table, file=sys.stderr, flush=True)
            if args.load:
                loaded = measure_load(client, placement, args)
                table, load = load_table(loaded)
                report += [f"## {placement}: a busy process on the drafter's core from "
                           "the middle of the prompt list\n", table, ""]  # fmt: skip
                results[placement] |= {"load": load, "load_records": loaded}
                write_reports(out, report, results)


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
        "--placement",
        type=lambda s: s.split(","),
        default=["draft-cpu"],
        help="comma-separated: draft-cpu, draft-gpu, draft-cpu-llama (DuoDecoding's, with "
        "the GPU worker in llama.cpp too: gpu_runtime) (default draft-cpu)",
    )
    parser.add_argument("--gammas", type=lambda s: [int(g) for g in s.split(",")],
                        default=[2, 4, 6], help="fixed gammas of the parallel rows")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=12, help="held-out code prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4, help="prompts run once first")
    parser.add_argument("--no-load", dest="load", action="store_false",
                        help="skip the busy-core run")  # fmt: skip
    parser.add_argument("--out", default="bench-results", help="folder for the reports")
    parser.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="skip transformers' assisted generation and llama.cpp-only speculative decoding",
    )
