"""``python -m hetspec.bench.parallel_clients`` (``hetspec bench --clients``): clients at once.

For each client count N of ``--clients``, N clients send the held-back prompts of ``hetspec
bench`` (``--prompts`` code prompts and the chat prompts: 8 requests per run in all by
default, shared among the clients: client i sends prompts i, i + N, i + 2N, ..., each once the
reply to the one before it has come) to each system, the clients starting together:

- ``hetspec max_parallel=N``: hetspecd decoding up to N requests together. At N = 1, the
  largest N of ``--clients`` (4 when that is 1): one client of a daemon set up for several;
- ``hetspec one at a time``: hetspecd at max_parallel 1 (one request decodes, the others wait
  in its FIFO), the same N clients;
- ``llama-server -np N``: llama.cpp's server with N slots (continuous batching, a context of
  ``SLOT_CONTEXT`` tokens a slot), the target alone and with its speculative decoding at the
  best draft length and p-min of ``llama_server_peers``' sweep (and its flash attention
  choice), measured once with one slot and reused at every N.

Every request generates exactly ``--max-tokens`` tokens (end tokens ignored, as in ``hetspec
bench``), greedily, streamed, each on a connection of its own; every time is the client's
own. Each hetspecd starts afresh for each client count and first serves every prompt alone
(one client), so that every daemon's controller has seen the same requests before its passes.
Before each run every client sends a two-token request of another prompt, so that no slot
or sequence keeps a prefix of the bench's prompts. The passes (``--repeats``) take turns system
by system, the order rotating. Per row: aggregate tokens/s (all of a run's tokens over its wall
time, from the first request sent to the last reply; the median of the passes, and their
range); over every request of every pass: per-request decode tokens/s (the tokens after the
first over the time from the first to the last; median), latency p50 and p99 (request sent to
its last token), TTFT p50 (sent to the first token, waiting in a queue included); "tokens =
alone": the requests whose token ids equal their prompt's run alone, run before the passes
(one client; hetspec's rows: hetspecd one at a time; llama-server's: one slot, the target
alone). Ratios are of this run's medians. A system that cannot be had (no llama-server, a
hetspecd without ``max_parallel``, a server that will not start) is a row that says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import httpx

from hetspec.arguments import positive, positive_list, setting
from hetspec.bench.busy_box import busy_note
from hetspec.bench.library_peers import WARMUP_PROMPT
from hetspec.bench.llama_server import (
    LlamaServer,
    LlamaServerError,
    LlamaServerUnavailable,
    ServerConfig,
    completion_request,
    find_llama_server,
)
from hetspec.bench.llama_server_peers import ServerPool, llama_server_peers
from hetspec.bench.measure import daemon
from hetspec.bench.targets import BenchTarget, TargetError, resolve
from hetspec.client.types import Address, HetspecError, StreamParser, generate_body
from hetspec.models.corpus import FORGET_PROMPT, prompt_set

SLOT_CONTEXT = 2048  # llama-server's context a slot: the longest prompt and its tokens fit
ONE_AT_A_TIME = "hetspec one at a time"
GOAL_CLIENTS = 4  # the client count of #72's goals on the CPU (8 on a GPU)
DEFAULT_TARGETS = "smollm2,smollm2-360m,heavy-300m"
# every request on a connection of its own, in every system: llama-server (cpp-httplib) at
# times closes a kept-alive connection as the next streamed request goes out on it, which
# httpx reports as "Server disconnected without sending a response"
ONE_REQUEST = {"Connection": "close"}


@dataclass
class Request:
    """One request as its client saw it: the token ids and when they came (monotonic s)."""

    prompt: int
    tokens: list[int]
    sent_s: float
    first_s: float
    done_s: float
    drafted: int = 0
    accepted: int = 0

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.sent_s) * 1000

    @property
    def ttft_ms(self) -> float:
        return (self.first_s - self.sent_s) * 1000

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after the first over the time from the first to the last."""
        spent = self.done_s - self.first_s
        return (len(self.tokens) - 1) / spent if spent > 0 else 0.0


