"""native/gpu-pick-settings.py reads what bench_verify writes and says what the daemon's
--set takes: the GPU session's quick call hands its choice to the full call this way, with
no one there to fix a mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_reference, save_reference

from hetspec.bench import roundtrip as bench_roundtrip
from hetspec.bench import torch_verify as bench_verify
from hetspec.daemon.cli import overrides_from
from hetspec.daemon.config import load_config
from hetspec.workers.runtimes.torch_runtime import static_forward

pytestmark = pytest.mark.process

PICKER = Path(__file__).resolve().parents[1] / "native" / "gpu-pick-settings.py"


def picked(folder: Path, *flags: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, str(PICKER), *flags, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip(), done.stderr


def daemon_config(settings: str):
    """The settings as gpu-checks.sh passes them: split at spaces, one --set each."""
    args = type(
        "Args",
        (),
        {
            "set": settings.split(),
            "socket": None,
            "runtime_dir": None,
            "placement": None,
            "log_level": None,
            "log_format": None,
        },
    )
    return load_config(overrides=overrides_from(args), environ={})


def test_the_fastest_invariant_table_becomes_daemon_settings(tmp_path, monkeypatch) -> None:
    for module in (static_forward, bench_verify):  # the invariance chain crosses span 16's end
        monkeypatch.setattr(module, "MIN_SPAN", 16)
    model = save_reference(build_reference("qwen3"), tmp_path / "m")
    out = tmp_path / "out"
    out.mkdir()
    cublas = out / "verify-1b-fixed16.json"
    arguments = [
        "--model",
        str(model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--fixed-width",
        "4",
        "--contexts",
        "20",
        "--widths",
        "1,4,16",
        "--repeats",
        "2",
        "--invariance",
        "--json",
        str(cublas),
    ]
    assert bench_verify.main(arguments) == 0
    table = json.loads(cublas.read_text())
    assert len(table["invariance"]) == 4  # widths 1, 4, 16 and the 4 x 4 tree
    assert not sum(row["rows_differ"] for row in table["invariance"])
    assert table["compile"] is False

    # only the default's table: nothing to set
    assert picked(out)[0] == ""

    # a faster Triton table with a tiling of its own wins, and the daemon reads its settings
    triton = {**table, "matmul": "triton", "matmul_tiling": {"block_n": 32, "warps": 8}}
    triton["rows"] = [{**row, "median_ms": row["median_ms"] / 2} for row in table["rows"]]
    (out / "verify-1b-fixed16-triton.json").write_text(json.dumps(triton))
    settings, reasons = picked(out)
    assert settings == 'gpu_worker.matmul="triton" gpu_worker.matmul_tiling={block_n=32,warps=8}'
    assert "chosen" in reasons
    gpu_worker = daemon_config(settings).gpu_worker
    assert gpu_worker.matmul == "triton"
    assert (gpu_worker.matmul_tiling.block_n, gpu_worker.matmul_tiling.warps) == (32, 8)

    # a faster compiled table whose rows changed bits is passed over
    compiled = {**triton, "compile": True, "matmul": "torch", "matmul_tiling": {}}
    compiled["rows"] = [{**row, "median_ms": row["median_ms"] / 4} for row in table["rows"]]
    compiled["invariance"] = [{**row, "rows_differ": 1} for row in table["invariance"]]
    (out / "verify-1b-fixed16-compiled.json").write_text(json.dumps(compiled))
    assert picked(out)[0].startswith('gpu_worker.matmul="triton"')
    compiled["invariance"] = table["invariance"]
    (out / "verify-1b-fixed16-compiled.json").write_text(json.dumps(compiled))
    settings, _ = picked(out)
    assert settings == "gpu_worker.compile=true"
    assert daemon_config(settings).gpu_worker.compile is True

    # split attention, timed on chains and trees: its slowest 16 rows count with its T(1)
    split = out / "verify-1b-fixed16-split.json"
    assert (
        bench_verify.main(
            [*arguments[:-1], str(split), "--attention", "split", "--shape", "chain,tree"]
        )
        == 0
    )
    table = json.loads(split.read_text())
    assert table["attention"] == "split"
    assert {row["shape"] for row in table["rows"]} == {"chain", "tree"}
    assert not sum(row["rows_differ"] for row in table["invariance"])
    fastest = min(row["median_ms"] for row in compiled["rows"])
    table["rows"] = [{**row, "median_ms": fastest / 4} for row in table["rows"]]
    split.write_text(json.dumps(table))
    settings, reasons = picked(out)
    assert settings == 'gpu_worker.attention="split"'
    assert daemon_config(settings).gpu_worker.attention == "split"
    tree = next(row for row in table["rows"] if row["shape"] == "tree" and row["width"] == 16)
    tree["median_ms"] = 1000.0  # trees slow: back to the compiled forwards
    split.write_text(json.dumps(table))
    assert picked(out)[0] == "gpu_worker.compile=true"


def test_a_tables_own_description_says_how_its_verifier_runs(tmp_path) -> None:
    """Compiled around the Triton matmul with a tiling: all three settings; int8 weights:
    another model's logits, never the pick however fast."""
    rows = [{"width": 1, "median_ms": 2.0}, {"width": 16, "median_ms": 2.1}]
    invariance = [{"width": 16, "rows_differ": 0}]
    (tmp_path / "verify-1b-fixed16.json").write_text(
        json.dumps({"rows": rows, "invariance": invariance, "compile": False, "matmul": "torch"})
    )
    faster = [{**row, "median_ms": row["median_ms"] / 2} for row in rows]
    compiled = {
        "rows": faster,
        "invariance": invariance,
        "compile": True,
        "matmul": "triton",
        "matmul_tiling": {"block_n": 32},
    }
    (tmp_path / "verify-1b-fixed16-compiled.json").write_text(json.dumps(compiled))
    settings, _ = picked(tmp_path)
    assert settings == (
        'gpu_worker.compile=true gpu_worker.matmul="triton" gpu_worker.matmul_tiling={block_n=32}'
    )
    gpu_worker = daemon_config(settings).gpu_worker
    assert (gpu_worker.compile, gpu_worker.matmul, gpu_worker.matmul_tiling.block_n) == (
        True,
        "triton",
        32,
    )
    (tmp_path / "verify-1b-fixed16-compiled.json").write_text(
        json.dumps({**compiled, "weights": "int8"})
    )
    settings, reasons = picked(tmp_path)
    assert settings == ""
    assert "int8 weights, passed over" in reasons
    # compiled with split attention, faster still: all of it
    split = {
        **compiled,
        "attention": "split",
        "rows": [{**row, "median_ms": row["median_ms"] / 4} for row in rows],
    }
    (tmp_path / "verify-1b-fixed16-compiled-split.json").write_text(json.dumps(split))
    settings, _ = picked(tmp_path)
    assert settings.endswith('gpu_worker.attention="split"')
    assert daemon_config(settings).gpu_worker.attention == "split"
    assert daemon_config(settings).gpu_worker.compile is True


