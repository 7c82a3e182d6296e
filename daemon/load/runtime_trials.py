"""``gpu_runtime = "auto"``: the GPU worker's runtime chosen by measuring each one here.

At load, for every runtime that can hold the GPU worker's model on this box (torch, on CUDA
where present and on the CPU otherwise; llama.cpp, offloaded where built for a GPU; hetspec's
native CPU kernels, where they were built), a
process of its own loads the model as the worker would and times forwards of the widths a
verifier uses (``hetspec.workers.tools.profile``). The draft model's cost is measured the same
way. The runtime with the best expected decode rate wins (``speculative.runtime_choice``).
Profiles are cached per model file, settings, cores and box, so a restart reuses them; a
model file or a runtime that changed is measured again.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from hetspec import __version__
from hetspec.daemon.config import DaemonConfig
from hetspec.daemon.load.head_choice import draft_head_for
from hetspec.daemon.load.runtime_check import check_runtime
from hetspec.daemon.supervision.cores import cuda_present
from hetspec.daemon.supervision.supervisor import export_read_by, roles, worker_specs
from hetspec.daemon.supervision.worker_client import WorkerSpec
from hetspec.protocol import LlamaCppReport, ProbeFailure, RuntimeProfile, decode_profile
from hetspec.speculative.control.runtime_choice import (
    MODEL_FREE_ACCEPTANCE,
    PRIOR_ACCEPTANCE,
    Rate,
    best_rate,
    fastest,
    fastest_drafter,
    thread_counts,
)

log = structlog.get_logger("hetspec.daemon.load.runtime_trials")

CANDIDATES = ("llama.cpp", "native", "torch")
# The verifications the controller chooses from, around the native kernels' steps (one pass
# over the weights serves up to 8 rows; 5-7 leftover rows ride in a padded pass): the
# controller fits the rounds' measured costs to this profile's shape. Trees reach the widest
# a slot holds (gamma x branches, up to 64 nodes), where a CPU's verification is bound by its
# arithmetic, not the weights' bandwidth: 32 and 64 measure that slope rather than leaving it
# to the last segment's (16 -> 17: noise, often flat; docs/design-notes.md, "Verify cost").
VERIFY_WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 32, 64]
# On CUDA a verifier's forwards are 16 rows wide (the width-invariant default), so its cost
# climbs a forward at 17, 33 and 49 nodes: each step's both sides.
CUDA_VERIFY_WIDTHS = sorted({*VERIFY_WIDTHS, 33, 48, 49})
PREFIX_TOKENS = 128


class RuntimeDecision(msgspec.Struct, frozen=True, kw_only=True):
    """The GPU worker's runtime and why: the figures behind a measured choice."""

    runtime: str
    chosen_by: str  # "configuration" or "measurement"
    role: str = "verifier"  # what the GPU worker does in this placement
    profiles: list[RuntimeProfile] = []
    failures: list[ProbeFailure] = []  # candidates that could not load here
    draft_ms: float | None = None  # the drafter's cost per token, where it was measured
    rates: dict[str, float] = {}  # expected decode tokens/s per runtime
    gammas: dict[str, int] = {}  # the draft length each rate assumes (0: the target alone)
    cached: bool = False  # every profile came from the cache

    def verifier_costs_s(self) -> dict[int, float] | None:
        """The chosen runtime's forward costs as verifier ({width: seconds}), where they were
        measured (None: configured, or the GPU worker drafts)."""
        if self.role != "verifier":
            return None
        for profile in self.profiles:
            if profile.runtime == self.runtime:
                return {
                    w: ms / 1000 for w, ms in zip(profile.widths, profile.median_ms, strict=True)
                }
        return None

    def summary(self) -> str:
        """One line for the log and ``--check``."""
        if self.chosen_by == "configuration":
            return f"gpu_runtime {self.runtime} (configured)"
        if self.chosen_by.startswith("draft head"):
            return f"gpu_runtime torch, drafting with the {self.chosen_by}"
        if self.chosen_by.startswith("rpc.servers"):
            return f"gpu_runtime {self.runtime}, because of {self.chosen_by}"
        figures = ", ".join(
            f"{p.runtime} on {p.device}: "
            + " ".join(f"T({w})={ms:.2f}ms" for w, ms in zip(p.widths, p.median_ms, strict=True))
            + f" -> {self.rates[p.runtime]:.0f} tok/s (gamma {self.gammas[p.runtime]})"
            for p in self.profiles
        )
        failed = "".join(f"; {f.runtime} unusable: {f.message}" for f in self.failures)
        cached = " (cached profiles)" if self.cached else ""
        return f"gpu_runtime {self.runtime} (measured as {self.role}{cached}: {figures}{failed})"


