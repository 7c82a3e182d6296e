"""What a worker process reports about the runtime it would compute with.

The daemon never imports torch or llama.cpp itself: it asks a freshly spawned worker process
to describe its runtime and decodes the answer as one of these structs.
"""

from __future__ import annotations

import msgspec


class LlamaCppReport(msgspec.Struct, tag="llama.cpp", frozen=True, forbid_unknown_fields=True):
    """The llama.cpp build the CPU worker loads (through llama-cpp-python)."""

    package_version: str
    system_info: str
    gpu_offload: bool  # a GPU of this machine can take layers
    # SIMD extensions the host CPU offers but this build does not use: a build made with
    # SOURCE_DATE_EPOCH set, or for another machine, runs several times slower than it could.
    missing_cpu_features: list[str]
    cores: list[int]
    rpc: bool = False  # built with llama.cpp's RPC backend (layers on other hosts' rpc-servers)


class TorchReport(msgspec.Struct, tag="torch", frozen=True, forbid_unknown_fields=True):
    """The torch build the GPU worker loads."""

    torch_version: str
    cuda_available: bool
    cuda_version: str | None
    devices: list[str]
    bf16_supported: bool
    threads: int
    cores: list[int]


class ProbeFailure(msgspec.Struct, tag="failure", frozen=True, forbid_unknown_fields=True):
    """The runtime could not be loaded at all; ``message`` says why and what to do."""

    runtime: str
    message: str


RuntimeReport = LlamaCppReport | TorchReport | ProbeFailure


class RuntimeProfile(msgspec.Struct, tag="profile", frozen=True, forbid_unknown_fields=True):
    """What one forward costs a runtime holding one model, measured on the worker's cores.

    ``median_ms[i]`` is the median time of one forward of ``widths[i]`` chained tokens (a
    verification of ``widths[i] - 1`` drafted tokens plus the bonus) after a committed
    context of ``prefix`` tokens, the forwarded tokens dropped again after each repeat.
    """

    runtime: str  # "llama.cpp" or "torch"
    device: str  # where it computed: "cpu", "cuda:0", "gpu (llama.cpp)"
    model: str
    prefix: int
    widths: list[int]
    median_ms: list[float]
    load_s: float
    cores: list[int]
    # the other worker's cores it computed on too (as a verifier does while the drafter idles)
    spare_cores: list[int] = []

    def cost_ms(self) -> dict[int, float]:
        return dict(zip(self.widths, self.median_ms, strict=True))


ProfileResult = RuntimeProfile | ProbeFailure

_decoder = msgspec.json.Decoder(RuntimeReport)
_profile_decoder = msgspec.json.Decoder(ProfileResult)


def encode_runtime_report(report: RuntimeReport) -> bytes:
    return msgspec.json.encode(report)


def decode_runtime_report(data: bytes) -> RuntimeReport:
    """Decode a report; raises ``msgspec.ValidationError``/``DecodeError`` on anything else."""
    return _decoder.decode(data)


def decode_profile(data: bytes) -> ProfileResult:
    """Decode a profile; raises ``msgspec.ValidationError``/``DecodeError`` on anything else."""
    return _profile_decoder.decode(data)
