"""The two sides of an HCMP verifier and the split's settings, checked once.

The "gpu" side holds the model and the activations (its device is where the forward's output
lives); the "cpu" side computes its share on the host. On a box without a GPU both sides may
be the CPU (two CPU halves: the split's arithmetic with no second processor behind it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hetspec.speculative.control.hcmp_work import column_split
from hetspec.workers.runtimes.torch_runtime.config import ModelLoadError


class HcmpSettingsError(ModelLoadError):
    """A split that cannot run here; the message is one line saying why. Whoever asked for
    the split falls back to the unsplit runtime."""


@dataclass(frozen=True)
class Side:
    """A torch device and the host threads it computes with (None: torch's current count)."""

    device: str
    threads: int | None = None


@dataclass(frozen=True)
class HcmpSettings:
    """``ratio``: the GPU side's share of every linear's output columns, in [0, 1] (0: all on
    the CPU side, 1: all on the GPU side, the unsplit runtime either way). ``shift``: keys
    moved across the attention boundary, which is the committed cache's end (positive: the
    draft tree's first keys join the dense part)."""

    ratio: float
    shift: int = 0
    gpu: Side = field(default_factory=lambda: Side("cuda"))
    cpu: Side = field(default_factory=lambda: Side("cpu"))

    @property
    def split(self) -> bool:
        """Whether both sides compute (0 < ratio < 1)."""
        return 0.0 < self.ratio < 1.0


def checked(settings: HcmpSettings) -> HcmpSettings:
    """``settings`` if they can run on this box, else ``HcmpSettingsError``."""
    ratio = settings.ratio
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0.0 <= ratio <= 1.0:
        raise HcmpSettingsError(f"HCMP split ratio {ratio!r} is outside [0, 1]")
    column_split(1, float(ratio))  # the arithmetic's own check, the same bounds
    try:
        gpu, cpu = torch.device(settings.gpu.device), torch.device(settings.cpu.device)
    except RuntimeError as error:
        raise HcmpSettingsError(f"HCMP side device: {error}") from None
    if cpu.type != "cpu":
        raise HcmpSettingsError(f"HCMP's cpu side must be the CPU, not {settings.cpu.device!r}")
    if gpu.type not in ("cpu", "cuda"):
        raise HcmpSettingsError(f"HCMP's gpu side must be cuda or cpu, not {settings.gpu.device!r}")
    if gpu.type == "cuda" and ratio > 0 and not torch.cuda.is_available():
        raise HcmpSettingsError(
            f"HCMP asked for a GPU share of {ratio:g} but this box has no CUDA device"
        )
    for side in (settings.gpu, settings.cpu):
        if side.threads is not None and side.threads < 1:
            raise HcmpSettingsError(f"HCMP side {side.device}: threads must be >= 1")
    return settings
