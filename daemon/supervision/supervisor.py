"""The supervisor: both workers up, their vocabularies compatible, and kept up.

It builds each worker's spec from the configuration and the placement (which model each
runtime loads), starts both at once, refuses a draft/target pair whose tokenizers differ,
and restarts a worker that dies, with exponential backoff, for as long as the daemon runs
(a restarted worker is used only if its tokenizer still fits the other worker's).
A request that was using a dead worker fails at once (``WorkerDied``); the next one waits for
the restarted worker (``worker``, up to ``restart_wait_s``) or fails clearly if it does not
come back in time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from hetspec.daemon.config import DaemonConfig, ModelPaths, cache_dir
from hetspec.daemon.load.head_choice import draft_head_for
from hetspec.daemon.load.model_facts import CONFIG_KEYS
from hetspec.daemon.supervision.cores import check_cores, cuda_present, owned_cores, split_cores
from hetspec.daemon.supervision.worker_client import WorkerClient, WorkerSpec, WorkerStartError
from hetspec.protocol import worker_messages as m
from hetspec.protocol.arena import ArenaLayout
from hetspec.protocol.gguf_checks import check_model_file
from hetspec.protocol.gguf_header import read_gguf_header
from hetspec.speculative.drafting.vocab_match import incompatibilities

log = structlog.get_logger("hetspec.daemon.supervision.supervisor")


class StartupError(RuntimeError):
    """The daemon cannot serve with this configuration; the message says why."""


class WorkerUnavailable(RuntimeError):
    """A worker is restarting and did not come back within the wait allowed."""


@dataclass(frozen=True)
class Roles:
    drafter: str  # worker name: "cpu" or "gpu"
    verifier: str


def roles(placement: str) -> Roles:
    return Roles("cpu", "gpu") if placement == "draft-cpu" else Roles("gpu", "cpu")


# the GGUF key ("{architecture}.{key}") of each config.json number
_GGUF_KEYS = {name: key for key, name in CONFIG_KEYS.items()}


def config_number_of(folder: str, key: str = "vocab_size") -> int:
    """A number of a model folder's config.json ("vocab_size": the logits width,
    "hidden_size": the feature width), read without loading anything."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
        return int(config.get("text_config", config)[key])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise StartupError(f"cannot read {key} from {path}: {error}") from None


def model_number_of(model: ModelPaths, key: str = "vocab_size") -> int:
    """``config_number_of`` for a model given as a folder, a GGUF or both: its folder's
    config.json where it has one, else its GGUF's header (a vocabulary's size is its token
    list's length where the file does not state it)."""
    if model.folder:
        return config_number_of(model.folder, key)
    try:
        header = read_gguf_header(model.gguf)
        family = header.fields["general.architecture"]
        stated = header.fields.get(f"{family}.{_GGUF_KEYS.get(key, key)}")
        if stated is None and key == "vocab_size":
            stated = header.fields["tokenizer.ggml.tokens"].count
        return int(stated)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise StartupError(f"cannot read {key} from {model.gguf}: {error}") from None


def check_model_files(config: DaemonConfig) -> None:
    """Refuse (``StartupError``, one line) a configured GGUF that is no GGUF file read here or
    whose metadata contradicts its tensors, before any worker loads it: the check ``hetspec
    models check`` makes (protocol/gguf_checks.py). Every configured GGUF, whichever worker
    would load it: a broken file is a mistake to report, not one to route around."""
    for model in (config.target, config.draft):
        if model is None or not model.gguf:
            continue
        try:
            check_model_file(model.gguf)
        except ValueError as error:  # GGUFFormatError, GGUFMetadataError
            raise StartupError(str(error)) from None
        except OSError as error:
            raise StartupError(f"{model.gguf}: cannot read it ({error.strerror})") from None


def export_read_by(runtime: str) -> str:
    """Which of a model's exports a worker's ``runtime`` loads: torch (and a draft head) a
    Hugging Face folder, llama.cpp and the native kernels a GGUF."""
    return "folder" if runtime in ("torch", "head") else "gguf"


