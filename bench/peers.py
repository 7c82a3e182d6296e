"""The systems hetspec is compared with, on the same models, counted as it counts.

    python -m hetspec.bench.peers [--threads N] [--target-gguf F] [--draft-gguf F]
        [--target-folder D] [--draft-folder D] [--llama-server PATH|build|off]

``hetspec bench`` runs this as a process of its own (the client never imports torch or
llama.cpp) and interleaves its requests with hetspec's, so that a box whose speed drifts (a
shared VM's did by up to 2x within an hour) slows every system alike. It loads the peers and
writes ``{"systems": [...], "skipped": {name: why}, "llama_server": {...}}`` as its first line
(a peer that cannot be had is skipped with one line why, the others go on), then answers one
JSON request per line (``{"system", "prompt", "max_tokens"}``, and ``"seed"`` where sampled)
with ``{"ttft_ms", "decode_ms", "tokens"}`` (llama-server's also ``draft_n`` and
``draft_n_accepted``), or ``{"error"}``. Exactly ``max_tokens`` tokens (EOS ignored), greedy,
or with ``--temperature`` T > 0 drawn from the softmax at T alone (no top-k, top-p or min-p,
as hetspec's bench requests), all of the process's cores for each system:

- ``transformers assisted``: Hugging Face transformers' assisted generation,
  ``target.generate(assistant_model=draft)`` on the model folders, the peer most users would
  reach for;
- ``llama-cpp-python loop speculative gamma=4``: both GGUF models in llama.cpp in one process,
  draft gamma tokens then verify them in one batch, a plain loop written here over this
  package's llama.cpp runtime (the library calls hetspec makes, none of its processes); not
  llama.cpp's own implementation; greedy only (skipped at a temperature);
- ``llama-server target alone``, ``llama-server speculative (default n-max)`` and
  ``llama-server speculative n-max=N``: llama.cpp's own server (built from the llama.cpp that
  llama-cpp-python vendors, see native/build-llama-server.sh) on the target GGUF alone, and
  with the draft GGUF (``--spec-type draft-simple``) at its default draft length and at the
  best one of a sweep at startup (draft lengths 1, 2, 3, 4, 6, 8; decode tokens/s on two
  prompts of its own, none of the bench's; see ``sweep_n_max``).

Decode time is the time after the first token (which comes with the prefill in every system)
and covers the other max_tokens - 1 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Hashable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TextIO

import numpy as np

from hetspec.bench.llama_server import (
    LlamaServer,
    LlamaServerError,
    LlamaServerUnavailable,
    ServerConfig,
    Timing,
    find_llama_server,
)
from hetspec.speculative.verify.samplers import DrawnSampler
from hetspec.speculative.verify.verdicts import verify_greedy

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET_GGUF = MODELS / "target" / "target-q8_0.gguf"
DRAFT_GGUF = MODELS / "draft" / "draft-q8_0.gguf"
SWEEP_N_MAX = (1, 2, 3, 4, 6, 8)
SWEEP_P_MIN = (0.0, 0.75)
# The sweep's prompts: code like the bench's, but none of its prompts (it tunes on these).
SWEEP_PROMPTS = (
    "import os\n\n\ndef walk_files(root):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
)
SWEEP_TOKENS = 64
# llama-server's flash attention, "on" or "off", whichever decodes the target alone faster
# after FLASH_PROMPT (code of its own, none of the bench's, long enough that attention weighs
# in a token): on the 2-vCPU dev VM its CPU flash attention ("auto" turns it on) decoded
# heavy-300m 25% slower than without after the bench's longer prompts (docs/bench/bench.md)
FLASH_ATTENTION = ("on", "off")
FLASH_REPEATS = 3
FLASH_PROMPT = """import json
import os
from dataclasses import dataclass, field


