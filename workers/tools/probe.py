"""``python -m hetspec.workers.tools.probe {llama.cpp|torch}``: describe a worker runtime.

Prints exactly one JSON line on stdout, a ``hetspec.protocol`` runtime report, and exits 0 even
when the runtime cannot load (that is a ``ProbeFailure`` report, so the daemon can say why).
Runs in its own process so that importing torch or llama.cpp never touches the daemon.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

from hetspec.protocol import (
    LlamaCppReport,
    ProbeFailure,
    RuntimeReport,
    TorchReport,
    encode_runtime_report,
)

# llama.cpp's name for a SIMD extension -> the flag /proc/cpuinfo uses for it.
_X86_FEATURES = {
    "SSE3": "pni",
    "SSSE3": "ssse3",
    "AVX": "avx",
    "AVX2": "avx2",
    "F16C": "f16c",
    "FMA": "fma",
    "AVX512": "avx512f",
    # int8 dot products (vpdpbusd): what quantized matmuls gain most from
    "AVX_VNNI": "avx_vnni",
    "AVX512_VNNI": "avx512_vnni",
}
_ARM_FEATURES = {"NEON": "asimd"}


def owned_cores() -> list[int]:
    """The cores this process may run on (cgroup/affinity aware, unlike ``os.cpu_count``)."""
    return sorted(os.sched_getaffinity(0))


def host_cpu_features(cpuinfo: str, machine: str) -> set[str]:
    """llama.cpp-named SIMD extensions the host CPU offers, from /proc/cpuinfo text."""
    wanted = _ARM_FEATURES if machine in ("aarch64", "arm64") else _X86_FEATURES
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return {name for name, flag in wanted.items() if flag in flags}


def compiled_cpu_features(system_info: str) -> set[str]:
    """Extensions llama.cpp reports as enabled (``NAME = 1``) in its system info line."""
    return set(re.findall(r"\b([A-Z0-9_]+) = 1\b", system_info))


def probe_llama_cpp() -> RuntimeReport:
    try:
        import llama_cpp  # noqa: PLC0415 - importing it is what is being probed

        from hetspec.workers.runtimes.llama_cpp_runtime.ggml import local_gpu_present  # noqa: PLC0415
    except ImportError as error:
        return ProbeFailure(
            runtime="llama.cpp",
            message=f"llama-cpp-python is not importable ({error}); run `make setup`",
        )
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    missing = host_cpu_features(cpuinfo, platform.machine()) - compiled_cpu_features(system_info)
    return LlamaCppReport(
        package_version=llama_cpp.__version__,
        system_info=system_info,
        gpu_offload=local_gpu_present(),
        missing_cpu_features=sorted(missing),
        cores=owned_cores(),
        rpc=bool(llama_cpp.llama_supports_rpc()),
    )


def probe_torch() -> RuntimeReport:
    try:
        import torch  # noqa: PLC0415 - importing it is what is being probed
    except ImportError as error:
        return ProbeFailure(
            runtime="torch", message=f"torch is not importable ({error}); run `make setup`"
        )
    cuda = torch.cuda.is_available()
    return TorchReport(
        torch_version=str(torch.__version__),  # a str subclass msgspec refuses
        cuda_available=cuda,
        cuda_version=torch.version.cuda,
        devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()),
        threads=torch.get_num_threads(),
        cores=owned_cores(),
    )


PROBES = {"llama.cpp": probe_llama_cpp, "torch": probe_torch}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in PROBES:
        usage = f"usage: python -m hetspec.workers.tools.probe {{{'|'.join(PROBES)}}}"
        print(usage, file=sys.stderr)
        return 2
    sys.stdout.buffer.write(encode_runtime_report(PROBES[args[0]]()) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
