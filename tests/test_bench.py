"""hetspec bench end to end, small: its own daemon, every system, the reports it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetspec.bench import compare as bench
from hetspec.bench.busy_box import busy_note
from hetspec.bench.compare import BusyCore


@pytest.mark.process
def test_bench_runs_every_system_and_writes_its_reports(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "hetspec.client.cli",
        "bench",
        "--prompts",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--max-tokens",
        "12",
        "--gammas",
        "2",
        "--llama-server",
        "off",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    table = (out / "bench.md").read_text()
    systems = (
        "autoregressive",
        "sequential",
        "parallel gamma=2",
        "adaptive",
        "transformers assisted",
        "llama-cpp-python loop speculative gamma=4",
    )
    for system in systems:
        assert f"| {system} |" in table, (system, table, done.stderr)
    assert "a busy process on the drafter's core" in table
    assert "so far" not in table  # the finished tables replace the ones written as it went
    rounds = table.split("where a round goes")[1]
    assert "| parallel gamma=2 |" in rounds  # it drafts every round
    parallel = next(line for line in rounds.splitlines() if line.startswith("| parallel"))
    assert parallel.split("|")[4].strip() == "0%"  # of one branch: no round is branched
    document = json.loads((out / "bench.json").read_text())
    records = document["bundled draft-cpu"]["records"]
    assert {r["system"] for r in records} >= {"adaptive", "transformers assisted"}
    assert all(r["tokens"] == 12 and r["decode_ms"] > 0 for r in records)
    assert (out / "bench.png").stat().st_size > 0
    # progress on stderr says how many prompts of each kind and one line per table; the
    # tables themselves are printed once, with the report
    assert "1 code + 4 chat prompts" in done.stderr
    assert "x the fastest target alone" in done.stderr
    assert "| system |" not in done.stderr
    assert done.stdout.count("| autoregressive |") == 1


@pytest.mark.process
def test_bench_help_shows_defaults_and_bad_numbers_are_one_line_errors() -> None:
    def bench(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hetspec.client.cli", "bench", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    shown = bench("--help")
    assert shown.returncode == 0
    assert "``" not in shown.stdout
    for default in (
        "(default 2,4,6)",
        "(default 12)",
        "(default 128)",
        "(default 3)",
        "(default 4)",
        "chat prompts are always added",
    ):
        assert default in " ".join(shown.stdout.split()), default
    for args, said in [
        (("--prompts", "0"), "must be at least 1: '0'"),
        (("--set", "gpu_runtime"), "not KEY=VALUE"),
        (("--running", "--set", "gamma=3"), "not to a running one"),
        (("--gammas", "2,x"), "not a whole number: 'x'"),
        (("--warmup", "-1"), "must be at least 0: '-1'"),
        (("--temperature", "-0.5"), "must be at least 0: '-0.5'"),
        (("--temperature", "inf"), "a finite number, not 'inf'"),
    ]:
        done = bench(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert said in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


@pytest.mark.process
def test_bench_sweeps_targets_and_skips_a_bad_one_with_its_reason(tmp_path: Path) -> None:
    """Two targets (the bundled one, and a folder of the user's: the same model), one that
    cannot be had: a table per target, the speedup sweep, one line for the skipped one."""
    out = tmp_path / "bench"
    user_target = Path(__file__).resolve().parents[1] / "models" / "target"
    command = [
        sys.executable,
        "-m",
        "hetspec.client.cli",
        "bench",
        "--prompts",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--max-tokens",
        "8",
        "--gammas",
        "2",
        "--no-load",
        "--no-peers",
        "--target",
        f"bundled,heavy-7q,{user_target}",
        "--set",
        'gpu_runtime="torch"',
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    table = (out / "bench.md").read_text()
    assert "## heavy-7q: skipped" in table
    assert "cannot read size '7q'" in done.stderr
    assert "Traceback" not in done.stderr
    assert "### bundled draft-cpu: modes (the GPU worker in torch)" in table  # --set
    assert "### target draft-cpu: modes (the GPU worker in torch)" in table
    assert "## Speedup against the cost ratio c" in table
    assert "x fastest target alone" in table
    assert (out / "bench-sweep.png").stat().st_size > 0


def test_a_heavy_target_of_an_unknown_gguf_type_is_one_clear_error(tmp_path: Path) -> None:
    from hetspec.bench.targets import TargetError, resolve  # noqa: PLC0415

    with pytest.raises(TargetError, match="heavy-100m-q4_k_s: unknown GGUF type 'q4_k_s'"):
        resolve("heavy-100m-q4_k_s", None, str(tmp_path))
    assert not any(tmp_path.iterdir())  # refused before anything was built


@pytest.mark.process
def test_sampled_bench_keeps_each_prompts_seed_so_every_mode_makes_the_same_tokens(
    tmp_path: Path,
) -> None:
    """At a temperature every system samples prompt i with the seed SEED_BASE + i: hetspec's
    modes then produce the target alone's tokens (same seed, same text), which the table's
    last column checks; unseeded, outputs are not compared."""

    def bench(out: Path, *extra: str) -> str:
        command = [
            sys.executable,
            "-m",
            "hetspec.client.cli",
            "bench",
            "--prompts",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--max-tokens",
            "24",
            "--gammas",
            "3",
            "--no-load",
            "--no-peers",
            "--temperature",
            "0.9",
            *extra,
            "--out",
            str(out),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr
        return (out / "bench.md").read_text()

    seeded = bench(tmp_path / "seeded")
    assert "sampled at temperature 0.9 (no top-k, top-p or min-p), prompt i seeded 1000 + i" in (
        seeded
    )
    for system in ("autoregressive", "sequential", "parallel gamma=3", "adaptive"):
        row = next(line for line in seeded.splitlines() if line.startswith(f"| {system} |"))
        assert row.endswith("| 5/5 |"), row  # 1 code + 4 chat prompts
    unseeded = bench(tmp_path / "unseeded", "--unseeded")
    assert "sampled at temperature 0.9 (no top-k, top-p or min-p), unseeded" in unseeded
    row = next(line for line in unseeded.splitlines() if line.startswith("| adaptive |"))
    assert row.endswith("| - |"), row


@pytest.mark.process
def test_a_busy_core_is_named_with_the_process_that_keeps_it_busy() -> None:
    """Before it starts, the bench says which of its cores another process keeps busy."""
    core = min(os.sched_getaffinity(0))
    busy = BusyCore(core)
    busy.start()
    try:
        pid = busy.process.pid
        note = busy_note({core}, sample_s=0.5)
    finally:
        busy.stop()
    assert note is not None
    assert f"core {core} " in note
    assert f"(pid {pid})" in note
    assert busy_note(set(), sample_s=0.1) is None  # no core of its own to look at


def test_the_report_says_what_llama_server_was_set_to_and_why() -> None:
    """The peers' measured choices (flash attention, draft length by placement) in one line;
    nothing without llama-server."""
    info = {
        "flash_attention": {"chosen": "off", "on": 24.5, "off": 32.7},
        "sweep": {"1": 40.0, "3": 48.9},
        "best_n_max": 3,
        "sweep_p_min": {"0.0": 45.0, "0.75": 50.1},
        "sweep (draft on CPU)": {"2": 51.0},
        "best_n_max (draft on CPU)": 2,
    }
    line = bench.llama_server_settings(info)
    assert line == (
        "llama-server's settings, measured: flash attention off (decode tokens/s of the target "
        "alone after a long prompt: on 24.5, off 32.7); draft length 3 (decode tokens/s by "
        "n-max: 1 40.0, 3 48.9); minimum draft probability 0.75 at that length (decode "
        "tokens/s by p-min: 0.0 45.0, 0.75 50.1); draft length 2 (draft on CPU) (decode "
        "tokens/s by n-max: 2 51.0).\n"
    )
    assert bench.llama_server_settings({}) == ""


def test_a_bench_cut_short_keeps_the_modes_of_the_prompts_it_finished(tmp_path: Path) -> None:
    """After each prompt every system has run, the report holds the modes table so far (a
    device call's time limit may end the bench before its tables)."""
    records = [
        bench.Record(
            system, prompt, 0, False, tokens=16, decode_ms=ms, ttft_ms=5.0, output=f"p{prompt}"
        )
        for prompt in range(2)
        for system, ms in (("autoregressive", 40.0), ("sequential", 20.0))
    ]
    results: dict = {}
    bench.write_so_far(
        records,
        out=tmp_path,
        report=["# hetspec bench", ""],
        results=results,
        heading="### bundled draft-cpu: modes",
        total=8,
    )
    table = (tmp_path / "bench.md").read_text()
    assert table.startswith("# hetspec bench")
    assert "### bundled draft-cpu: modes, so far: 2 of 8 requests a system" in table
    sequential = next(line for line in table.splitlines() if line.startswith("| sequential |"))
    assert sequential.split("|")[2].strip() == "750.0"  # the 15 after the first in 20 ms
    assert sequential.split("|")[3].strip() == "750.0-750.0"  # one pass: its own range
    assert sequential.split("|")[4].strip() == "2.00"  # x the target alone's 375
    assert (tmp_path / "bench.json").exists()


def test_a_peers_acceptance_and_tokens_are_kept_and_compared() -> None:
    """llama-server's draft_n_accepted / draft_n is shown, its tokens are compared with
    hetspec's target alone, and each row's passes give a median and a range."""

    def record(system: str, repeat: int, ms: float, output: str, **more) -> bench.Record:
        return bench.Record(
            system, 0, repeat, False, tokens=17, decode_ms=ms, ttft_ms=5.0, output=output, **more
        )

    records = [record("autoregressive", r, ms, "same") for r, ms in enumerate((40.0, 32.0, 50.0))]
    records += [
        record("sequential", r, 20.0, "same", rounds=4, accepted=12, drafted=16) for r in range(3)
    ]
    records += [
        record(
            "llama-server speculative n-max=4 p-min=0.0", r, 16.0, digest, accepted=9, drafted=12
        )
        for r, digest in enumerate(("same", "same", "other"))
    ]
    table, summaries, fastest = bench.modes_table(records)
    assert fastest == "autoregressive"
    alone = summaries["autoregressive"]
    assert alone["tokens_per_s"] == 400.0  # the median of 400, 500 and 320
    assert alone["tokens_per_s_range"] == (320.0, 500.0)
    peer = summaries["llama-server speculative n-max=4 p-min=0.0"]
    assert peer["acceptance"] == 0.75
    assert peer["same_as_alone"] == (2, 3)
    row = next(line for line in table.splitlines() if line.startswith("| llama-server"))
    cells = [cell.strip() for cell in row.split("|")]
    assert cells[3] == "1000.0-1000.0"
    assert cells[7] == "75%"
    assert cells[-2] == "2/3"