@dataclass
class Run:
    """One pass of one system at one client count: every prompt once (or why it failed)."""

    system: str
    clients: int
    repeat: int
    requests: list[Request] = field(default_factory=list)
    error: str = ""

    @property
    def wall_s(self) -> float:
        """From the first request sent to the last reply."""
        return max(r.done_s for r in self.requests) - min(r.sent_s for r in self.requests)

    @property
    def aggregate_tokens_per_s(self) -> float:
        return sum(len(r.tokens) for r in self.requests) / self.wall_s


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name where it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class RequestFailed(RuntimeError):
    """A request the system refused or broke off; one line why."""


class Session(Protocol):
    """One client's connection to a system; used by one thread at a time."""

    def send(self, prompt: str, max_tokens: int, index: int) -> Request:
        """``prompt`` completed greedily with exactly ``max_tokens`` tokens, streamed."""
        ...

    def close(self) -> None: ...


class HetspecSession:
    """A client of hetspecd's /api/generate (Ollama's), streamed as NDJSON."""

    def __init__(self, address: Address) -> None:
        transport = httpx.HTTPTransport(uds=address.socket) if address.socket else None
        self.http = httpx.Client(
            base_url=address.base_url, transport=transport, headers=ONE_REQUEST, timeout=600
        )

    def send(self, prompt: str, max_tokens: int, index: int) -> Request:
        options = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        body = generate_body(prompt, options, True)
        parser, first = StreamParser(sse=False), None
        sent = time.monotonic()
        with self.http.stream("POST", "/api/generate", json=body) as response:
            if response.status_code != 200:
                said = response.read().decode(errors="replace")[:300]
                raise RequestFailed(f"hetspecd answered {response.status_code}: {said}")
            for line in response.iter_lines():
                parser.feed(line)
                if first is None and line.strip() and parser.completion is None:
                    first = time.monotonic()
        done = parser.completion
        if done is None:
            raise RequestFailed("hetspecd's stream ended without its final object")
        timings = done.timings
        return Request(
            index,
            list(done.tokens),
            sent,
            first or time.monotonic(),
            time.monotonic(),
            timings.get("draft_n", 0),
            timings.get("draft_n_accepted", 0),
        )

    def close(self) -> None:
        self.http.close()


