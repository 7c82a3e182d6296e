"""llama.cpp's own server as peers: its processes, the settings it is measured at, its rows.

Contract: ``llama_server_peers`` returns the llama-server rows of the bench (the target alone,
speculative decoding at the default draft length and at the best of a sweep run now), each a
``Peer`` (``library_peers``) that completes a prompt on a server of its configuration; the
servers run in a ``ServerPool`` that the caller closes. The sweeps' figures (decode tokens/s
by setting) go to ``info``, rows that cannot be had to ``skipped`` with one line why. The
sweeps' prompts are none of the bench's (they tune on them).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path

from hetspec.bench.library_peers import WARMUP_PROMPT, Peer
from hetspec.bench.llama_server import LlamaServer, LlamaServerError, ServerConfig, Timing

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
