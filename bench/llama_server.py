"""llama.cpp's own ``llama-server`` as a benchmark peer: find or build it, run it, time requests.

The binary comes from ``native/build-llama-server.sh``, which compiles the llama.cpp that the
installed llama-cpp-python vendors (so the peer and hetspec's workers run the same llama.cpp)
and caches it under ``$HETSPEC_CACHE_DIR`` (default ``~/.cache/hetspec``)
``/llama-server/VERSION-BACKEND/bin/llama-server``. Nothing here builds unless asked to:
``find_llama_server(build=True)`` runs the script (about 9 minutes on 2 cores the first time).

A ``LlamaServer`` is one server process for one configuration (target alone, or target and
draft at one draft length), listening on a Unix socket in a private temporary folder (never a
TCP port), one slot unless ``ServerConfig.parallel`` asks for more, every request prefilling
its whole prompt.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

import httpx

BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "native" / "build-llama-server.sh"
BACKENDS = ("cpu", "cuda")
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class LlamaServerUnavailable(RuntimeError):
    """No llama-server binary can be had (not built, or its build failed); one line why."""


class LlamaServerError(RuntimeError):
    """A llama-server process would not start, or a request to it failed; one line why."""


def cache_root() -> Path:
    """hetspec's cache folder, as native/build-llama-server.sh computes it."""
    if os.environ.get("HETSPEC_CACHE_DIR"):
        return Path(os.environ["HETSPEC_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "hetspec"


def cached_binary(backend: str = "cpu", version: str | None = None) -> Path:
    """Where the build script leaves llama-server for this llama-cpp-python version."""
    if version is None:
        try:
            version = importlib.metadata.version("llama-cpp-python")
        except importlib.metadata.PackageNotFoundError:
            raise LlamaServerUnavailable("llama-cpp-python is not installed") from None
    return cache_root() / "llama-server" / f"{version}-{backend}" / "bin" / "llama-server"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server(
    build: bool,
    backend: str = "cpu",
    *,
    script: Path = BUILD_SCRIPT,
    progress: TextIO | None = None,
) -> Path:
    """The cached llama-server binary; with ``build``, run the build script when it is absent
    (its progress lines go to ``progress``, default stderr). Raises LlamaServerUnavailable with
    one line when there is no binary and it is not to be built, or the build fails."""
    if backend not in BACKENDS:
        raise LlamaServerUnavailable(
            f"unknown llama-server backend {backend!r} ({', '.join(BACKENDS)})"
        )
    cached = cached_binary(backend)
    if _executable(cached):
        return cached
    if not build:
        raise LlamaServerUnavailable(
            f"llama-server is not built ({cached} is absent): run native/build-llama-server.sh"
        )
    if not script.is_file():
        raise LlamaServerUnavailable(f"cannot build llama-server: {script} is missing")
    progress = progress or sys.stderr
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            ["bash", str(script), backend], stdout=subprocess.PIPE, stderr=errors, text=True
        )
        last = ""
        for line in process.stdout:
            progress.write(line)
            progress.flush()
            last = line.strip() or last
        status = process.wait()
        errors.seek(0)
        said = [line.strip() for line in errors if line.strip()]
    if status != 0:
        why = said[-1] if said else f"the build script exited with status {status}"
        raise LlamaServerUnavailable(f"building llama-server failed: {why}")
    built = Path(last)
    if not _executable(built):
        raise LlamaServerUnavailable(f"the build script named {last!r}, which is no executable")
    return built


@dataclass(frozen=True)
class ServerConfig:
    """One llama-server configuration. ``draft`` None: the target alone; ``n_max`` None: the
    server's own default draft length (3 in llama.cpp 0c1e57098, llama-cpp-python 0.3.36).
    ``flash_attention`` None leaves the server's default ("auto", on for the CPU)."""

    target: Path
    draft: Path | None = None
    n_max: int | None = None
    p_min: float | None = None  # --spec-draft-p-min; None: the server's default
    threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    context: int = 2048
    flash_attention: str | None = None
    # layers offloaded to the GPU (a CUDA build; None: not passed, the server's default):
    # the target's (-ngl) and the draft's (-ngld; 0 drafts on the CPU)
    gpu_layers: int | None = None
    draft_gpu_layers: int | None = None
    # drafting without a draft model: --spec-type (e.g. "ngram-simple", "ngram-mod") and its
    # own flags, e.g. ("--spec-ngram-simple-size-n", "3")
    spec_type: str | None = None
    spec_args: tuple[str, ...] = ()
    # slots (-np): requests decoded together by continuous batching; each slot gets
    # context / parallel of the context (the KV cache is not unified when -np is given)
    parallel: int = 1


def server_args(binary: Path, config: ServerConfig, socket: Path) -> list[str]:
    """The command line for ``config`` listening on ``socket`` (flags as in the --help of the
    llama-server built from llama-cpp-python 0.3.36's llama.cpp)."""
    threads = str(config.threads)
    args = [str(binary), "-m", str(config.target), "--host", str(socket)]  # a .sock host: Unix
    args += ["-t", threads, "-tb", threads, "-c", str(config.context), "-np", str(config.parallel)]
    # nothing kept between requests: no prompt cache in RAM, no prefix reuse in the slot
    args += ["--no-webui", "--cache-ram", "0", "--no-cache-prompt"]
    if config.flash_attention is not None:
        args += ["-fa", config.flash_attention]
    if config.gpu_layers is not None:
        args += ["-ngl", str(config.gpu_layers)]
    if config.draft is not None:
        args += ["-md", str(config.draft), "--spec-type", "draft-simple", "-td", threads]
        args += ["-tbd", threads]
        if config.n_max is not None:
            args += ["--spec-draft-n-max", str(config.n_max)]
        if config.p_min is not None:
            args += ["--spec-draft-p-min", str(config.p_min)]
        if config.draft_gpu_layers is not None:
            args += ["-ngld", str(config.draft_gpu_layers)]
    elif config.spec_type is not None:
        args += ["--spec-type", config.spec_type, *config.spec_args]
    return args


class Timing(NamedTuple):
    ttft_ms: float
    decode_ms: float
    tokens: int
    draft_n: int
    draft_n_accepted: int
    ids: tuple[int, ...] = ()  # the token ids generated, where the reply lists them


def timing_of(reply: Mapping) -> Timing:
    """(TTFT, decode, tokens, drafted, accepted) from a /completion reply's own ``timings``.

    What llama-server measures (tools/server/server-common.h, ``server_slot_stats``, and
    server-context.cpp): the clock starts when the slot begins its prompt (after the HTTP
    request is parsed, the prompt tokenized and the task queued); ``prompt_ms`` ends when the
    first token is sampled (``n_gen == 1`` sets ``t_prompt_last``), so it covers the target's
    prefill, the draft's prefill (every target batch is mirrored into the draft by
    ``common_speculative_process`` before sampling) and the first token; ``predicted_ms`` runs
    from that first token to the last one sampled and so covers the other ``predicted_n - 1``
    tokens. Hence TTFT = prompt_ms and decode = predicted_ms, and decode tokens/s =
    (tokens - 1) / decode, which is how the bench counts hetspec (whose first token also
    comes with the prefill). Neither figure includes HTTP, JSON or tokenization, which
    hetspec's TTFT (from the daemon's receipt of the request) does include.
    """
    timings = reply["timings"]
    return Timing(
        float(timings["prompt_ms"]),
        float(timings["predicted_ms"]),
        int(timings["predicted_n"]),
        int(timings.get("draft_n", 0)),
        int(timings.get("draft_n_accepted", 0)),
        tuple(int(t) for t in reply.get("tokens") or ()),
    )


def completion_request(
    prompt: str,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    *,
    ignore_eos: bool = True,
) -> dict:
    """Exactly ``max_tokens`` tokens (EOS ignored: never sampled; with not ``ignore_eos`` at
    most that many, ending at an end token), the whole prompt prefilled. Greedy at
    ``temperature`` 0; above it, drawn from the softmax at that temperature alone (the server's
    default top-k 40, top-p 0.95 and min-p 0.05 switched off, as hetspec's requests have
    them), with ``seed`` (None: the server's own)."""
    body = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": ignore_eos,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    if temperature > 0:
        body.update(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
        if seed is not None:
            body["seed"] = seed
    return body


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies, however it
    dies, so that a killed peers process leaves no server behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _last_words(log: Path, lines: int = 200) -> str:
    """The line of a server log that says why it failed: its last error line, else its last."""
    try:
        said = [line.strip() for line in log.read_text(errors="replace").splitlines()[-lines:]]
    except OSError:
        return "no log"
    said = [line for line in said if line]
    errors = [line for line in said if "error" in line.lower()]
    return (errors or said or ["nothing logged"])[-1]


class LlamaServer:
    """A running llama-server for one configuration; ``close`` (or ``with``) stops it.

    It listens on a Unix socket in a temporary folder of its own, logs there, runs in a
    process group of its own and gets SIGTERM if this process dies. Construction returns once
    ``/health`` answers 200 (model loaded and warmed up) or raises LlamaServerError.
    """

    def __init__(self, binary: Path, config: ServerConfig, *, start_timeout: float = 300.0):
        self.config = config
        self.folder = Path(tempfile.mkdtemp(prefix="hetspec-llama-server-"))
        self.socket = self.folder / "llama-server.sock"
        self.log = self.folder / "llama-server.log"
        self.client: httpx.Client | None = None
        self.process: subprocess.Popen | None = None
        try:
            with self.log.open("wb") as log:
                self.process = subprocess.Popen(
                    server_args(binary, config, self.socket),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, no locks taken
                )
        except OSError as error:
            self.close()
            raise LlamaServerError(f"cannot run {binary}: {error.strerror}") from None
        try:
            self.client = httpx.Client(
                transport=httpx.HTTPTransport(uds=str(self.socket)),
                base_url="http://llama-server",
                timeout=httpx.Timeout(600.0, connect=5.0),
            )
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.process.poll()
            if status is not None:
                raise LlamaServerError(
                    f"llama-server exited with status {status} before it was ready: "
                    f"{_last_words(self.log)}"
                )
            if self.socket.exists():
                with contextlib.suppress(httpx.TransportError):
                    if self.client.get("/health").status_code == 200:
                        return
            time.sleep(0.05)
        raise LlamaServerError(
            f"llama-server was not ready after {timeout:.0f} s: {_last_words(self.log)}"
        )

    def generate(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        ignore_eos: bool = True,
        extra: Mapping | None = None,
    ) -> dict:
        """The raw /completion reply (``content``, ``tokens``, ``timings``, ...); sampling as
        ``completion_request``'s; ``extra``: more of the request's fields (``json_schema``)."""
        if self.client is None:
            raise LlamaServerError("this llama-server is stopped")
        try:
            body = completion_request(prompt, max_tokens, temperature, seed, ignore_eos=ignore_eos)
            body |= extra or {}
            response = self.client.post("/completion", json=body)
        except httpx.HTTPError as error:
            raise LlamaServerError(
                f"llama-server did not answer ({error!r}): {_last_words(self.log)}"
            ) from None
        if response.status_code != 200:
            raise LlamaServerError(
                f"llama-server answered {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    def complete(
        self, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None
    ) -> Timing:
        """Time one completion of exactly ``max_tokens`` tokens (see ``timing_of``), greedy
        unless ``temperature`` > 0."""
        timing = timing_of(self.generate(prompt, max_tokens, temperature, seed))
        if timing.tokens != max_tokens:
            raise LlamaServerError(f"llama-server made {timing.tokens} tokens, not {max_tokens}")
        return timing

    def close(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``) and remove its folder."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