@dataclass
class Inventory:
    \"\"\"Items by name, each with a count and a price; saved as JSON.\"\"\"

    path: str
    items: dict = field(default_factory=dict)

    def load(self):
        if not os.path.exists(self.path):
            return self
        with open(self.path) as source:
            for name, entry in json.load(source).items():
                self.items[name] = (int(entry["count"]), float(entry["price"]))
        return self

    def save(self):
        with open(self.path, "w") as target:
            json.dump({name: {"count": count, "price": price}
                       for name, (count, price) in self.items.items()}, target, indent=2)

    def add(self, name, count, price):
        old_count, _ = self.items.get(name, (0, price))
        self.items[name] = (old_count + count, price)

    def remove(self, name, count):
        old_count, price = self.items[name]
        if count > old_count:
            raise ValueError(f"only {old_count} of {name} left")
        self.items[name] = (old_count - count, price)

    def total(self):
        return sum(count * price for count, price in self.items.values())

    def cheapest(self, limit=3):
"""
SWEEP_REPEATS, SWEEP_MAX_REPEATS, SWEEP_MIN_MS = 2, 30, 1000.0
WARMUP_PROMPT = "def main():\n"


class Peer(Protocol):
    name: str

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        """``{"ttft_ms", "decode_ms", ...}`` of one completion of max_tokens tokens (sampled
        with ``seed`` where the peer samples)."""
        ...


class TransformersAssisted:
    name = "transformers assisted"

    def __init__(
        self,
        threads: int,
        target: Path,
        draft: Path,
        *,
        gpu: bool = False,
        temperature: float = 0.0,
    ) -> None:
        """On the CPU in float32; with ``gpu``, both models on CUDA in bfloat16 (what a user
        of a GPU runs), with the static KV cache transformers compiles and graphs. Greedy, or
        at ``temperature`` > 0 its speculative sampling."""
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        torch.set_num_threads(threads)
        self.torch = torch
        self.temperature = temperature
        self.device = "cuda" if gpu else "cpu"
        if gpu:
            self.name = "transformers assisted (GPU, bf16)"
        dtype = torch.bfloat16 if gpu else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        load = AutoModelForCausalLM.from_pretrained
        self.target = load(target, dtype=dtype).eval().to(self.device)
        self.draft = load(draft, dtype=dtype).eval().to(self.device)

    def _generate(self, ids, count: int, seed: int | None) -> float:
        sampling = {"do_sample": False}
        if self.temperature > 0:  # top-k 0 and top-p 1: the softmax at the temperature alone
            sampling = {
                "do_sample": True,
                "temperature": self.temperature,
                "top_k": 0,
                "top_p": 1.0,
            }
            self.torch.manual_seed(0 if seed is None else seed)
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.target.generate(
                ids,
                assistant_model=self.draft,
                **sampling,
                max_new_tokens=count,
                min_new_tokens=count,
            )
        assert out.shape[1] - ids.shape[1] == count
        return (time.perf_counter() - start) * 1000

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        """transformers cannot report the first token's time, so the prompt runs twice, for
        one token and for all of them."""
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
        first = self._generate(ids, 1, seed)
        return {"ttft_ms": first, "decode_ms": self._generate(ids, max_tokens, seed) - first}


class LlamaCppSpeculative:
    def __init__(
        self, threads: int, target: Path, draft: Path, gamma: int = 4, *, gpu_layers: int = 0
    ) -> None:
        from hetspec.protocol.sampling import SamplingParams  # noqa: PLC0415
        from hetspec.workers.runtimes.llama_cpp_runtime import LlamaCppRuntime  # noqa: PLC0415

        self.name = f"llama-cpp-python loop speculative gamma={gamma}"
        self.gamma = gamma
        self.target = LlamaCppRuntime(target, n_ctx=2048, threads=threads, gpu_layers=gpu_layers)
        self.draft = LlamaCppRuntime(draft, n_ctx=2048, threads=threads)
        self.greedy, self.sampler = SamplingParams(), DrawnSampler(0)

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        target, draft, gamma = self.target, self.draft, self.gamma
        # the whole prompt every time, as every system here: prefill would keep a common prefix
        target.rollback(0)
        draft.rollback(0)
        start = time.perf_counter()
        tokens = target.tokenize(prompt)
        target.prefill(tokens)
        draft.prefill(tokens)
        bonus = int(np.argmax(target.last_logits()))
        first = time.perf_counter()
        emitted, behind = 1, [bonus]
        while emitted < max_tokens:
            draft.append(behind)
            drafted = draft.draft(gamma, self.greedy, self.sampler).tokens[0].tolist()
            chain = list(range(-1, gamma - 1))
            logits = target.evaluate_tree([bonus, *drafted], [-1, *(p + 1 for p in chain)])
            verdict = verify_greedy(drafted, chain, logits)
            target.commit([0, *(node + 1 for node in verdict.path)])
            behind = [drafted[node] for node in verdict.path] + [verdict.bonus]
            bonus = verdict.bonus
            emitted += len(behind)
        end = time.perf_counter()
        decode = (end - first) * 1000 * (max_tokens - 1) / (emitted - 1)
        return {"ttft_ms": (first - start) * 1000, "decode_ms": decode}


class ServerPool:
    """llama-server processes by configuration, started on first use and kept, at most
    ``limit`` at once (the least recently used stops first).

    Each system needs its own flags, so its own server. Keeping them running costs memory (a
    model per server) but makes a request cost only itself; restarting costs a model load
    (and its warm-up), which the server's own timings leave out, so a limit of 1 only makes
    the bench slower, not its figures different. ``servers_that_fit`` picks the limit.
    """

    def __init__(self, binary: Path, limit: int) -> None:
        self.binary, self.limit = binary, max(1, limit)
        self._running: dict[ServerConfig, LlamaServer] = {}

    def get(self, config: ServerConfig) -> LlamaServer:
        server = self._running.pop(config, None)
        if server is not None and server.process.poll() is not None:  # it died: start anew
            server.close()
            server = None
        if server is None:
            while len(self._running) >= self.limit:
                self._running.pop(next(iter(self._running))).close()
            server = LlamaServer(self.binary, config)
        self._running[config] = server  # the most recently used last
        return server

    def close(self) -> None:
        while self._running:
            self._running.popitem()[1].close()


def servers_that_fit(models: list[Path], wanted: int) -> int:
    """How many servers of ``models`` to keep at once: all ``wanted`` while they take under a
    quarter of the memory available now, else one."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = (
            int(
                next(
                    line for line in meminfo.splitlines() if line.startswith("MemAvailable:")
                ).split()[1]
            )
            * 1024
        )
    except (OSError, StopIteration, ValueError):
        return 1
    size = sum(path.stat().st_size for path in models if path.exists())
    return wanted if wanted * size < available / 4 else 1


