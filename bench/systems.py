"""The systems ``hetspec bench`` compares: hetspec's modes on its daemon, and the peers, which
run in a process of their own (``hetspec.bench.peers``).

Contract: a ``System`` is one row of the tables: a daemon mode with its request options, or a
peer (``peer`` set: its requests go to that process instead of the daemon). ``Peers`` starts
the peers' process and asks it one request at a time, so that the peers' requests interleave
with hetspec's; each answer is a ``Record`` as a daemon request's is. A peers' process that
ends, or answers with an error, raises ``HetspecError`` with what it said.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hetspec.bench.records import Record, token_digest
from hetspec.bench.targets import BenchTarget
from hetspec.client.types import HetspecError


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