def missing_export(config: DaemonConfig, gpu_runtime: str) -> None:
    """Raise StartupError, naming the setting, where a worker would load an export the
    configuration leaves empty ("")."""
    if config.draft is None:  # the target alone, on the GPU worker
        reader = f"the GPU worker's {gpu_runtime}"
        needs = [("target", config.target, export_read_by(gpu_runtime), reader)]
        _need(needs)
        return
    drafting_on_cpu = config.placement == "draft-cpu"
    on_cpu = ("draft", config.draft) if drafting_on_cpu else ("target", config.target)
    on_gpu = ("target", config.target) if drafting_on_cpu else ("draft", config.draft)
    needs = [
        (*on_cpu, "gguf", "the CPU worker's llama.cpp"),
        (*on_gpu, export_read_by(gpu_runtime), f"the GPU worker's {gpu_runtime}"),
    ]
    _need(needs)


def _need(needs: list[tuple]) -> None:
    for name, paths, export, reader in needs:
        if not getattr(paths, export):
            other = "gguf" if export == "folder" else "folder"
            raise StartupError(
                f"{reader} loads the {name}'s {export}, and {name}.{export} is "
                f"empty; give one (the {name} has only its {other})"
            )


def worker_specs(
    config: DaemonConfig,
    log_format: str,
    gpu_runtime: str | None = None,
    drafter_threads: int | None = None,
    drafter_runtime: str | None = None,
) -> dict[str, WorkerSpec]:
    """The two workers' specs for this configuration's placement and core split, with the GPU
    worker in ``gpu_runtime`` (default: the configured one, which must not be "auto": that is
    decided by measurement first, see runtime_choice) and, in draft-cpu, the CPU worker
    drafting in ``drafter_runtime`` (default: the configured ``cpu_runtime``, llama.cpp for
    "auto") one token on ``drafter_threads`` threads where its threads are not configured
    (see runtime_choice.decide_drafter; llama.cpp's batches keep every core)."""
    if config.draft is None:
        return _verifier_alone(config, log_format, gpu_runtime)
    gpu_runtime = gpu_runtime or config.gpu_runtime
    if gpu_runtime not in ("torch", "llama.cpp", "native", "head"):
        raise ValueError(f"the GPU worker's runtime must be decided, not {gpu_runtime!r}")
    configured = config.cpu_runtime if config.cpu_runtime != "auto" else "llama.cpp"
    drafter_runtime = drafter_runtime or configured
    if drafter_runtime not in ("llama.cpp", "native"):
        raise ValueError(f"a drafter runs in llama.cpp or native, not {drafter_runtime!r}")
    owned = owned_cores()
    cuda = cuda_present(config.gpu_worker.device)
    cpu_cores, gpu_cores = split_cores(owned, cuda)
    cpu_cfg, gpu_cfg = config.cpu_worker, config.gpu_worker
    cpu_cores = cpu_cfg.cores or cpu_cores
    gpu_cores = gpu_cfg.cores or gpu_cores
    check_cores(
        "cpu_worker",
        cpu_cores,
        max(cpu_cfg.threads or 0, cpu_cfg.threads_batch or 0) or None,
        owned,
    )
    check_cores("gpu_worker", gpu_cores, gpu_cfg.threads, owned)
    drafting_on_cpu = config.placement == "draft-cpu"
    missing_export(config, gpu_runtime)
    cpu_model = config.draft.gguf if drafting_on_cpu else config.target.gguf
    gpu_model = config.target.folder if drafting_on_cpu else config.draft.folder
    # the target's layers on rpc-servers: only ever the verifier's llama.cpp
    remote = (
        {"rpc_servers": tuple(config.rpc.servers), "gpu_layers": config.rpc.layers}
        if config.rpc.servers
        else {}
    )
    if remote and drafting_on_cpu and gpu_runtime != "llama.cpp":
        raise ValueError(f"rpc.servers needs the verifier in llama.cpp, not {gpu_runtime}")
    cpu_settings = _llama_settings(
        cpu_cfg, verifies=not drafting_on_cpu, **({} if drafting_on_cpu else remote)
    )
    if drafting_on_cpu and drafter_threads and cpu_cfg.threads is None:
        cpu_settings = msgspec.structs.replace(
            cpu_settings,
            threads=min(drafter_threads, len(set(cpu_cores))),
            threads_batch=cpu_cfg.threads_batch or len(set(cpu_cores)),
        )
    cpu_runtime = drafter_runtime if drafting_on_cpu else "llama.cpp"
    native_kernels = None if config.native_kernels == "best" else config.native_kernels
    if cpu_runtime == "native":  # one thread count for every call: the one-token steps'
        cpu_settings = m.NativeSettings(
            n_ctx=cpu_cfg.n_ctx, threads=cpu_settings.threads, simd=native_kernels
        )
    if gpu_runtime == "llama.cpp":  # the GPU worker's model in llama.cpp too
        gpu_model = config.target.gguf if drafting_on_cpu else config.draft.gguf
        gpu_settings = _llama_settings(
            cpu_cfg,
            verifies=drafting_on_cpu,
            threads=None,
            threads_batch=None,
            **({"gpu_layers": -1} | (remote if drafting_on_cpu else {})),
        )
    elif gpu_runtime == "native":  # the same GGUF file, on hetspec's own CPU kernels
        gpu_model = config.target.gguf if drafting_on_cpu else config.draft.gguf
        gpu_settings = m.NativeSettings(
            n_ctx=cpu_cfg.n_ctx, threads=gpu_cfg.threads, simd=native_kernels
        )
    elif gpu_runtime == "head":  # Dovetail's draft head over the target's features
        head = draft_head_for(config)
        if head is None or drafting_on_cpu:
            raise ValueError("the head runtime needs draft-gpu and a draft head")
        gpu_model = str(head)
        torch_settings = _torch_settings(gpu_cfg, verifies=False, cores=gpu_cores)
        gpu_settings = m.HeadSettings(
            target=config.target.folder,
            device=torch_settings.device,
            dtype=torch_settings.dtype,
            max_context=torch_settings.max_context,
            threads=torch_settings.threads,
        )
    else:
        gpu_settings = _torch_settings(
            gpu_cfg, verifies=drafting_on_cpu, cores=gpu_cores, cache=config.cache_dir
        )
    common = {
        "heartbeat_s": config.heartbeat_s,
        "heartbeat_timeout_s": config.heartbeat_timeout_s,
        "call_timeout_s": config.call_timeout_s,
        "spin_us": config.worker_spin_us,
        "reply_spin_us": config.daemon_spin_us,
        "mailbox": config.worker_mailboxes,
        "log_format": log_format,
        "sequences": config.max_parallel,
    }
    # Both compute on the CPU: the verifier may borrow the drafter's cores while it idles.
    lend = config.lend_cores and not cuda
    cpu_spare = set(gpu_cores) - set(cpu_cores) if lend and not drafting_on_cpu else set()
    gpu_spare = set(cpu_cores) - set(gpu_cores) if lend and drafting_on_cpu else set()
    return {
        "cpu": WorkerSpec(
            "cpu",
            cpu_runtime,
            cpu_model,
            cpu_settings,
            tuple(cpu_cores),
            spare_cores=tuple(sorted(cpu_spare)),
            **common,
        ),
        "gpu": WorkerSpec(
            "gpu",
            gpu_runtime,
            gpu_model,
            gpu_settings,
            tuple(gpu_cores),
            spare_cores=tuple(sorted(gpu_spare)),
            **common,
        ),
    }


