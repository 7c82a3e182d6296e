"""``HcmpRuntime``: the torch runtime whose forwards are HCMP's split (hcmp_forward.py).

Everything but the model call is ``TorchRuntime``'s (the pending tree, commits, drafting,
the vocabulary); forwards run eagerly in the call's own shape (no fixed shapes, no CUDA
graphs: the split is host-driven). At ratio 1, and at ratio 0 where the model is on the CPU,
one side holds everything and the forward is the unsplit runtime's own, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hetspec.speculative.control.hcmp_work import Work
from hetspec.workers.runtimes.torch_runtime.hcmp_forward import HcmpForward
from hetspec.workers.runtimes.torch_runtime.hcmp_sides import HcmpSettings, checked
from hetspec.workers.runtimes.torch_runtime.runtime import TorchRuntime


def home_device(settings: HcmpSettings) -> str:
    """Where the model and the activations live: the GPU side's device, or the CPU where
    the CPU side computes everything (ratio 0) and that device cannot be used here."""
    device = torch.device(settings.gpu.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return "cpu"  # ``checked`` refused every GPU share: ratio is 0
    return settings.gpu.device


class HcmpRuntime(TorchRuntime):
    static_shapes = False

    def __init__(
        self,
        model_dir: str | Path,
        settings: HcmpSettings,
        *,
        dtype: str = "auto",
        max_context: int | None = None,
    ) -> None:
        """Load ``model_dir`` on the GPU side's device and split it as ``settings`` say
        (``HcmpSettingsError``, one line, where they cannot run here)."""
        settings = checked(settings)
        super().__init__(
            model_dir,
            device=home_device(settings),
            dtype=dtype,
            max_context=max_context,
            threads=settings.cpu.threads,
            fixed_width=0,
        )
        self.hcmp = HcmpForward(self.model, settings)
        self._by_width: list[tuple[int, HcmpForward]] = []  # (width, its forward), narrowest first

    @property
    def settings(self) -> HcmpSettings:
        return self.hcmp.settings

    def set_split(self, settings: HcmpSettings) -> None:
        """Another ratio or shift over the same sides (the profiler's sweep), for every width."""
        settings = checked(settings)
        if home_device(settings) != home_device(self.settings):
            raise ValueError("set_split keeps the sides; load another runtime for others")
        self.hcmp = HcmpForward(self.model, settings)
        self._by_width = []

    def split_by_width(self, ratios: Mapping[int, float]) -> None:
        """Each forward at the ratio of the narrowest width in ``ratios`` that holds it (the
        widest's beyond them): ARCA's choice a width. One split forward a distinct ratio."""
        forwards: dict[float, HcmpForward] = {}
        for ratio in sorted(set(ratios.values())):
            settings = checked(replace(self.settings, ratio=ratio))
            forwards[ratio] = HcmpForward(self.model, settings)
        self._by_width = sorted(((w, forwards[r]) for w, r in ratios.items()), key=lambda p: p[0])

    def ratio_for(self, width: int) -> float:
        """The split ratio a forward of ``width`` rows computes at."""
        return self._forward_for(width).settings.ratio

    def _forward_for(self, width: int) -> HcmpForward:
        for most, forward in self._by_width:
            if width <= most:
                return forward
        return self._by_width[-1][1] if self._by_width else self.hcmp

    def _splits(self, ratio: float) -> bool:
        return 0.0 < ratio < 1.0 or (ratio == 0.0 and self.device.type != "cpu")

    @property
    def splits(self) -> bool:
        """Whether forwards take the split path (else the unsplit runtime's)."""
        return self._splits(self.settings.ratio)

    def record_work(self, record: list[Work] | None) -> None:
        """Append each split forward's ``Work`` items to ``record`` (None: stop)."""
        for forward in (self.hcmp, *(f for _, f in self._by_width)):
            forward.record = record

    def _evaluate(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: np.ndarray,
        parents: np.ndarray,
        *,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        forward = self._forward_for(len(tokens))
        if not self._splits(forward.settings.ratio):
            return super()._evaluate(tokens, positions, rows, parents, last_only=last_only)
        existing = self.pending
        at = torch.from_numpy(positions).to(self.device)
        hidden = forward.hidden(
            torch.from_numpy(tokens).to(self.device),
            self._cos[:, at].to(self.dtype),
            self._sin[:, at].to(self.dtype),
            cache_keys=self._keys,
            cache_values=self._values,
            start=self.committed + existing,
            committed=self.committed,
            masks=self._attention_masks(rows, positions, existing),
        )
        return forward.logits(hidden[-1:] if last_only else hidden), hidden