class LlamaServerPeer:
    """One llama-server configuration as a peer system, greedy or at ``temperature``."""

    def __init__(
        self, name: str, config: ServerConfig, pool: ServerPool, temperature: float = 0.0
    ) -> None:
        self.name, self.config, self.pool = name, config, pool
        self.temperature = temperature

    def run(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict[str, float]:
        server = self.pool.get(self.config)
        timing = server.complete(prompt, max_tokens, self.temperature, seed)
        return {
            "ttft_ms": timing.ttft_ms,
            "decode_ms": timing.decode_ms,
            "draft_n": timing.draft_n,
            "draft_n_accepted": timing.draft_n_accepted,
            "ids": list(timing.ids),
        }


def decode_speeds(timings: dict, failed: set) -> dict:
    """Decode tokens/s of each setting's completions (all tokens after the first over all
    decode time), leaving out settings that failed or never ran."""
    return {
        setting: sum(t.tokens - 1 for t in measured) / sum(t.decode_ms for t in measured) * 1000
        for setting, measured in timings.items()
        if measured and setting not in failed
    }


def sweep_n_max(
    binary: Path, config: ServerConfig, limit: int, temperature: float = 0.0
) -> dict[int, float]:
    """Decode tokens/s of llama-server's speculative decoding at each draft length of
    SWEEP_N_MAX (``sweep``)."""
    configs = {n: replace(config, n_max=n) for n in SWEEP_N_MAX}
    return sweep(binary, configs, limit, temperature)


def sweep(
    binary: Path, configs: dict[Hashable, ServerConfig], limit: int, temperature: float = 0.0
) -> dict[Hashable, float]:
    """Decode tokens/s of each of llama-server's ``configs``, after one warm-up request each:
    SWEEP_PROMPTS, SWEEP_TOKENS tokens each, repeated at least SWEEP_REPEATS times and until
    SWEEP_MIN_MS of decoding (a small model's 64 tokens take ~30 ms, too few to rank settings
    by). With ``limit`` servers room for every setting, the settings take turns, so that a
    drifting box slows them alike; else one after the other. Settings whose server fails are
    left out. At ``temperature`` > 0 each prompt is sampled with a seed of its own, the same
    in every setting."""
    timings: dict[Hashable, list[Timing]] = {key: [] for key in configs}
    failed: set[Hashable] = set()
    interleave = limit >= len(configs)
    turns = (
        [k for _ in range(SWEEP_MAX_REPEATS) for k in configs]
        if interleave
        else [k for k in configs for _ in range(SWEEP_MAX_REPEATS)]
    )

    def done(key: Hashable) -> bool:
        measured = timings[key]
        return key in failed or (
            len(measured) >= SWEEP_REPEATS * len(SWEEP_PROMPTS)
            and sum(t.decode_ms for t in measured) >= SWEEP_MIN_MS
        )

    pool = ServerPool(binary, limit)
    try:
        for key in turns:
            if done(key):
                continue
            try:
                server = pool.get(configs[key])
                if not timings[key]:
                    server.complete(WARMUP_PROMPT, 8)
                timings[key] += [
                    server.complete(p, SWEEP_TOKENS, temperature, seed)
                    for seed, p in enumerate(SWEEP_PROMPTS)
                ]
            except LlamaServerError as error:
                print(f"peers: llama-server {key} failed: {error}", file=sys.stderr)
                failed.add(key)
    finally:
        pool.close()
    return decode_speeds(timings, failed)


def pick_flash_attention(
    binary: Path, config: ServerConfig, temperature: float = 0.0
) -> tuple[str | None, dict[str, float]]:
    """Which of FLASH_ATTENTION decodes ``config`` faster after FLASH_PROMPT (decode
    tokens/s over FLASH_REPEATS completions each, taking turns after a warm-up), and the
    speeds of those that ran; None where none did."""
    timings: dict[str, list[Timing]] = {setting: [] for setting in FLASH_ATTENTION}
    failed: set[str] = set()
    pool = ServerPool(binary, len(FLASH_ATTENTION))
    try:
        for turn in range(FLASH_REPEATS):
            for setting in [s for s in FLASH_ATTENTION if s not in failed]:
                try:
                    server = pool.get(replace(config, flash_attention=setting))
                    if turn == 0:
                        server.complete(WARMUP_PROMPT, 8)
                    timings[setting].append(
                        server.complete(FLASH_PROMPT, SWEEP_TOKENS, temperature, seed=turn)
                    )
                except LlamaServerError as error:
                    print(f"peers: llama-server -fa {setting} failed: {error}", file=sys.stderr)
                    failed.add(setting)
    finally:
        pool.close()
    speeds = decode_speeds(timings, failed)
    return (max(speeds, key=speeds.__getitem__) if speeds else None), speeds


ALL_LAYERS = 999  # -ngl: every layer on the GPU


def llama_server_peers(
    pool: ServerPool,
    threads: int,
    target: Path,
    draft: Path,
    *,
    skipped: dict,
    info: dict,
    gpu: bool = False,
    temperature: float = 0.0,
) -> list[Peer]:
    """llama-server alone, at its default draft length and at the sweep's best (run now),
    every row with the faster flash-attention setting (``pick_flash_attention``, run first);
    ``info`` gets the binary and both choices' figures. With ``gpu`` (a CUDA build) the target
    is on the GPU, and the speculative rows come twice: the draft on the GPU (llama.cpp's
    usual set-up) and on the CPU (DuoDecoding's placement), each at its own best length;
    a 16-bit GGUF beside ``target`` (``*-f16.gguf``) adds a target-alone row at hetspec's
    own precision. Every row samples at ``temperature`` (0: greedy), the sweep too."""
    shared: dict = {"gpu_layers": ALL_LAYERS} if gpu else {}
    flash, speeds = pick_flash_attention(
        pool.binary, ServerConfig(target, threads=threads, **shared), temperature
    )
    info["flash_attention"] = {"chosen": flash, **{k: round(v, 1) for k, v in speeds.items()}}
    shared["flash_attention"] = flash
    alone = ServerConfig(target, threads=threads, **shared)
    peers: list[Peer] = [LlamaServerPeer("llama-server target alone", alone, pool, temperature)]
    if gpu:
        half = sorted(target.parent.glob("*-f16.gguf"))
        if half and half[0] != target:
            config = ServerConfig(half[0], threads=threads, **shared)
            peers.append(
                LlamaServerPeer("llama-server target alone (F16)", config, pool, temperature)
            )
    placements = {"": {}}
    if gpu:  # where the draft computes: its suffix in the rows' names and its -ngld
        placements = {
            " (draft on GPU)": {"draft_gpu_layers": ALL_LAYERS},
            " (draft on CPU)": {"draft_gpu_layers": 0},
        }
    info.update(
        binary=str(pool.binary),
        sweep_prompts=len(SWEEP_PROMPTS),
        sweep_tokens=SWEEP_TOKENS,
        sweep_min_decode_ms=SWEEP_MIN_MS,
    )
    for suffix, where in placements.items():
        speculative = ServerConfig(target, draft, threads=threads, **shared, **where)
        peers.append(
            LlamaServerPeer(
                f"llama-server speculative (default n-max){suffix}", speculative, pool, temperature
            )
        )
        speeds = sweep_n_max(
            pool.binary, speculative, servers_that_fit([target, draft], 6), temperature
        )
        info[f"sweep{suffix}"] = {str(n): round(v, 1) for n, v in speeds.items()}
        if speeds:
            best = max(speeds, key=speeds.__getitem__)
            info[f"best_n_max{suffix}"] = best
            config = replace(speculative, n_max=best)
            # its minimum draft probability: 0 (the default since) or 0.75 (the old default)
            by_p_min = sweep(
                pool.binary,
                {p: replace(config, p_min=p) for p in SWEEP_P_MIN},
                servers_that_fit([target, draft], 2),
                temperature,
            )
            info[f"sweep_p_min{suffix}"] = {str(p): round(v, 1) for p, v in by_p_min.items()}
            p_min = max(by_p_min, key=by_p_min.__getitem__) if by_p_min else None
            config = replace(config, p_min=p_min)
            peers.append(
                LlamaServerPeer(
                    f"llama-server speculative n-max={best} p-min={p_min}{suffix}",
                    config,
                    pool,
                    temperature,
                )
            )
        else:
            skipped[f"llama-server speculative n-max=N{suffix}"] = (
                "no draft length of the sweep would run"
            )
    return peers


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False where torch is missing)."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return torch.cuda.is_available()