def _verifier_alone(
    config: DaemonConfig, log_format: str, gpu_runtime: str | None
) -> dict[str, WorkerSpec]:
    """Without a draft model, the one worker: the verifier of draft-cpu (the GPU worker, in
    whichever runtime verifies fastest), on every core the daemon owns unless its cores are
    configured, with no drafter's cores to borrow."""
    gpu_worker = config.gpu_worker
    if not gpu_worker.cores and not cuda_present(gpu_worker.device):
        gpu_worker = msgspec.structs.replace(gpu_worker, cores=sorted(owned_cores()))
    # the specs of the target drafting for itself, of which the verifier's is the one
    alone = msgspec.structs.replace(config, draft=config.target, gpu_worker=gpu_worker)
    return {"gpu": worker_specs(alone, log_format, gpu_runtime)["gpu"]}


def _llama_settings(cfg, *, verifies: bool, **changes) -> m.LlamaCppSettings:
    """llama.cpp settings by role, where the configuration leaves them open: a verifier gets
    logits closest to one token at a time (no flash attention, an f32 V cache, see
    LlamaCppSettings), a drafter the faster auto/f16."""
    settings = m.LlamaCppSettings(**_fields(cfg, m.LlamaCppSettings))
    return msgspec.structs.replace(
        settings,
        flash_attention=settings.flash_attention or ("off" if verifies else "auto"),
        kv_type=settings.kv_type or "f16",
        v_type=settings.v_type or ("f32" if verifies and not settings.kv_type else None),
        **changes,
    )


