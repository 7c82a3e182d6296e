"""hetspec bench end to end, small: its own daemon, every system, the reports it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_runs_every_system_and_writes_its_reports(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "hetspec.client.cli", "bench", "--prompts", "1",
               "--repeats", "1", "--warmup", "1", "--max-tokens", "12", "--gammas", "2",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    table = (out / "bench.md").read_text()
    for system in ("autoregressive", "sequential", "parallel gamma=2", "adaptive",
                   "transformers assisted", "llama.cpp speculative gamma=4"):  # fmt: skip
        assert f"| {system} |" in table, (system, table, done.stderr)
    assert "a busy process on the drafter's core" in table
    document = json.loads((out / "bench.json").read_text())
    records = document["draft-cpu"]["records"]
    assert {r["system"] for r in records} >= {"adaptive", "transformers assisted"}
    assert all(r["tokens"] == 12 and r["decode_ms"] > 0 for r in records)
    assert (out / "bench.png").stat().st_size > 0