def test_a_table_whose_triton_kernel_was_refused_is_passed_over(tmp_path) -> None:
    """Its rows are cuBLAS's (the worker fell back at load), whatever they say."""
    rows = [{"width": 1, "median_ms": 2.0}, {"width": 16, "median_ms": 2.1}]
    invariance = [{"width": 16, "rows_differ": 0}]
    default = {"rows": rows, "invariance": invariance}
    (tmp_path / "verify-1b-fixed16.json").write_text(json.dumps(default))
    faster = [{**row, "median_ms": row["median_ms"] / 2} for row in rows]
    triton = {"rows": faster, "invariance": invariance, "matmul": "triton"}
    (tmp_path / "verify-1b-fixed16-triton.json").write_text(json.dumps(triton))
    assert picked(tmp_path)[0] == 'gpu_worker.matmul="triton"'
    triton["matmul_refused"] = "its sums differ from torch's by 9 (of 1)"
    (tmp_path / "verify-1b-fixed16-triton.json").write_text(json.dumps(triton))
    settings, reasons = picked(tmp_path)
    assert settings == ""
    assert "the Triton kernel refused (its sums differ" in reasons


def test_the_tiling_comes_from_bench_matmuls_table(tmp_path) -> None:
    document = {
        "rows": [{"shape": "q", "a invariant": True, "b invariant": False}],
        "forward_us": {"a rows 16": 900.0, "b rows 16": 500.0, "default rows 16": 1000.0},
        "tilings": {"a": {"block_n": 32, "warps": 8}, "b": {"block_k": 64}, "default": {}},
    }
    (tmp_path / "matmul.json").write_text(json.dumps(document))
    tiling, reasons = picked(tmp_path, "--tiling")
    assert tiling == "block_n=32,warps=8"  # b is faster but changed a row's bits
    assert "rows changed" in reasons
    assert picked(tmp_path / "absent", "--tiling")[0] == ""  # the default, said on stderr
    # another table (bench_matmul --weights int8's) named after the folder
    int8 = {**document, "forward_us": {**document["forward_us"], "default rows 16": 400.0}}
    (tmp_path / "matmul-int8.json").write_text(json.dumps(int8))
    done = subprocess.run(
        [sys.executable, str(PICKER), "--tiling", str(tmp_path), "matmul-int8.json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == ""  # the default is the fastest there
    assert "chosen tiling: the default (400.0 us)" in done.stderr


def test_a_compiled_verifier_runs_the_triton_matmul_where_it_beats_cublas(tmp_path) -> None:
    document = {
        "rows": [{"shape": "q", "a invariant": True, "b invariant": False}],
        "forward_us": {"a rows 16": 900.0, "b rows 16": 500.0, "cuBLAS rows 16": 950.0},
        "tilings": {"a": {"block_n": 32}, "b": {"block_k": 64}},
    }
    (tmp_path / "matmul.json").write_text(json.dumps(document))
    assert picked(tmp_path, "--compiled-matmul")[0] == "triton"  # a's 900 us: b changed bits
    document["forward_us"]["cuBLAS rows 16"] = 800.0
    (tmp_path / "matmul.json").write_text(json.dumps(document))
    matmul, reasons = picked(tmp_path, "--compiled-matmul")
    assert matmul == "torch"
    assert "cuBLAS: 800.0 us a forward" in reasons
    assert picked(tmp_path / "absent", "--compiled-matmul")[0] == "torch"


def test_the_worker_polls_through_a_calls_gap_where_its_wake_up_costs_more(tmp_path) -> None:
    """bench_roundtrip's own tables (a worker woken for every call, one polling 2000 us),
    written by the quick call: the full call's daemon polls where that saves >= 25 us a call,
    beside the verifier the tables chose."""
    written = tmp_path / "written.json"
    arguments = [
        "--floats",
        "16",
        "--count",
        "40",
        "--turns",
        "1",
        "--gap-us",
        "300",
        "--json",
        str(written),
    ]
    cores = os.sched_getaffinity(0)
    assert bench_roundtrip.main(arguments) == 0
    assert os.sched_getaffinity(0) == cores  # the later tests' cores
    table = json.loads(written.read_text())
    assert table["spin_us"] == 100.0
    assert table["median_us"]["mailboxes, message frames"] > 0

    def tables(woken_us: float, polling_us: float) -> None:
        for spin, us in ((100, woken_us), (2000, polling_us)):
            document = {
                **table,
                "spin_us": float(spin),
                "median_us": {**table["median_us"], "mailboxes, message frames": us},
            }
            (tmp_path / f"roundtrip-spin{spin}.json").write_text(json.dumps(document))

    rows = [{"width": 1, "median_ms": 2.0}, {"width": 16, "median_ms": 2.1}]
    triton = {"rows": rows, "invariance": [{"width": 16, "rows_differ": 0}], "matmul": "triton"}
    (tmp_path / "verify-1b-fixed16-triton.json").write_text(json.dumps(triton))
    tables(woken_us=180.0, polling_us=60.0)
    settings, reasons = picked(tmp_path)
    assert settings == 'gpu_worker.matmul="triton" worker_spin_us=2000'
    assert "120.0 us saved" in reasons
    assert daemon_config(settings).worker_spin_us == 2000
    tables(woken_us=70.0, polling_us=60.0)  # a wake-up costs little here: no polling
    assert picked(tmp_path)[0] == 'gpu_worker.matmul="triton"'
    (tmp_path / "verify-1b-fixed16-triton.json").unlink()
    tables(woken_us=180.0, polling_us=60.0)
    assert picked(tmp_path)[0] == "worker_spin_us=2000"  # the default verifier, polling


def test_the_daemon_polls_for_replies_where_its_own_wake_up_costs_more(tmp_path) -> None:
    """bench_roundtrip with the worker computing each answer and the daemon polling for it
    (the quick call's last two round-trip tables): the full call's daemon polls where that
    saves >= 25 us a call, and the setting is one the daemon takes."""
    written = tmp_path / "written.json"
    arguments = [
        "--floats",
        "16",
        "--count",
        "40",
        "--turns",
        "1",
        "--gap-us",
        "300",
        "--spin-us",
        "2000",
        "--hold-us",
        "300",
        "--daemon-spin-us",
        "5000",
        "--json",
        str(written),
    ]
    assert bench_roundtrip.main(arguments) == 0
    table = json.loads(written.read_text())
    assert (table["hold_us"], table["daemon_spin_us"]) == (300.0, 5000.0)
    link = table["median_us"]["mailboxes, message frames"]
    assert 0 < link < 300  # the hold is not counted

    def tables(sleeping_us: float, polling_us: float) -> None:
        for name, us in (("roundtrip-hold", sleeping_us), ("roundtrip-hold-daemon", polling_us)):
            document = {
                **table,
                "median_us": {**table["median_us"], "mailboxes, message frames": us},
            }
            (tmp_path / f"{name}.json").write_text(json.dumps(document))

    tables(sleeping_us=123.0, polling_us=73.0)
    settings, reasons = picked(tmp_path)
    assert settings == "daemon_spin_us=5000"
    assert "50.0 us saved" in reasons
    assert daemon_config(settings).daemon_spin_us == 5000
    tables(sleeping_us=80.0, polling_us=70.0)  # the daemon wakes fast here: it sleeps
    assert picked(tmp_path)[0] == ""
