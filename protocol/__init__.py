"""Typed messages exchanged between hetspec processes, and the shared memory they point into.

This package depends on nothing else of hetspec (only msgspec, numpy and the standard library),
so the daemon, the workers and the client can all import it. Messages are msgspec structs
encoded as JSON or MessagePack; nothing crossing a process boundary is ever pickled.
"""

from hetspec.protocol.arena import Arena, ArenaError, ArenaLayout, ArrayRef
from hetspec.protocol.frames import Codec, MessageError, frame_array, frame_ref
from hetspec.protocol.runtime_report import (
    LlamaCppReport,
    ProbeFailure,
    ProfileResult,
    RuntimeProfile,
    RuntimeReport,
    TorchReport,
    decode_profile,
    decode_runtime_report,
    encode_runtime_report,
)
from hetspec.protocol.sampling import SamplingError, SamplingParams, TokenLogprob
from hetspec.protocol.vocab import VocabInfo, VocabReport

__all__ = [
    "Arena",
    "ArenaError",
    "ArenaLayout",
    "ArrayRef",
    "Codec",
    "LlamaCppReport",
    "MessageError",
    "ProbeFailure",
    "ProfileResult",
    "RuntimeProfile",
    "RuntimeReport",
    "SamplingError",
    "SamplingParams",
    "TokenLogprob",
    "TorchReport",
    "VocabInfo",
    "VocabReport",
    "decode_profile",
    "decode_runtime_report",
    "encode_runtime_report",
    "frame_array",
    "frame_ref",
]