def _torch_settings(
    cfg, *, verifies: bool, cores: list[int], cache: str | None = None
) -> m.TorchSettings:
    settings = m.TorchSettings(**_fields(cfg, m.TorchSettings))
    if settings.threads is None:  # torch would otherwise size its pool from the whole box
        settings = msgspec.structs.replace(settings, threads=len(set(cores)))
    if not verifies:  # HCMP splits a verification: a drafting GPU worker runs whole
        settings = msgspec.structs.replace(settings, split_ratio=None)
    if settings.split_ratio == "auto" and settings.split_cache is None:  # ARCA's profiles
        settings = msgspec.structs.replace(settings, split_cache=str(cache_dir(cache)))
    if verifies:
        # A verifier's logits must not depend on what a token is verified with, or greedy
        # output would leave the target's own (seen on an H100 in bf16: a tree's logits
        # differed from one token's enough to flip near-ties). The worker makes it so: on
        # CUDA in fixed-width forwards (bf16 where dtype is "auto"), on the CPU in float32.
        # A drafter may round: its tokens are only proposals.
        settings = msgspec.structs.replace(settings, verifies=True)
    return settings


def _fields(struct: msgspec.Struct, target: type) -> dict:
    return {name: getattr(struct, name) for name in target.__struct_fields__}