def llama_cpp_offloads() -> bool:
    """Whether the installed llama-cpp-python sees a GPU of this machine (its own
    ``llama_supports_gpu_offload`` also says yes for a CPU build with the RPC backend)."""
    try:
        from hetspec.workers.runtimes.llama_cpp_runtime.ggml import local_gpu_present  # noqa: PLC0415
    except ImportError:
        return False
    return local_gpu_present()


def assisted_peer(
    args: argparse.Namespace, gpu: bool, skipped: dict[str, str]
) -> list[tuple[str, Callable[[], Peer]]]:
    """transformers' assisted generation, where the pair has model folders."""
    name = "transformers assisted"
    if not (args.target_folder and args.draft_folder):
        skipped[name] = "it loads model folders, and the pair is given as GGUF files only"
        return []
    return [
        (
            name,
            lambda: TransformersAssisted(
                args.threads,
                args.target_folder,
                args.draft_folder,
                gpu=gpu,
                temperature=args.temperature,
            ),
        )
    ]


def load_peers(
    args: argparse.Namespace, stack: ExitStack, skipped: dict[str, str], info: dict
) -> list[Peer]:
    """Every peer that can be had, warmed up; the others go to ``skipped`` with one line why.
    With ``args.gpu`` ("auto": where torch sees CUDA) the peers compute on the GPU."""
    gpu = cuda_available() if args.gpu == "auto" else args.gpu == "on"
    candidates = assisted_peer(args, gpu, skipped)
    loop = "llama-cpp-python loop speculative gamma=4"
    if args.temperature > 0:
        skipped[loop] = "greedy only (it verifies by the target's argmax)"
    elif gpu and not llama_cpp_offloads():
        skipped[loop] = "the installed llama-cpp-python cannot offload to the GPU (a CPU build)"
    else:
        candidates.insert(
            0,
            (
                loop,
                lambda: LlamaCppSpeculative(
                    args.threads, args.target_gguf, args.draft_gguf, gpu_layers=-1 if gpu else 0
                ),
            ),
        )
    if args.llama_server == "off":
        skipped["llama-server"] = "turned off (--llama-server off)"
    else:
        try:
            if args.llama_server == "build":
                binary = find_llama_server(build=True, backend="cuda" if gpu else "cpu")
            else:
                binary = Path(args.llama_server).expanduser()
                if not (binary.is_file() and os.access(binary, os.X_OK)):
                    raise LlamaServerUnavailable(f"{binary} is not an executable file")
            models = [args.target_gguf, args.draft_gguf]
            pool = ServerPool(binary, servers_that_fit(models, 3))
            stack.callback(pool.close)
            peers = llama_server_peers(
                pool,
                args.threads,
                *models,
                skipped=skipped,
                info=info,
                gpu=gpu,
                temperature=args.temperature,
            )
            candidates += [(peer.name, lambda peer=peer: peer) for peer in peers]
        except (LlamaServerUnavailable, LlamaServerError) as error:
            skipped["llama-server"] = str(error)
    loaded = []
    for name, make in candidates:
        try:
            peer = make()
            peer.run(WARMUP_PROMPT, 8, 0)
        except Exception as error:  # a peer that fails is reported, not fatal to the others
            said = str(error).strip().splitlines()
            skipped[name] = f"{type(error).__name__}: {said[0] if said else ''}"[:300]
            print(f"peers: skipping {name}: {skipped[name]}", file=sys.stderr)
            continue
        loaded.append(peer)
    return loaded