class RuntimeChoiceError(RuntimeError):
    """No runtime could hold the model; the message says why each failed."""


def _file_identity(path: Path) -> list:
    """What changes when a model changes: size and modification time of its files."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    identity = []
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            continue
        identity.append([file.name, stat.st_size, stat.st_mtime_ns])
    return identity


def _native_kernels() -> list:
    """The built native kernels' identity: a rebuilt library (new kernels) is measured anew.
    Located through the import system, never imported (the daemon does not load them)."""
    spec = importlib.util.find_spec("hetspec.native")
    folders = spec.submodule_search_locations if spec is not None else None
    return [
        _file_identity(file)
        for folder in folders or []
        for file in sorted(Path(folder).glob("_hsnative*"))
    ]


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def profile_key(spec: WorkerSpec, widths: list[int]) -> str:
    """A digest of everything a profile depends on: model files, settings, cores, the box."""
    ingredients = {
        "hetspec": __version__,
        "runtime": spec.runtime,
        "model": str(Path(spec.model).resolve()),
        "files": _file_identity(Path(spec.model)),
        "settings": msgspec.json.encode(spec.settings).decode(),
        "cores": list(spec.cores),
        "spare_cores": list(spec.spare_cores),
        "widths": widths,
        "prefix": PREFIX_TOKENS,
        "box": [platform.machine(), _cpu_model(), os.path.exists("/dev/nvidia0")],
        "versions": [_package_version("llama_cpp_python"), _package_version("torch")],
        "native": _native_kernels() if spec.runtime == "native" else None,
    }
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()[:24]


async def measure(
    spec: WorkerSpec, widths: list[int], timeout_s: float, cache: Path | None
) -> tuple[RuntimeProfile | ProbeFailure, bool]:
    """The profile of ``spec``'s runtime and model (from the cache when there), and whether it
    came from the cache. A runtime that cannot load or hangs is a ``ProbeFailure``."""
    path = cache / "profiles" / f"{profile_key(spec, widths)}.json" if cache else None
    if path is not None:
        try:
            result = decode_profile(path.read_bytes())
            if isinstance(result, RuntimeProfile):
                return result, True
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass  # absent or unreadable: measure again
    command = [
        sys.executable,
        "-m",
        "hetspec.workers.tools.profile",
        spec.runtime,
        spec.model,
        "--settings",
        msgspec.json.encode(spec.settings).decode(),
        "--widths",
        ",".join(map(str, widths)),
        "--prefix",
        str(PREFIX_TOKENS),
        "--cores",
        ",".join(map(str, spec.cores)),
        # timed as the worker computes when the drafter idles (plain rounds' verification,
        # decoding alone): on the drafter's cores too, where it may borrow them
        "--spare-cores",
        ",".join(map(str, spec.spare_cores)),
    ]
    before = CpuClock.now()
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        return ProbeFailure(
            runtime=spec.runtime, message=f"profiling took more than {timeout_s:g} s"
        ), False
    except asyncio.CancelledError:  # the daemon stops while loading: leave no process behind
        process.kill()
        await process.wait()
        raise
    try:
        result = decode_profile(stdout.strip().splitlines()[-1])
    except (IndexError, msgspec.DecodeError, msgspec.ValidationError):
        said = (stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return ProbeFailure(
            runtime=spec.runtime, message=f"profiling exited with {process.returncode}: {said}"
        ), False
    others = CpuClock.now().others_cores_since(before)
    if path is not None and isinstance(result, RuntimeProfile):
        if others is not None and others > BUSY_CORES:  # a figure of this moment only
            log.warning(
                "runtime measured on a busy box: not cached, the next start measures again",
                runtime=spec.runtime,
                other_processes_cores=round(others, 2),
            )
        else:
            _store(path, msgspec.json.encode(result))
    return result, False


# Cores other processes may keep busy while a runtime is timed before its profile is too much
# of that moment to keep: four daemons started at once timed each other's loads (the native
# kernels at 4.4x their own time) and cached the wrong choice for good.
BUSY_CORES = 0.75


@dataclass(frozen=True)
class CpuClock:
    """The box's busy CPU time (all cores: user, nice, system, interrupts; not steal, which
    is the host's) and this process's and its reaped children's, at one moment."""

    wall_s: float
    box_busy_s: float | None  # None: no /proc/stat here
    ours_s: float

    @classmethod
    def now(cls) -> CpuClock:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
            busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            busy = None
        return cls(time.monotonic(), busy, ours)

    def others_cores_since(self, before: CpuClock) -> float | None:
        """Cores other processes kept busy on average since ``before`` (None: unknown)."""
        wall = self.wall_s - before.wall_s
        if self.box_busy_s is None or before.box_busy_s is None or wall <= 0:
            return None
        others = (self.box_busy_s - before.box_busy_s) - (self.ours_s - before.ours_s)
        return max(others, 0.0) / wall