class Supervisor:
    def __init__(
        self,
        config: DaemonConfig,
        specs: dict[str, WorkerSpec],
        runtime_dir: Path,
        arena: ArenaLayout,
    ) -> None:
        self.config = config
        self.specs = specs
        self.runtime_dir = runtime_dir
        self.arena = arena
        self.roles = roles(config.placement)
        self.workers: dict[str, WorkerClient] = {}
        self._starting: dict[str, WorkerClient] = {}  # processes being started or restarted
        self.restarts = dict.fromkeys(specs, 0)
        self._generation = dict.fromkeys(specs, 0)
        self._ready = {name: asyncio.Event() for name in specs}
        self._watchers: list[asyncio.Task] = []
        self._stopping = False

    async def _spawn(self, name: str) -> WorkerClient:
        self._generation[name] += 1
        client = WorkerClient(
            self.specs[name], self.runtime_dir, self._generation[name], self.arena
        )
        self._starting[name] = client
        try:
            await client.start(self.config.load_timeout_s)
        finally:
            del self._starting[name]
        return client

    async def start(self) -> None:
        """Start the workers (both, or the drafter alone where pipeline stages verify) and
        check they can work together; ``StartupError`` if not."""
        names = list(self.specs)
        results = await asyncio.gather(*(self._spawn(n) for n in names), return_exceptions=True)
        started = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, WorkerClient)}
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await asyncio.gather(*(c.stop() for c in started.values()))
            for failure in failures:
                if not isinstance(failure, WorkerStartError):
                    raise failure
            raise StartupError("; ".join(str(f) for f in failures))
        self.workers = started
        drafter, verifier = started.get(self.roles.drafter), started.get(self.roles.verifier)
        # (no verifier worker: pipeline stages verify, daemon/pipeline/backend.py; no
        # drafter: no draft model)
        both = drafter is not None and verifier is not None
        problems = both and incompatibilities(drafter.ready.vocab, verifier.ready.vocab)
        if problems:
            await asyncio.gather(*(c.stop() for c in started.values()))
            raise StartupError(
                f"the draft model {drafter.spec.model} and the target model "
                f"{verifier.spec.model} do not share a tokenizer: {'; '.join(problems)}"
            )
        for name in names:
            self._ready[name].set()
            self._watchers.append(asyncio.create_task(self._watch(name), name=f"watch-{name}"))

    async def _watch(self, name: str) -> None:
        """Restart ``name`` whenever it dies, for as long as the daemon runs.

        A failed restart, whatever the cause (the worker's own, the box's: no descriptors or
        processes left, or a model that no longer shares the other worker's tokenizer), is
        logged and retried. The delay doubles, up to the largest of
        ``restart_backoff_s``, while restarts keep failing or the restarted worker dies again
        within that largest delay; it starts over once a worker stayed up that long."""
        first, largest = self.config.restart_backoff_s
        delay = first
        up_since = time.monotonic()
        while True:
            reason = await self.workers[name].died
            if self._stopping:
                return
            self._ready[name].clear()
            await self.workers[name].stop(grace_s=1.0)  # reap it and release its endpoints
            if time.monotonic() - up_since >= largest:
                delay = first  # it had recovered: this is a new failure
            while not self._stopping:
                log.warning("restarting worker", worker=name, reason=reason, in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, largest)  # for the next attempt, should this one fail
                try:
                    client = await self._restart(name)
                except Exception as error:  # whatever failed, supervision goes on
                    text = str(error)
                    if not isinstance(error, WorkerStartError):
                        text = f"{type(error).__name__}: {text}"
                    log.error("worker restart failed", worker=name, error=text)
                    reason = "could not be restarted"
                    continue
                self.workers[name] = client
                self.restarts[name] += 1
                up_since = time.monotonic()
                self._ready[name].set()
                log.info(
                    "worker restarted", worker=name, pid=client.pid, restarts=self.restarts[name]
                )
                break

    async def _restart(self, name: str) -> WorkerClient:
        """A new incarnation of ``name`` whose vocabulary fits the other worker's; else it is
        stopped and ``WorkerStartError`` says what differs. (Its model file may have been
        replaced since the daemon started: tokens passed between mismatched vocabularies
        would be wrong output, not an error.)"""
        client = await self._spawn(name)
        if self._other(name) not in self.workers:
            return client
        other = self.workers[self._other(name)].ready.vocab
        if name == self.roles.drafter:
            problems = incompatibilities(client.ready.vocab, other)
        else:
            problems = incompatibilities(other, client.ready.vocab)
        if problems:
            await client.stop(grace_s=1.0)
            raise WorkerStartError(
                f"the restarted {name} worker's model {client.spec.model} no longer shares "
                f"the other worker's tokenizer: {'; '.join(problems)}"
            )
        return client

    def _other(self, name: str) -> str:
        return self.roles.verifier if name == self.roles.drafter else self.roles.drafter

    def heartbeats_fresh(self) -> bool:
        """Every worker process, serving or loading, beat within three intervals: the daemon
        is not stuck. False while a worker is down (between restarts) or hangs."""
        limit = 3 * self.config.heartbeat_s
        current = [self._starting.get(name) or self.workers.get(name) for name in self.specs]
        return all(client is not None and client.heard_within(limit) for client in current)

    def ready(self) -> bool:
        return all(event.is_set() for event in self._ready.values())

    async def worker(self, name: str, timeout_s: float) -> WorkerClient:
        """The live worker ``name``; while it restarts, wait up to ``timeout_s`` for it, then
        raise ``WorkerUnavailable``. Never a worker already known to be dead (one that died
        a moment ago, before its watcher noticed)."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    await self._ready[name].wait()
                    client = self.workers[name]
                    if not client.died.done():
                        return client
                    await asyncio.sleep(0.01)  # its watcher clears the ready flag next
        except TimeoutError:
            raise WorkerUnavailable(
                f"the {name} worker is restarting and was not ready within {timeout_s:g} s"
            ) from None

    def settled(self) -> asyncio.Future:
        """Resolves once each worker is done with every call it has in flight now, cancelled
        ones included (``WorkerClient.settled``): then no slot those calls name is written.
        A worker replaced since is dead, and so done with its calls."""
        return asyncio.gather(*(client.settled() for client in self.workers.values()))

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await asyncio.gather(*(client.stop(grace_s) for client in self.workers.values()))
