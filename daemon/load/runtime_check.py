"""Ask each worker runtime to describe itself, in a process of its own.

Used by ``hetspecd --check`` (and later at start-up): the daemon learns what llama.cpp and torch
offer on this box without importing either.
"""

from __future__ import annotations

import subprocess
import sys

import msgspec

from hetspec.protocol import (
    LlamaCppReport,
    ProbeFailure,
    RuntimeReport,
    TorchReport,
    decode_runtime_report,
)

RUNTIMES = ("llama.cpp", "torch")


def check_runtime(runtime: str, timeout_s: float = 120.0) -> RuntimeReport:
    """Probe one runtime (blocking); a probe that crashes or hangs becomes a ProbeFailure."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hetspec.workers.tools.probe", runtime],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return _collect(runtime, process, timeout_s)


def check_runtimes(timeout_s: float = 120.0) -> dict[str, RuntimeReport]:
    """Probe every runtime concurrently; a probe that crashes or hangs becomes a ProbeFailure."""
    probes = {
        runtime: subprocess.Popen(
            [sys.executable, "-m", "hetspec.workers.tools.probe", runtime],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for runtime in RUNTIMES
    }
    return {runtime: _collect(runtime, process, timeout_s) for runtime, process in probes.items()}


def _collect(runtime: str, process: subprocess.Popen[bytes], timeout_s: float) -> RuntimeReport:
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return ProbeFailure(runtime=runtime, message=f"probe hung for more than {timeout_s:g} s")
    if process.returncode != 0:
        last_line = (stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return ProbeFailure(
            runtime=runtime, message=f"probe exited with {process.returncode}: {last_line}"
        )
    try:
        return decode_runtime_report(stdout)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return ProbeFailure(runtime=runtime, message=f"probe answered garbage: {error}")


def _cores(cores: list[int]) -> str:
    return f"{len(cores)} core{'s' * (len(cores) != 1)} ({','.join(map(str, cores))})"


def describe(report: RuntimeReport) -> list[str]:
    """Human-readable lines for one report; warnings start with 'WARNING'."""
    match report:
        case LlamaCppReport():
            lines = [
                f"llama.cpp (CPU worker): llama-cpp-python {report.package_version}, "
                f"GPU offload {'built in' if report.gpu_offload else 'not built'}, "
                f"RPC {'built in' if report.rpc else 'not built'}, "
                f"{_cores(report.cores)}",
                f"  {report.system_info}",
            ]
            if report.missing_cpu_features:
                lines.append(
                    "WARNING llama.cpp was built without "
                    f"{', '.join(report.missing_cpu_features)}, which this CPU has: it will be "
                    "several times slower than it could be. Rebuild it with `make setup "
                    "LLAMA_REBUILD=1` (and SOURCE_DATE_EPOCH unset)."
                )
            return lines
        case TorchReport():
            device = (
                f"CUDA {report.cuda_version}, {', '.join(report.devices)}"
                if report.cuda_available
                else "no CUDA device: the GPU worker computes on the CPU"
            )
            return [
                f"torch (GPU worker): torch {report.torch_version}, {device}, "
                f"{report.threads} threads, {_cores(report.cores)}"
            ]
        case ProbeFailure():
            return [f"ERROR {report.runtime}: {report.message}"]
