"""hetspecd's configuration: defaults < TOML file < ``HETSPEC_*`` environment < command line.

Every setting has a default, so ``hetspecd`` with no configuration serves the bundled demo
models. A bad setting is one ``ConfigError`` line naming the key and where it came from.

Environment variables name a key with its section: ``HETSPEC_SOCKET``,
``HETSPEC_CPU_WORKER__N_BATCH`` (a double underscore between section and key). Values are
read as TOML values when they parse as one (``8``, ``true``, ``[0, 1]``) and as strings
otherwise. ``--set section.key=value`` on the command line does the same.
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from hetspec.endpoints import parse_rpc_endpoint
from hetspec.protocol.worker_messages import LlamaCppSettings, TorchSettings

DEFAULT_CONFIG_FILE = Path("/etc/hetspec/hetspecd.toml")
BUNDLED_MODELS = Path(__file__).resolve().parents[1] / "models"
ENV_PREFIX = "HETSPEC_"


def cache_dir(configured: str | None, environ: dict[str, str] | None = None) -> Path:
    """hetspec's cache: the configured ``cache_dir``, else ``$HETSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hetspec``, else ``~/.cache/hetspec`` (where the model builders keep
    their models: ``hetspec.models.cache_files``)."""
    if configured:
        return Path(configured)
    environ = os.environ if environ is None else environ
    if environ.get("HETSPEC_CACHE_DIR"):
        return Path(environ["HETSPEC_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetspec"


class ConfigError(ValueError):
    """One line that names the bad key, what is wrong and where the value came from."""


class ModelPaths(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One model in both exports: the torch worker loads ``folder``, llama.cpp and the native
    kernels ``gguf``; "" (or leaving it out): the model has no such export."""

    folder: str = ""
    gguf: str = ""


def model_paths_of(path: str | Path) -> ModelPaths:
    """The exports one path names: a ``.gguf`` file (with its folder where ``config.json`` lies
    beside it), or a folder (a Hugging Face one, with its one GGUF where it holds one).
    Raises ConfigError, saying why, for anything else."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{path} is neither a model folder nor a .gguf file")
        folder = path.parent if (path.parent / "config.json").is_file() else None
        return ModelPaths(folder=str(folder.resolve()) if folder else "", gguf=str(path.resolve()))
    if not path.is_dir():
        raise ConfigError(f"{path}: no such file or folder")
    ggufs = sorted(path.resolve().glob("*.gguf"))
    if len(ggufs) > 1:
        raise ConfigError(
            f"{path} holds several GGUF files ({', '.join(g.name for g in ggufs)}); name one"
        )
    folder = path.resolve() if (path / "config.json").is_file() else None
    if folder is None and not ggufs:
        raise ConfigError(f"{path} has neither config.json nor a .gguf file")
    return ModelPaths(folder=str(folder or ""), gguf=str(ggufs[0]) if ggufs else "")


class CpuWorkerConfig(LlamaCppSettings, forbid_unknown_fields=True, kw_only=True, tag=False):
    cores: list[int] | None = None  # None: the daemon splits the box (see cores.py)


class GpuWorkerConfig(TorchSettings, forbid_unknown_fields=True, kw_only=True, tag=False):
    cores: list[int] | None = None


class TcpConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An optional TCP listener beside the Unix socket; every request on it needs the token."""

    listen: str | None = None  # "127.0.0.1:8080", "[::1]:8080", "0.0.0.0:8080"; None: off
    # clients send "Authorization: Bearer <token>". Prefer token_file: a token given with
    # --set tcp.token=... is in the command line, which every user of the box sees (ps).
    token: str | None = None
    token_file: str | None = None  # or read it from this file (mode 0600 or 0640)

    def __post_init__(self) -> None:
        if self.token_file and not self.token:
            try:
                with open(self.token_file) as file:
                    mode = os.fstat(file.fileno()).st_mode
                    self.token = file.read().strip()
            except OSError as error:
                raise ValueError(
                    f"token_file: cannot read {self.token_file}: {error.strerror}"
                ) from None
            if mode & 0o006:  # others may read the token, or write their own
                raise ValueError(
                    f"token_file: {self.token_file} is readable or writable by "
                    f"every user (mode {mode & 0o777:04o}); chmod o= it"
                )
        if self.listen is None:
            return
        _, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT, not {self.listen!r}")
        if not self.token or len(self.token) < 16:
            raise ValueError(
                "a TCP listener needs a bearer token of at least 16 characters "
                "(tcp.token or tcp.token_file)"
            )


class RpcConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The target's layers on other hosts: llama.cpp rpc-servers (`hetspec-rpc-server`).
    llama.cpp's RPC is unauthenticated: reach them over a tunnel or a private link only
    (docs/beyond-one-box.md)."""

    servers: list[str] = msgspec.field(default_factory=list)  # HOST:PORT each; []: off
    # how many of the target's last layers run on the servers, split by their free memory;
    # -1: every layer and the output layer (this box keeps the embeddings)
    layers: int = -1

    def __post_init__(self) -> None:
        for endpoint in self.servers:
            parse_rpc_endpoint(endpoint)  # ValueError: one line naming it
        if len(set(self.servers)) != len(self.servers):
            raise ValueError("servers: an rpc-server is listed twice")
        if self.layers < -1:
            raise ValueError(f"layers must be -1 (all) or >= 0, not {self.layers}")


class PipelineStage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A ``hetspec-stage`` on another host (its layers are set there, ``--layers``)."""

    endpoint: str  # tcp://HOST:PORT, as the stage binds it
    key: str  # its public key file (NAME.key)


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """FlowSpec's pipeline: the target's layers in stage processes, verifying the draft
    model's trees (docs/beyond-one-box.md). The daemon runs the ``local`` stages itself (the
    first ones, from layer 0) and reaches the ``stages`` of other hosts after them; off when
    both are empty. Requests decode through it in every speculative mode."""

    # layer ranges this daemon runs as stage processes, in order: ["0:2.5"] (halves split a
    # layer after its attention, speculative/flow/layer_split.py)
    local: list[str] = msgspec.field(default_factory=list)
    stages: list[PipelineStage] = msgspec.field(default_factory=list)
    # the coordinator's secret key (NAME.key_secret, mode 0600; its NAME.key beside it goes to
    # every stage's --authorized folder); None: one made at start, enough for local stages
    key: str | None = None
    # where the last stage sends its outputs: an address of this host it can reach
    listen: str = "tcp://127.0.0.1:*"
    timeout_s: float = 2.0  # a stage silent this long fails the request
    segment: int = 3  # nodes per segment
    threads: int = 1  # each local stage's torch threads

    def __post_init__(self) -> None:
        if self.stages and self.key is None:
            raise ValueError(
                "key: stages on other hosts need the coordinator's key file "
                "(hetspec-stage keys DIR coordinator)"
            )
        for stage in self.stages:
            if not stage.endpoint.startswith("tcp://"):
                raise ValueError(f"stages: {stage.endpoint!r} is not a tcp:// endpoint")
        if not self.listen.startswith("tcp://"):
            raise ValueError(f"listen: {self.listen!r} is not a tcp:// endpoint")
        if not 0.1 <= self.timeout_s <= 600:
            raise ValueError(f"timeout_s must be in 0.1..600, not {self.timeout_s}")
        if not 1 <= self.segment <= 64:
            raise ValueError(f"segment must be in 1..64, not {self.segment}")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be in 1..1024, not {self.threads}")

    @property
    def enabled(self) -> bool:
        return bool(self.local or self.stages)


class DaemonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    socket: str = "/run/hetspec/hetspecd.sock"
    runtime_dir: str = "/run/hetspec"  # ZeroMQ endpoints and the instance lock live here
    placement: Literal["draft-cpu", "draft-gpu"] = "draft-cpu"
    # how requests that name no mode are decoded (see hetspec.protocol.modes)
    mode: Literal["autoregressive", "sequential", "parallel", "adaptive"] = "adaptive"
    gamma: int = 4  # the draft length of mode "parallel" when a request gives none
    # requests that decode together, each on its own sequence in both workers (their
    # verifications share forwards where the runtime can); others wait in the queue
    max_parallel: int = 4
    max_queue: int = 16  # requests that may wait while max_parallel decode; more get 429
    # with max_parallel > 1, prompts are prefilled this many tokens a call, so that the rounds
    # of requests decoding beside a new one run between its calls
    prefill_chunk: int = 256
    # The GPU worker's runtime: torch (the model folder), or llama.cpp (the GGUF file, every
    # layer offloaded when llama.cpp was built for the GPU; on a box without one, two
    # llama.cpp workers on their own cores still overlap drafting with verifying), or "auto":
    # whichever measures fastest here at load (see runtime_choice.py; profiles are cached).
    # The llama.cpp GPU worker takes cpu_worker's llama.cpp settings. "native": hetspec's own
    # CPU kernels over the same GGUF file (native/), built for verifying several tokens at once.
    gpu_runtime: Literal["auto", "torch", "llama.cpp", "native"] = "auto"
    # The drafting CPU worker's runtime (draft-cpu): llama.cpp, hetspec's native kernels over
    # the same GGUF file (no graph to build per step: a small draft's token costs less), or
    # "auto": whichever drafts one token fastest here, timed at load with each thread count
    # (see runtime_choice.decide_drafter; cached). In draft-gpu the CPU worker verifies the
    # target in llama.cpp whatever this says.
    cpu_runtime: Literal["auto", "llama.cpp", "native"] = "auto"
    # draft-gpu: Dovetail's draft head, drafting from the target's own features (torch, on the
    # GPU worker; gpu_runtime "auto" or "torch"). "auto": a head matching the target (its
    # folder's draft-head/, else the bundled one), else the draft model; a path: that head
    # (a mismatch is an error); "none": the draft model. See head_choice.py.
    draft_head: str = "auto"
    # EAGLE-2's dynamic draft trees in plain rounds of greedy and seeded requests (modes
    # sequential and adaptive): each layer expands this many of the likeliest nodes, and the
    # likeliest drafted nodes are verified, as many as the measured costs make pay
    # (speculative/drafting/dynamic_tree.py). 0: chains and DuoDecoding's branches.
    draft_tree: int = 0
    # Drafts without a draft model, from the request's own tokens (the prompt and the text so
    # far), weighed each round of mode adaptive against the controller's plan and run where
    # they pay (speculative/drafting/): "continuation-tree", what followed the text's ending
    # before, as a tree; "prompt-lookup", one chain copied from its latest occurrence;
    # "ngram-table", counts of what followed short contexts; "off".
    model_free_draft: Literal["continuation-tree", "prompt-lookup", "ngram-table", "off"] = (
        "continuation-tree"
    )
    # Where both workers compute on the CPU (no CUDA), the verifier computes on the drafter's
    # spare cores too whenever the drafter has nothing to do: the target alone, a plain
    # round's verification (see workers/runtimes/spare_cores.py). False keeps each on its own
    # cores.
    lend_cores: bool = True
    # Where both workers compute on the CPU, the daemon keeps off the drafter's cores: its
    # work between calls overlaps the draft, and on the drafter's core it delays it (see
    # cores.daemon_cores). False: wherever the scheduler puts it.
    daemon_off_drafter_cores: bool = True
    # The native kernels' most capable instruction level (either worker): "best", the best
    # this CPU runs, or a cap: "vnni" (AVX-512 VNNI), "avx_vnni", "avx2", "portable"; on
    # aarch64 "dotprod" or "portable". Every x86 SIMD level gives the same bits; a cap is for
    # measuring what a level is worth, or for a box whose CPU reports an extension it mishandles.
    native_kernels: Literal["best", "vnni", "avx_vnni", "avx2", "dotprod", "portable"] = "best"
    # Measured runtime profiles (gpu_runtime "auto") are kept here; None: $HETSPEC_CACHE_DIR,
    # else $XDG_CACHE_HOME/hetspec, else ~/.cache/hetspec (the systemd unit points
    # XDG_CACHE_HOME at its CacheDirectory).
    cache_dir: str | None = None
    model_name: str | None = None  # the name the API serves; None: the target's folder name
    tcp: TcpConfig = msgspec.field(default_factory=TcpConfig)
    # The target's layers on other hosts' rpc-servers (llama.cpp's RPC backend): the verifier
    # then runs in llama.cpp (gpu_runtime "auto" picks it without measuring).
    rpc: RpcConfig = msgspec.field(default_factory=RpcConfig)
    # FlowSpec's pipeline of stage processes instead of a verifier worker
    pipeline: PipelineConfig = msgspec.field(default_factory=PipelineConfig)
    # HTTP connections open at once (Unix socket and TCP together); one more is answered 503
    # and closed. Each takes a file descriptor: keep it well below LimitNOFILE.
    http_max_connections: int = 256
    # A connection without a complete request for this long is closed: an idle keep-alive
    # connection, or a client whose request headers have not all arrived.
    http_idle_timeout_s: float = 30.0
    target: ModelPaths = msgspec.field(
        default_factory=lambda: ModelPaths(
            folder=str(BUNDLED_MODELS / "target"),
            gguf=str(BUNDLED_MODELS / "target" / "target-q8_0.gguf"),
        )
    )
    # None ("none" in a file or --set): no draft model; the daemon drafts from the text
    # itself (model_free_draft). A configuration that names a target and no draft has none;
    # the bundled target comes with the bundled draft.
    draft: ModelPaths | None = msgspec.field(
        default_factory=lambda: ModelPaths(
            folder=str(BUNDLED_MODELS / "draft"),
            gguf=str(BUNDLED_MODELS / "draft" / "draft-q8_0.gguf"),
        )
    )
    cpu_worker: CpuWorkerConfig = msgspec.field(default_factory=CpuWorkerConfig)
    gpu_worker: GpuWorkerConfig = msgspec.field(default_factory=GpuWorkerConfig)
    arena_slots: int = 8  # shared-memory slots for probability rows and logits
    max_tree_nodes: int = 64  # the widest draft or tree a slot must hold
    load_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    call_timeout_s: float = 300.0  # longest one worker command may take before it is killed
    # After a reply a worker polls this long for its next command before it sleeps: a sleeping
    # thread's wake-up costs ~200 us on an idle VM, but polling slows the other worker where
    # the two share a core's execution resources (docs/design-notes.md, "Cores"): keep it short.
    worker_spin_us: float = 100.0
    # After sending a worker a call the daemon reads its replies this long on every pass of
    # its event loop instead of sleeping until a reply wakes it (0: it sleeps). That saves a
    # wake-up per call but keeps a core busy through every call: for a box where the daemon
    # has a core of its own (a GPU box's CPU), never for two cores the workers share.
    daemon_spin_us: float = 0.0
    # Commands and replies through shared-memory mailboxes with an eventfd bell (x86-64
    # Linux; protocol/mailbox.py): a round trip ~4x shorter than through ZeroMQ alone, whose
    # I/O threads each message wakes. false: ZeroMQ alone (also what other machines use).
    worker_mailboxes: bool = True
    # A file where every speculative round is appended as a JSON line (its plan, what the
    # controller expected, what it drafted, accepted and cost), for diagnosing the controller
    # on a real box (the two workers' rounds, not a pipeline's); `python -m
    # hetspec.daemon.decode.round_log FILE` summarizes it. None: off.
    round_log: str | None = None
    restart_backoff_s: tuple[float, float] = (0.5, 30.0)  # first and largest delay
    # How long a request waits for a restarting worker before it is answered 503: a killed
    # CPU worker is back in ~1.5 s, a GPU one in ~9 s on the demo models.
    restart_wait_s: float = 15.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    def __post_init__(self) -> None:
        positive = {
            "arena_slots": self.arena_slots,
            "max_tree_nodes": self.max_tree_nodes,
            "load_timeout_s": self.load_timeout_s,
            "heartbeat_s": self.heartbeat_s,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "call_timeout_s": self.call_timeout_s,
            "http_idle_timeout_s": self.http_idle_timeout_s,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"{key} must be > 0, not {value}")
        ranges = {  # key: (lowest, highest, what the range means where it needs saying)
            "prefill_chunk": (16, 1_000_000, ""),
            "max_parallel": (1, 64, ""),
            "max_queue": (0, 10_000, ""),
            "http_max_connections": (1, 1_000_000, ""),
            "worker_spin_us": (0, 100_000, ""),
            "daemon_spin_us": (0, 100_000, ""),
            "gamma": (1, 32, ""),
            "draft_tree": (0, 8, " (0: no trees)"),
            "restart_wait_s": (0, 3600, ""),
        }
        for key, (lowest, highest, meaning) in ranges.items():
            if not lowest <= getattr(self, key) <= highest:
                raise ValueError(
                    f"{key} must be in {lowest}..{highest}{meaning}, not {getattr(self, key)}"
                )
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError("heartbeat_timeout_s must exceed two heartbeat_s intervals")
        self._check_combinations()
        low, high = self.restart_backoff_s
        if not 0 < low <= high:
            raise ValueError(
                f"restart_backoff_s must be [first, largest] with 0 < first <= "
                f"largest, not {list(self.restart_backoff_s)}"
            )

    def _check_combinations(self) -> None:
        """Settings that are each valid but not together."""
        for name, model in (("target", self.target), ("draft", self.draft)):
            if model is not None and not model.folder and not model.gguf:
                raise ValueError(f"{name}: give its folder, its gguf or both; both are empty")
        if self.draft is None:
            if self.placement != "draft-cpu" or self.pipeline.enabled:
                raise ValueError(
                    "draft: none serves the target alone on one worker (placement "
                    '"draft-cpu", no pipeline); draft-gpu and the pipeline need a draft model'
                )
            if self.draft_head not in ("auto", "none"):
                raise ValueError("draft_head: a draft head drafts in placement draft-gpu")
            return
        on_cpu = "draft" if self.placement == "draft-cpu" else "target"
        if not getattr(self, on_cpu).gguf:
            raise ValueError(
                f"{on_cpu}.gguf is empty, and the CPU worker loads it with "
                f"llama.cpp in placement {self.placement!r}"
            )
        if self.rpc.servers and self.gpu_runtime not in ("auto", "llama.cpp"):
            raise ValueError(
                f"gpu_runtime {self.gpu_runtime!r} cannot use rpc.servers: the "
                "target's layers go to rpc-servers through llama.cpp; set "
                'gpu_runtime = "auto" or "llama.cpp"'
            )
        if self.cpu_runtime == "native" and self.placement != "draft-cpu":
            raise ValueError(
                'cpu_runtime "native" drafts: it needs placement = "draft-cpu" '
                "(in draft-gpu the CPU worker verifies in llama.cpp)"
            )
        if self.pipeline.enabled and (self.placement != "draft-cpu" or self.rpc.servers):
            raise ValueError(
                "pipeline: the stages verify and the CPU worker drafts; it needs "
                'placement = "draft-cpu" and no rpc.servers'
            )


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict, dotted: str, value: Any, source: str) -> None:
    *sections, key = dotted.split(".")
    node = tree
    for section in sections:
        child = node.setdefault(section, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {section} is not a section ({source})")
        node = child
    node[key] = value


def _environment_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    overrides = []
    for name, text in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name == "HETSPEC_CONFIG":
            continue
        dotted = name.removeprefix(ENV_PREFIX).lower().replace("__", ".")
        overrides.append((dotted, parse_value(text), f"environment variable {name}"))
    return overrides


def _describe_validation_error(error: msgspec.ValidationError) -> tuple[str, str]:
    """msgspec says "Expected `int`, got `str` - at `$.cpu_worker.n_batch`": split it."""
    text = str(error)
    message, _, where = text.rpartition(" - at `$.")
    if not message:  # a top-level problem; our own checks start with the key they concern
        first, _, rest = text.partition(" ")
        if first in DaemonConfig.__struct_fields__:
            return first, rest
        return "", text[0].lower() + text[1:]
    return where.rstrip("`"), message[0].lower() + message[1:]


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """The effective configuration. ``path`` None means ``$HETSPEC_CONFIG`` or the default
    file, either of which may be absent; an explicit path must exist."""
    environ = os.environ if environ is None else environ
    explicit = path is not None or bool(environ.get("HETSPEC_CONFIG"))
    path = Path(path or environ.get("HETSPEC_CONFIG") or DEFAULT_CONFIG_FILE)
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    try:
        tree = tomllib.loads(path.read_text())
        for key in _flatten(tree):
            sources[key] = str(path)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"configuration file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read configuration file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    layered = _environment_overrides(environ)
    layered += [(k, v, f"--set {k}") for k, v in (overrides or {}).items()]
    for dotted, value, source in layered:
        _set_path(tree, dotted, value, source)
        sources[dotted] = source
    if "target" in tree and "draft" not in tree:
        tree["draft"] = None  # a target named alone: no draft model (not the bundled one)
    elif str(tree.get("draft", "")).lower() == "none":
        tree["draft"] = None
    try:
        return msgspec.convert(tree, DaemonConfig, strict=False)
    except msgspec.ValidationError as error:
        key, message = _describe_validation_error(error)
        source = sources.get(key) or next(
            (s for k, s in sources.items() if k.startswith(key + ".") or key.startswith(k)),
            "defaults",
        )
        if "unknown field" in message:
            field = message.split("`")[1]
            key = f"{key}.{field}" if key else field
            raise ConfigError(f"{key}: unknown setting ({sources.get(key, source)})") from None
        if message.startswith("invalid enum value") and (choices := _choices(key)):
            message += f"; one of: {', '.join(choices)}"
        raise ConfigError(f"{key or 'configuration'}: {message} ({source})") from None


def _choices(dotted: str) -> list[str] | None:
    """The values a setting of a Literal type may take (None for any other type)."""
    kind: Any = DaemonConfig
    for part in dotted.split("."):
        hints = typing.get_type_hints(kind) if isinstance(kind, type) else {}
        if part not in hints:
            return None
        kind = hints[part]
    options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if typing.get_origin(kind) is not Literal and len(options) == 1:  # Optional[Literal]
        kind = options[0]
    if typing.get_origin(kind) is not Literal:
        return None
    return [str(value) for value in typing.get_args(kind)]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        keys += _flatten(value, dotted + ".") if isinstance(value, dict) else [dotted]
    return keys
