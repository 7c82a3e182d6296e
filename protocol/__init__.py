"""Typed messages exchanged between hetspec processes.

This package depends on nothing else of hetspec (only msgspec and the standard library), so
the daemon, the workers and the client can all import it. Messages are msgspec structs encoded
as JSON or MessagePack; nothing crossing a process boundary is ever pickled.
"""

from hetspec.protocol.runtime_report import (
    LlamaCppReport,
    ProbeFailure,
    RuntimeReport,
    TorchReport,
    decode_runtime_report,
    encode_runtime_report,
)

__all__ = [
    "LlamaCppReport",
    "ProbeFailure",
    "RuntimeReport",
    "TorchReport",
    "decode_runtime_report",
    "encode_runtime_report",
]