def _store(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(data)
        temporary.replace(path)
    except OSError as error:  # a read-only cache only costs a measurement next time
        log.warning("cannot cache the runtime profile", path=str(path), error=str(error))


async def decide_gpu_runtime(
    config: DaemonConfig,
    log_format: str = "json",
    cache: Path | None = None,
    drafter: DrafterChoice | None = None,
) -> RuntimeDecision:
    """The GPU worker's runtime: "head" where a draft head drafts (see head_choice), else the
    configured one, or for ``"auto"`` the fastest measured, with the ``drafter`` decided (its
    measured cost, else it is timed here). Raises ``RuntimeChoiceError`` when no candidate can
    load the model, ``HeadChoiceError`` for a configured head that does not match the
    target."""
    if (head := draft_head_for(config)) is not None:
        return RuntimeDecision(runtime="head", chosen_by=f"draft head {head}", role="drafter")
    if config.gpu_runtime != "auto":
        return RuntimeDecision(runtime=config.gpu_runtime, chosen_by="configuration")
    role = "verifier" if roles(config.placement).verifier == "gpu" else "drafter"
    if role == "verifier" and config.rpc.servers:
        return RuntimeDecision(
            runtime="llama.cpp",
            chosen_by="rpc.servers (the target's layers on other hosts run through llama.cpp)",
        )
    timeout_s = config.load_timeout_s
    draft_ms = None
    cached = True
    if role == "verifier" and config.draft is not None:  # the drafter is the CPU worker
        draft_ms = drafter.draft_ms() if drafter is not None else None
        if draft_ms is None:
            spec = worker_specs(
                config,
                log_format,
                "llama.cpp",
                drafter.threads if drafter else None,
                drafter.runtime if drafter else None,
            )["cpu"]
            draft, hit = await measure(spec, [1], timeout_s, cache)
            cached &= hit
            if isinstance(draft, RuntimeProfile):
                draft_ms = draft.median_ms[0]
    cuda = cuda_present(config.gpu_worker.device)
    widths = (CUDA_VERIFY_WIDTHS if cuda else VERIFY_WIDTHS) if role == "verifier" else [1]
    profiles, failures = [], []
    candidates = list(CANDIDATES)
    if cuda:  # the GPU worker owns one core there
        failures.append(
            ProbeFailure(
                runtime="native", message="CPU kernels only, and this box verifies on CUDA"
            )
        )
        candidates.remove("native")
        llama = await asyncio.to_thread(check_runtime, "llama.cpp", timeout_s)
        if not (isinstance(llama, LlamaCppReport) and llama.gpu_offload):
            failures.append(
                ProbeFailure(
                    runtime="llama.cpp", message="this llama.cpp build cannot offload to the GPU"
                )
            )
            candidates.remove("llama.cpp")
    for failure in missing_exports(config, role, candidates):
        failures.append(failure)
        candidates.remove(failure.runtime)
    for runtime in candidates:
        spec = worker_specs(config, log_format, gpu_runtime=runtime)["gpu"]
        result, hit = await measure(spec, widths, timeout_s, cache)
        cached &= hit
        (profiles if isinstance(result, RuntimeProfile) else failures).append(result)
    if not profiles:
        reasons = "; ".join(f"{f.runtime}: {f.message}" for f in failures)
        raise RuntimeChoiceError(f"no runtime can hold the GPU worker's model: {reasons}")
    acceptance = PRIOR_ACCEPTANCE
    if role == "verifier" and config.draft is None and config.model_free_draft != "off":
        # no draft model: drafts from the text itself cost nothing and are accepted less
        draft_ms, acceptance = 0.0, MODEL_FREE_ACCEPTANCE
    rates: dict[str, Rate] = {
        p.runtime: best_rate(p.cost_ms(), draft_ms, acceptance) for p in profiles
    }
    return RuntimeDecision(
        runtime=fastest(rates),
        chosen_by="measurement",
        role=role,
        profiles=profiles,
        failures=failures,
        draft_ms=draft_ms,
        rates={name: round(rate.tokens_per_s, 1) for name, rate in rates.items()},
        gammas={name: rate.gamma for name, rate in rates.items()},
        cached=cached,
    )


def missing_exports(config: DaemonConfig, role: str, candidates: list[str]) -> list[ProbeFailure]:
    """The ``candidates`` that cannot load the GPU worker's model in ``role`` because the
    configuration gives none of the export they read (torch a folder, the others a GGUF)."""
    name = "target" if role == "verifier" else "draft"
    exports = config.target if role == "verifier" else config.draft
    said = {"folder": "a model folder", "gguf": "a GGUF"}
    return [
        ProbeFailure(runtime=runtime, message=f"reads {said[export]}, and the {name} has none")
        for runtime in candidates
        for export in [export_read_by(runtime)]
        if not getattr(exports, export)
    ]


class DrafterChoice(msgspec.Struct, frozen=True, kw_only=True):
    """The drafting CPU worker's runtime and one-token thread count, and why."""

    runtime: str  # "llama.cpp" or "native"
    threads: int | None  # None: the runtime's default (every core the worker owns)
    chosen_by: str  # "configuration" or "measurement"
    costs_ms: dict[str, dict[int, float]] = {}  # one draft token's cost, per runtime and threads
    failures: list[ProbeFailure] = []  # runtimes that could not load the draft here

    def summary(self) -> str:
        """One line for the log and ``--check``."""
        threads = "its cores" if self.threads is None else f"{self.threads} thread(s)"
        if self.chosen_by != "measurement":
            return f"drafter {self.runtime} on {threads} ({self.chosen_by})"
        figures = ", ".join(
            f"{runtime} " + " ".join(f"{n}t={ms:.3f}ms" for n, ms in by.items())
            for runtime, by in self.costs_ms.items()
        )
        failed = "".join(f"; {f.runtime} unusable: {f.message}" for f in self.failures)
        return f"drafter {self.runtime} on {threads} (measured a draft token: {figures}{failed})"

    def draft_ms(self) -> float | None:
        """The chosen runtime's measured cost of one draft token (None: not measured)."""
        return self.costs_ms.get(self.runtime, {}).get(self.threads)


async def decide_drafter(
    config: DaemonConfig, log_format: str = "json", cache: Path | None = None
) -> DrafterChoice | None:
    """What the CPU worker drafts with (draft-cpu; None elsewhere): the configured
    ``cpu_runtime`` and ``cpu_worker.threads``, or, for what is left open, the cheapest draft
    token timed in a profile process per runtime (llama.cpp, native) and thread count (1, 2,
    4 .. its cores), cached like the GPU worker's profiles; see
    ``speculative.runtime_choice.fastest_drafter``."""
    if config.placement != "draft-cpu" or config.draft is None:
        return None
    runtimes = ["llama.cpp", "native"] if config.cpu_runtime == "auto" else [config.cpu_runtime]
    cores = len(set(worker_specs(config, log_format, gpu_runtime="llama.cpp")["cpu"].cores))
    configured = config.cpu_worker.threads
    counts = [configured] if configured is not None else thread_counts(cores)
    if len(runtimes) == 1 and len(counts) == 1:
        return DrafterChoice(runtime=runtimes[0], threads=configured, chosen_by="configuration")
    costs: dict[str, dict[int, float]] = {}
    failures: list[ProbeFailure] = []
    for runtime in runtimes:
        for count in counts:  # timed as the worker will run (llama.cpp: batches on every core)
            spec = worker_specs(
                config,
                log_format,
                gpu_runtime="llama.cpp",
                drafter_threads=count,
                drafter_runtime=runtime,
            )["cpu"]
            result, _ = await measure(spec, [1], config.load_timeout_s, cache)
            if isinstance(result, RuntimeProfile):
                costs.setdefault(runtime, {})[count] = round(result.median_ms[0], 4)
            else:
                failures.append(result)
                break  # a runtime that cannot load the draft fails at every count
    if not costs:  # the worker's own load then says why
        return DrafterChoice(
            runtime=runtimes[0], threads=configured, chosen_by="configuration", failures=failures
        )
    runtime, threads = fastest_drafter(costs)
    return DrafterChoice(
        runtime=runtime, threads=threads, chosen_by="measurement", costs_ms=costs, failures=failures
    )
