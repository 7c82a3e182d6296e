"""`hetspecd --check`: each runtime describes itself from a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetspec.daemon.load.runtime_check import _collect, check_runtimes, describe
from hetspec.protocol import (
    LlamaCppReport,
    ProbeFailure,
    TorchReport,
    decode_runtime_report,
    encode_runtime_report,
)
from hetspec.workers.tools.probe import compiled_cpu_features, host_cpu_features

BIN = Path(sys.executable).parent

SYSTEM_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | "
    "LLAMAFILE = 1 | OPENMP = 1 |"
)


def test_compiled_features_are_those_set_to_one() -> None:
    assert compiled_cpu_features(SYSTEM_INFO) == {
        "SSE3",
        "SSSE3",
        "AVX",
        "AVX2",
        "F16C",
        "FMA",
        "LLAMAFILE",
        "OPENMP",
    }


def test_host_features_come_from_cpuinfo_flags() -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu pni ssse3 fma avx f16c avx2 avx512f bmi2 avx512_vnni\n"
    assert host_cpu_features(x86, "x86_64") == {
        "SSE3",
        "SSSE3",
        "FMA",
        "AVX",
        "F16C",
        "AVX2",
        "AVX512",
        "AVX512_VNNI",
    }
    client = "flags\t\t: fma avx f16c avx2 avx_vnni\n"  # Alder Lake: AVX-VNNI without AVX-512
    assert host_cpu_features(client, "x86_64") == {"FMA", "AVX", "F16C", "AVX2", "AVX_VNNI"}
    arm = "Features\t: fp asimd evtstrm aes\n"
    assert host_cpu_features(arm, "aarch64") == {"NEON"}
    assert host_cpu_features("", "x86_64") == set()


@pytest.mark.process
def test_this_box_runs_both_runtimes_and_llama_cpp_uses_every_simd_extension() -> None:
    reports = check_runtimes()
    llama, torch_report = reports["llama.cpp"], reports["torch"]
    assert isinstance(llama, LlamaCppReport), llama
    assert isinstance(torch_report, TorchReport), torch_report
    # A build with SOURCE_DATE_EPOCH set (or made for another CPU) lacks SIMD: catch it here.
    assert llama.missing_cpu_features == []
    assert llama.cores == torch_report.cores == sorted(os.sched_getaffinity(0))
    assert torch_report.torch_version.startswith("2.13.0")


@pytest.mark.gpu
def test_torch_probe_sees_the_cuda_device() -> None:
    report = check_runtimes()["torch"]
    assert isinstance(report, TorchReport)
    assert report.cuda_available
    assert report.devices


@pytest.mark.process
def test_hetspecd_check_prints_both_runtimes_and_the_gpu_workers_choice(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSPEC_")}
    env["HETSPEC_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [BIN / "hetspecd", "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("hetspecd ")
    assert any(line.startswith("llama.cpp (CPU worker): llama-cpp-python 0.3.") for line in lines)
    assert any(line.startswith("torch (GPU worker): torch 2.13.0") for line in lines)
    choice = [line for line in lines if line.startswith("draft-cpu: gpu_runtime ")]
    assert choice, lines
    assert "measured as verifier" in choice[0]
    assert "T(8)=" in choice[0]

    as_json = subprocess.run(
        [BIN / "hetspecd", "--check", "--json"],
        capture_output=True,
        timeout=300,
        check=True,
        env=env,
    )
    document = msgspec.json.decode(as_json.stdout)
    assert set(document["runtimes"]) == {"llama.cpp", "torch"}
    assert document["runtimes"]["torch"]["type"] == "torch"
    assert document["gpu_runtime"]["cached"]  # the first --check measured; this one reuses it
    assert document["gpu_runtime"]["runtime"] in choice[0]


@pytest.mark.process
def test_hetspecd_check_refuses_a_bad_configuration() -> None:
    result = subprocess.run(
        [BIN / "hetspecd", "--check", "--set", 'gpu_runtime="cuda"'],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "gpu_runtime" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.process
def test_a_hung_probe_becomes_a_failure_report() -> None:
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    report = _collect("torch", sleeper, timeout_s=0.5)
    assert report == ProbeFailure(runtime="torch", message="probe hung for more than 0.5 s")
    assert sleeper.poll() is not None, "the hung probe must be killed"


@pytest.mark.process
def test_a_crashing_or_garbled_probe_becomes_a_failure_report() -> None:
    crash = subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit('libfoo.so: cannot open shared object')"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    report = _collect("llama.cpp", crash, timeout_s=30)
    assert isinstance(report, ProbeFailure)
    assert report.message == "probe exited with 1: libfoo.so: cannot open shared object"

    garbled = subprocess.Popen(
        [sys.executable, "-c", 'print(\'{"type": "torch"}\')'],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    report = _collect("torch", garbled, timeout_s=30)
    assert isinstance(report, ProbeFailure)
    assert report.message.startswith("probe answered garbage: Object missing required field")
    assert describe(report) == [f"ERROR torch: {report.message}"]


@pytest.mark.process
def test_probe_rejects_an_unknown_runtime() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hetspec.workers.tools.probe", "tensorflow"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "usage: python -m hetspec.workers.tools.probe {llama.cpp|torch}"


def test_a_llama_build_without_simd_is_called_out() -> None:
    report = LlamaCppReport(
        package_version="0.3.36",
        system_info="CPU : SSE3 = 1 |",
        gpu_offload=False,
        missing_cpu_features=["AVX2", "FMA"],
        cores=[0, 1],
    )
    warning = describe(report)[-1]
    assert warning.startswith("WARNING llama.cpp was built without AVX2, FMA")
    assert "LLAMA_REBUILD=1" in warning


reports = st.one_of(
    st.builds(
        LlamaCppReport,
        package_version=st.text(),
        system_info=st.text(),
        gpu_offload=st.booleans(),
        missing_cpu_features=st.lists(st.text()),
        cores=st.lists(st.integers(0, 1023)),
    ),
    st.builds(
        TorchReport,
        torch_version=st.text(),
        cuda_available=st.booleans(),
        cuda_version=st.none() | st.text(),
        devices=st.lists(st.text()),
        bf16_supported=st.booleans(),
        threads=st.integers(1, 512),
        cores=st.lists(st.integers(0, 1023)),
    ),
    st.builds(ProbeFailure, runtime=st.text(), message=st.text()),
)


@given(reports)
def test_reports_round_trip_through_json(report: LlamaCppReport | TorchReport) -> None:
    assert decode_runtime_report(encode_runtime_report(report)) == report


def test_decoding_refuses_unknown_types_and_fields() -> None:
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'onnx'"):
        decode_runtime_report(b'{"type": "onnx"}')
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decode_runtime_report(b'{"type": "failure", "runtime": "x", "message": "y", "z": 1}')