def serve(args: argparse.Namespace, requests: TextIO, replies: TextIO) -> None:
    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    skipped: dict[str, str] = {}
    info: dict = {}
    with ExitStack() as stack:
        peers = {peer.name: peer for peer in load_peers(args, stack, skipped, info)}
        reply({"systems": list(peers), "skipped": skipped, "llama_server": info})
        for line in requests:
            try:
                request = json.loads(line)
                peer = peers[request["system"]]
                result = peer.run(request["prompt"], request["max_tokens"], request.get("seed"))
            except (ValueError, KeyError, TypeError, LlamaServerError) as error:
                reply({"error": f"bad request {line.strip()[:200]!r}: {error!r}"})
                continue
            reply({**result, "tokens": request["max_tokens"]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--target-gguf",
        type=Path,
        default=TARGET_GGUF,
        help="the target for llama.cpp (default: the bundled one)",
    )
    parser.add_argument(
        "--draft-gguf",
        type=Path,
        default=DRAFT_GGUF,
        help="the draft for llama.cpp (default: the bundled one)",
    )
    parser.add_argument(
        "--target-folder",
        type=str,
        default=str(MODELS / "target"),
        help="the target for transformers (default: the bundled one)",
    )
    parser.add_argument(
        "--draft-folder",
        type=str,
        default=str(MODELS / "draft"),
        help="the draft for transformers (default: the bundled one)",
    )
    parser.add_argument(
        "--llama-server",
        default="build",
        help="llama.cpp's own server: a path to the binary, 'build' (the cached build, made "
        "on first use by native/build-llama-server.sh; the default) or 'off'",
    )
    parser.add_argument(
        "--gpu",
        choices=["auto", "on", "off"],
        default="auto",
        help="peers on the GPU: llama-server's CUDA build with every layer "
        "offloaded, transformers on CUDA in bf16 (default auto: where torch "
        "sees CUDA)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every system at this temperature (default 0: greedy)",
    )
    args = parser.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0, not {args.temperature}")
    try:
        serve(args, sys.stdin, sys.stdout)
    except BrokenPipeError:  # the bench that asked is gone: nothing left to answer
        sys.stdout = None  # (interpreter exit would flush to the closed pipe again)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