class LlamaServerSession:
    """A client of llama-server's /completion, streamed as server-sent events."""

    def __init__(self, socket: Path) -> None:
        transport = httpx.HTTPTransport(uds=str(socket))
        self.http = httpx.Client(
            base_url="http://llama-server", transport=transport, headers=ONE_REQUEST, timeout=600
        )

    def send(self, prompt: str, max_tokens: int, index: int) -> Request:
        body = completion_request(prompt, max_tokens) | {"stream": True}
        tokens: list[int] = []
        first, timings = None, None
        sent = time.monotonic()
        with self.http.stream("POST", "/completion", json=body) as response:
            if response.status_code != 200:
                said = response.read().decode(errors="replace")[:300]
                raise RequestFailed(f"llama-server answered {response.status_code}: {said}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("tokens") and first is None:
                    first = time.monotonic()
                tokens += chunk.get("tokens") or []
                if chunk.get("stop"):
                    timings = chunk.get("timings") or {}
        if timings is None:
            raise RequestFailed("llama-server's stream ended before its last chunk")
        return Request(
            index,
            tokens,
            sent,
            first or time.monotonic(),
            time.monotonic(),
            int(timings.get("draft_n", 0)),
            int(timings.get("draft_n_accepted", 0)),
        )

    def close(self) -> None:
        self.http.close()


@dataclass
class System:
    """One row's system: ``session`` opens a new client connection to it."""

    name: str
    session: Callable[[], Session]


def shares(requests: int, clients: int) -> list[list[int]]:
    """Which prompts each client sends, in order: client i sends i, i + clients, ..."""
    return [list(range(i, requests, clients)) for i in range(clients)]


def fire(system: System, prompts: list[str], clients: int, max_tokens: int) -> Run:
    """``clients`` threads, each with a session of its own, start together and send their
    share of ``prompts`` one after the other; the run holds every reply, or the first error
    (a run with an error holds no requests)."""
    run = Run(system.name, clients, -1)
    barrier = threading.Barrier(clients)
    errors: list[str] = []
    lock = threading.Lock()

    def client(share: list[int]) -> None:
        session = None
        try:
            session = system.session()
            barrier.wait()
            for index in share:
                request = session.send(prompts[index], max_tokens, index)
                with lock:
                    run.requests.append(request)
        except threading.BrokenBarrierError:
            pass  # another client failed first and said why
        except Exception as error:  # the row says what failed, not a traceback
            errors.append(f"{type(error).__name__}: {first_line(error)}")
            barrier.abort()
        finally:
            if session is not None:
                session.close()

    threads = [threading.Thread(target=client, args=(s,)) for s in shares(len(prompts), clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        run.requests, run.error = [], errors[0]
    else:
        short = [r for r in run.requests if len(r.tokens) != max_tokens]
        if short:
            run.requests, run.error = [], f"a reply of {len(short[0].tokens)} tokens"
    return run


def forget(system: System, clients: int) -> None:
    """Every client at once: two tokens of another prompt, so that the next run's prompts are
    prefilled in full wherever a sequence or slot would keep a prefix."""
    fire(system, [FORGET_PROMPT] * clients, clients, 2)


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (0..1) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    place = share * (len(ordered) - 1)
    low = int(place)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (place - low)


def summary(runs: list[Run], alone: dict[int, list[int]] | None) -> dict:
    """One row's figures from its passes (see the module's docstring); ``error`` where a pass
    failed. ``alone``: every prompt's tokens alone (None: not known, nothing compared)."""
    failed = [r.error for r in runs if r.error]
    if failed:
        return {"error": f"failed: {failed[0]}"}
    aggregates = [r.aggregate_tokens_per_s for r in runs]
    requests = [q for r in runs for q in r.requests]
    latencies = [q.latency_ms for q in requests]
    return {
        "aggregate_tokens_per_s": statistics.median(aggregates),
        "aggregate_range": (min(aggregates), max(aggregates)),
        "decode_tokens_per_s": statistics.median(q.decode_tokens_per_s for q in requests),
        "latency_p50_ms": statistics.median(latencies),
        "latency_p99_ms": percentile(latencies, 0.99),
        "ttft_p50_ms": statistics.median(q.ttft_ms for q in requests),
        "same_as_alone": None
        if alone is None
        else (sum(q.tokens == alone.get(q.prompt) for q in requests), len(requests)),
        "drafted": sum(q.drafted for q in requests),
        "accepted": sum(q.accepted for q in requests),
        "passes": len(runs),
    }


def table_row(clients: int, system: str, figures: dict) -> str:
    if "error" in figures:
        return f"| {clients} | {system} | {figures['error']} | - | - | - | - | - | - |"
    low, high = figures["aggregate_range"]
    same = "/".join(map(str, figures["same_as_alone"] or ())) or "-"
    drafted = figures["drafted"]
    share = f"{figures['accepted']}/{drafted}" if drafted else "-"
    return (
        f"| {clients} | {system} | {figures['aggregate_tokens_per_s']:.1f} ({low:.1f}-{high:.1f})"
        f" | {figures['decode_tokens_per_s']:.1f} | {figures['latency_p50_ms']:.0f} | "
        f"{figures['latency_p99_ms']:.0f} | {figures['ttft_p50_ms']:.0f} | {same} | "
        f"{share} |"
    )


TABLE_HEAD = [
    "| clients | system | aggregate tok/s (median; min-max) | per-request decode tok/s (p50) "
    "| latency p50 ms | latency p99 ms | TTFT p50 ms | tokens = alone | accepted / drafted |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
]


def table(rows: dict[tuple[int, str], dict]) -> list[str]:
    """The markdown table of every (clients, system) row, in the order measured."""
    return TABLE_HEAD + [table_row(n, system, figures) for (n, system), figures in rows.items()]


def _figure(rows: dict, clients: int, prefix: str, key: str) -> float | None:
    """``key`` of the first measured row at ``clients`` whose system starts with ``prefix``."""
    for (n, system), figures in rows.items():
        if n == clients and system.startswith(prefix) and key in figures:
            return figures[key]
    return None


def _ratio(mine: float | None, theirs: float | None) -> str:
    return f"{mine / theirs:.2f}x" if mine and theirs else "not measured"


def goals(rows: dict[tuple[int, str], dict]) -> list[str]:
    """#72's goals, each as this run's ratio of medians (or "not measured")."""
    aggregate = "aggregate_tokens_per_s"
    batched, speculative = "hetspec max_parallel=", "llama-server -np {n} speculative"
    lines = []
    for n in (GOAL_CLIENTS, 8):
        mine = _figure(rows, n, batched, aggregate)
        peer = _figure(rows, n, speculative.format(n=n), aggregate)
        versus_peer = (
            f"llama-server -np {n} with its best speculative decoding {_ratio(mine, peer)}"
        )
        if n == GOAL_CLIENTS:
            own = _figure(rows, n, ONE_AT_A_TIME, aggregate)
            lines.append(
                f"- {n} clients, aggregate against hetspec one at a time: {_ratio(mine, own)} "
                f"(goal >= 1.6x); against {versus_peer} (goal >= 2.5x)"
            )
            p50 = [_figure(rows, n, s, "latency_p50_ms") for s in (batched, ONE_AT_A_TIME)]
            lines.append(
                f"- {n} clients, latency p50 against hetspec one at a time's: {_ratio(*p50)} "
                "(goal <= 0.75x)"
            )
        else:
            lines.append(f"- {n} clients, aggregate against {versus_peer} (goal on a GPU >= 1.5x)")
    lone = [_figure(rows, 1, s, aggregate) for s in (batched, ONE_AT_A_TIME)]
    lines.append(
        f"- 1 client, aggregate against hetspec one at a time: {_ratio(*lone)} (goal >= 0.98x)"
    )
    same, count = _same_as_alone(rows, "hetspec")
    lines.append(f"- tokens of every hetspec request = its run alone: {same}/{count} (goal: all)")
    same, count = _same_as_alone(rows, "llama-server")
    if count:
        lines.append(f"- llama-server's tokens = its own run alone: {same}/{count} (no goal)")
    return lines


def _same_as_alone(rows: dict[tuple[int, str], dict], prefix: str) -> tuple[int, int]:
    """Requests of the measured rows whose system starts with ``prefix``: equal to their run
    alone, and compared."""
    pairs = [f.get("same_as_alone") for (_, s), f in rows.items() if s.startswith(prefix)]
    pairs = [pair for pair in pairs if pair]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def daemon_knows_max_parallel() -> bool:
    """Whether this hetspecd has the setting ``max_parallel`` (#72); without it, it decodes
    one request at a time and refuses the key."""
    from hetspec.daemon.config import DaemonConfig  # noqa: PLC0415 - the daemon's, not ours

    return "max_parallel" in DaemonConfig.__struct_fields__


def lone_max_parallel(counts: list[int]) -> int:
    """The max_parallel of the batched daemon at one client: the largest client count (4 when
    that is 1)."""
    return max(counts) if max(counts) > 1 else GOAL_CLIENTS


@dataclass
class Plan:
    """What the bench measures: client counts, prompts, tokens, passes, the daemons'
    settings, and the llama-server binary (or why there is none)."""

    clients: list[int]
    prompts: list[str]
    max_tokens: int
    repeats: int
    settings: list[str]
    log_dir: Path
    binary: Path | None
    no_binary: str = ""


class Hetspecds:
    """hetspecd processes by max_parallel (None: a daemon without the setting), started on
    first use, each stopped by ``stop`` or ``close``."""

    def __init__(self, plan: Plan, target: BenchTarget) -> None:
        self.plan, self.target = plan, target
        self.stack: dict[int | None, contextlib.ExitStack] = {}
        self.systems: dict[int | None, System] = {}
        self.starts = 0

    def get(
        self, max_parallel: int | None, name: str, warm: Callable[[System], None] | None = None
    ) -> System:
        """The daemon at ``max_parallel`` as the system ``name``, started (and waited for)
        unless it runs, then ``warm``ed; ``HetspecError`` if it will not start."""
        if max_parallel not in self.systems:
            self.starts += 1
            stack = contextlib.ExitStack()
            self.stack[max_parallel] = stack
            settings = list(self.plan.settings)
            if max_parallel is not None:
                settings.append(f"max_parallel={max_parallel}")
            label = f"{self.target.name}-{self.starts}-max-parallel-{max_parallel or 'unset'}"
            client = stack.enter_context(
                daemon(
                    "draft-cpu", None, self.plan.log_dir, self.target, settings=settings, name=label
                )
            )
            address = client.address
            self.systems[max_parallel] = System(name, lambda: HetspecSession(address))
            if warm is not None:
                warm(self.systems[max_parallel])
        return replace(self.systems[max_parallel], name=name)

    def stop(self, max_parallel: int | None) -> None:
        self.systems.pop(max_parallel, None)
        stack = self.stack.pop(max_parallel, None)
        if stack is not None:
            stack.close()

    def close(self) -> None:
        for max_parallel in list(self.stack):
            self.stop(max_parallel)


def tune_llama_server(plan: Plan, target: BenchTarget, say) -> tuple[dict, dict, str]:
    """llama-server's one-slot configurations by row kind ("target alone", "speculative"),
    the sweep's figures, and why there are none (""), by ``llama_server_peers``."""
    if plan.binary is None:
        return {}, {}, plan.no_binary
    threads = len(os.sched_getaffinity(0))
    skipped: dict[str, str] = {}
    info: dict = {}
    pool = ServerPool(plan.binary, 1)
    say(f"{target.name}: llama-server's flash attention and draft length (one slot)")
    try:
        peers = llama_server_peers(
            pool, threads, target.target.gguf, target.draft.gguf, skipped=skipped, info=info
        )
    except LlamaServerError as error:
        return {}, info, first_line(error)
    finally:
        pool.close()
    configs = {"target alone": peers[0].config}
    best = [p for p in peers if p.name.startswith("llama-server speculative n-max=")]
    if best:
        configs["speculative"] = best[0].config
    return configs, info, "; ".join(skipped.values())


def llama_server_rows(configs: dict, clients: int) -> dict[str, ServerConfig]:
    """The row names and configurations of llama-server with ``clients`` slots."""
    rows = {}
    for kind, config in configs.items():
        name = f"llama-server -np {clients} {kind}"
        if config.draft is not None:
            name += f" n-max={config.n_max} p-min={config.p_min}"
        rows[name] = replace(config, parallel=clients, context=SLOT_CONTEXT * clients)
    return rows


@contextlib.contextmanager
def llama_servers(plan: Plan, configs: dict[str, ServerConfig], out: dict) -> Iterator[dict]:
    """The systems of ``configs`` started (stopped on leaving); a server that will not start
    is put in ``out`` as its row's error."""
    started: dict[str, LlamaServer] = {}
    try:
        for name, config in configs.items():
            try:
                started[name] = LlamaServer(plan.binary, config)
            except LlamaServerError as error:
                out[name] = {"error": f"failed: {first_line(error)}"}
        yield {
            name: System(name, lambda socket=server.socket: LlamaServerSession(socket))
            for name, server in started.items()
        }
    finally:
        for server in started.values():
            server.close()


def passes(systems: dict[str, System], clients: int, plan: Plan, say) -> dict[str, list[Run]]:
    """Every system ``plan.repeats`` times at ``clients`` clients after a warm-up, the systems
    taking turns, the order rotating each pass."""
    for system in systems.values():
        fire(system, [WARMUP_PROMPT] * clients, clients, 8)
    runs: dict[str, list[Run]] = {name: [] for name in systems}
    names = list(systems)
    for repeat in range(plan.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            forget(systems[name], clients)
            run = fire(systems[name], plan.prompts, clients, plan.max_tokens)
            run.repeat = repeat
            runs[name].append(run)
        say(f"  {clients} clients: pass {repeat + 1}/{plan.repeats} done")
    return runs


class TargetBench:
    """One target's rows: its llama-server configurations (tuned once, one slot), its
    hetspecds, and every prompt's tokens alone (the reference of "tokens = alone")."""

    def __init__(self, plan: Plan, target: BenchTarget, say) -> None:
        self.plan, self.target, self.say = plan, target, say
        self.configs, self.info, self.no_peer = tune_llama_server(plan, target, say)
        self.batched = daemon_knows_max_parallel()
        self.hetspecds = Hetspecds(plan, target)
        self.alone: dict[int, list[int]] = {}
        self.peer_alone: dict[int, list[int]] | None = None

    def one_at_a_time(self) -> System:
        return self.hetspecds.get(1 if self.batched else None, ONE_AT_A_TIME, self.warm)

    def warm(self, system: System) -> None:
        """A hetspecd just started serves every prompt alone first, as the first one did for
        the reference: each daemon's controller has then seen the same requests before its
        passes (one that had not drafted colder, and compared worse than it is)."""
        if self.alone:
            self.tokens_alone(system)

    def measure(self) -> tuple[list[str], dict]:
        """The target's section of the report (markdown lines) and its JSON: every row."""
        rows: dict[tuple[int, str], dict] = {}
        runs: list[Run] = []
        try:
            self.say(f"{self.target.name}: every prompt alone (one client)")
            self.alone = self.tokens_alone(self.one_at_a_time())
            if self.alone is None:
                raise HetspecError("hetspecd failed the prompts alone (one client)")
            self.peer_alone = self.llama_server_alone()
            for clients in self.plan.clients:
                self.say(f"{self.target.name}: {clients} clients")
                for name, outcome in self.rows_at(clients).items():
                    if isinstance(outcome, list):
                        runs += outcome
                        peer = name.startswith("llama-server")
                        alone = self.peer_alone if peer else self.alone
                        rows[clients, name] = summary(outcome, alone)
                    else:
                        rows[clients, name] = outcome
        finally:
            self.hetspecds.close()
        section = [f"## {self.target.name}\n", self.settings_line(), "", *table(rows), ""]
        section += ["Goals (#72), ratios of this run's medians:\n", *goals(rows)]
        document = {
            "target": self.target.name,
            "llama_server": self.info,
            "rows": [{"clients": n, "system": s, **f} for (n, s), f in rows.items()],
            "runs": [asdict(r) for r in runs],
        }
        return section, document

    def tokens_alone(self, system: System) -> dict[int, list[int]] | None:
        """Every prompt's tokens from ``system`` with one client, after a warm-up (None:
        a request failed)."""
        fire(system, [WARMUP_PROMPT], 1, 8)
        reference = fire(system, self.plan.prompts, 1, self.plan.max_tokens)
        return None if reference.error else {r.prompt: r.tokens for r in reference.requests}

    def llama_server_alone(self) -> dict[int, list[int]] | None:
        """Every prompt's tokens from llama-server with one slot, the target alone (None:
        no llama-server, or it failed)."""
        if not self.configs:
            return None
        one = llama_server_rows({"target alone": self.configs["target alone"]}, 1)
        with llama_servers(self.plan, one, {}) as servers:
            return next((self.tokens_alone(s) for s in servers.values()), None)

    def rows_at(self, clients: int) -> dict:
        """Every row at ``clients``, in the table's order: its runs (a list), or a stand-in
        for its figures (a dict with ``error``: why it was not measured)."""
        out: dict = {}
        systems: dict[str, System] = {}
        max_parallel = clients if clients > 1 else lone_max_parallel(self.plan.clients)
        name = f"hetspec max_parallel={max_parallel}"
        if not self.batched:
            out[name] = {"error": "skipped: this hetspecd has no max_parallel (one at a time)"}
        else:
            try:
                systems[name] = self.hetspecds.get(max_parallel, name, self.warm)
            except HetspecError as error:
                out[name] = {"error": f"failed: {first_line(error)}"}
        systems[ONE_AT_A_TIME] = self.one_at_a_time()
        peers = llama_server_rows(self.configs, clients)
        order = [name, ONE_AT_A_TIME, *peers]
        if not self.configs:
            order.append(f"llama-server -np {clients}")
            out[order[-1]] = {"error": f"skipped: {self.no_peer}"}
        elif "speculative" not in self.configs:
            order.append(f"llama-server -np {clients} speculative")
            why = self.no_peer or "no draft length of the sweep ran"
            out[order[-1]] = {"error": f"skipped: {why}"}
        with llama_servers(self.plan, peers, out) as servers:
            out |= passes(systems | servers, clients, self.plan, self.say)
        # each client count's daemons start afresh (and warm alike): none carries more
        # history into the next than the other
        self.hetspecds.close()
        return {row: out[row] for row in order if row in out}

    def settings_line(self) -> str:
        target, info = self.target, self.info
        line = f"Target {target.target.gguf.name}, draft {target.draft.gguf.name}."
        if self.configs:
            flash = info.get("flash_attention", {}).get("chosen")
            line += (
                " llama-server tuned with one slot and used so at every -np: flash attention "
                f"{flash}, decode tok/s by draft length {info.get('sweep')}, by p-min at the "
                f"best length {info.get('sweep_p_min')}."
            )
        return line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--clients",
        type=positive_list,
        metavar="N,N,...",
        default=[1, 2, 4, 8],
        help="comma-separated client counts (default 1,2,4,8)",
    )
    parser.add_argument(
        "--target",
        type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
        default=DEFAULT_TARGETS.split(","),
        help="comma-separated targets as hetspec bench names them (bundled, heavy-300m, "
        f"smollm2, smollm2-360m, a model folder or GGUF) (default {DEFAULT_TARGETS})",
    )
    parser.add_argument("--draft", help="the draft for every target (default: the target's own)")
    parser.add_argument(
        "--prompts",
        type=positive,
        default=4,
        help="held-out code prompts; the 4 chat prompts are always added, and each run sends "
        "every prompt once, shared among the clients (default 4: 8 requests a run)",
    )
    parser.add_argument(
        "--max-tokens", type=positive, default=64, help="tokens a request (default 64)"
    )
    parser.add_argument("--repeats", type=positive, default=3, help="passes (default 3)")
    parser.add_argument(
        "--llama-server",
        default="build",
        help="llama.cpp's server as the peer: a path to the binary, 'build' (the cached build, "
        "made on first use; the default) or 'off'",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        metavar="KEY=VALUE",
        type=setting,
        action="append",
        default=[],
        help="a setting of every hetspecd the bench starts (hetspecd's --set); repeatable",
    )
    parser.add_argument("--json", type=Path, help="write every row and request here")
    parser.add_argument(
        "--logs", type=Path, help="folder for the daemons' logs (default: a temporary one)"
    )


def llama_server_binary(choice: str) -> tuple[Path | None, str]:
    """The binary ``--llama-server`` names, or None and one line why there is none."""
    if choice == "off":
        return None, "llama-server turned off (--llama-server off)"
    try:
        if choice == "build":
            return find_llama_server(True, progress=sys.stderr), ""
        binary = Path(choice).expanduser()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise LlamaServerUnavailable(f"no llama-server at {binary}")
        return binary, ""
    except LlamaServerUnavailable as error:
        return None, f"no llama-server: {error}"


def main(
    argv: list[str] | None = None, prog: str = "python -m hetspec.bench.parallel_clients"
) -> int:
    description = __doc__.split("\n\n")[0].replace("``", "")
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    prompts = prompt_set(args.prompts)
    if max(args.clients) > len(prompts):
        parser.error(f"{max(args.clients)} clients but {len(prompts)} requests a run")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="hetspec-bench-clients-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    binary, no_binary = llama_server_binary(args.llama_server)
    plan = Plan(
        args.clients,
        prompts,
        args.max_tokens,
        args.repeats,
        args.settings,
        log_dir,
        binary,
        no_binary,
    )
    report = _head(prog, args, argv, plan)
    documents = []
    for spec in args.target:
        try:
            target = resolve(spec, args.draft)
            section, document = TargetBench(plan, target, say).measure()
        except (TargetError, HetspecError) as error:
            say(f"skipping {spec}: {error}")
            section, document = [f"## {spec}: skipped\n", first_line(error)], {}
        report += [*section, ""]
        documents.append(document)
    print("\n".join(report))
    if args.json:
        args.json.write_text(json.dumps({"report": report, "targets": documents}))
    return 0


def _head(prog: str, args, argv, plan: Plan) -> list[str]:
    given = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# Several clients at once ({time.strftime('%Y-%m-%d %H:%M')})\n",
        f"`{prog} {given}` on {os.cpu_count()} CPUs: "
        f"{len(plan.prompts)} requests a run ({args.prompts} held-out code prompts and the "
        f"chat prompts) shared among the clients, {plan.max_tokens} tokens each (end tokens "
        f"ignored), greedy, {plan.repeats} pass{'' if plan.repeats == 1 else 'es'}; "
        f"hetspecd's logs in {plan.log_dir}.",
        f"At 1 client the batched row is max_parallel={lone_max_parallel(plan.clients)}. "
        "p99 is interpolated over every request of every pass.",
    ]
    if note := busy_note():
        lines.append(f"\nWarning: {note}.")
    if not daemon_knows_max_parallel():
        lines.append("\nThis hetspecd has no max_parallel: it decodes one request at a time.")
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
