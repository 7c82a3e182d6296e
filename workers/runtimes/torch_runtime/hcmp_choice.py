"""Loading the torch verifier as HCMP's split (``TorchSettings.split_ratio``): at the ratio the
configuration names, or at ARCA's ratio for each verification width ("auto"), measured at load
with both sides computing (so their contention is in the figures) and cached per model and box.

Contract: ``load_split`` returns the split runtime and words for the worker's device line, or
no runtime and the one line saying why the split cannot run here (a ratio outside [0, 1], a GPU
share on a box without CUDA, a cached profile made for another model or box, a model HCMP
cannot split); the caller then loads the unsplit runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hetspec.protocol import worker_messages as m
from hetspec.speculative.control.arca import (
    Identity,
    ProfileMismatch,
    box_identity,
    cache_path,
    initial_ratio,
    load_costs,
    model_identity,
    ratios_by_width,
    refine_ratio,
    save_costs,
    split_gpu,
    unsplit_ms,
)
from hetspec.workers.runtimes.torch_runtime.config import ModelLoadError
from hetspec.workers.runtimes.torch_runtime.hcmp_profiler import verify_costs
from hetspec.workers.runtimes.torch_runtime.hcmp_runtime import HcmpRuntime
from hetspec.workers.runtimes.torch_runtime.hcmp_sides import HcmpSettings, Side, checked

ARCA_WIDTHS = (1, 2, 4, 8, 16)  # verification widths ARCA chooses a ratio for
ARCA_REPEATS = 5  # forwards a measurement's median is of
ARCA_MOST = 12  # measurements a width's search may take
PREFIX = 64  # committed tokens before each measured verification


@dataclass(frozen=True)
class SplitLoad:
    """The split runtime and what it runs, in words; or no runtime and why not (one line)."""

    runtime: HcmpRuntime | None
    words: str


def load_split(model: str, settings: m.TorchSettings) -> SplitLoad:
    """The torch verifier of ``model`` split as ``settings.split_ratio`` asks (see the module)."""
    ratio = settings.split_ratio
    gpu = split_gpu(settings.device)
    sides = {"gpu": Side(gpu, settings.threads), "cpu": Side("cpu", settings.threads)}
    if ratio == "auto" and gpu.startswith("cuda") and not torch.cuda.is_available():
        return SplitLoad(None, "HCMP auto: this box has no CUDA device to split with; unsplit")
    try:
        first = checked(HcmpSettings(1.0 if ratio == "auto" else ratio, **sides))
        runtime = HcmpRuntime(model, first, dtype=settings.dtype, max_context=settings.max_context)
    except ModelLoadError as error:  # HcmpSettingsError among them: one line
        return SplitLoad(None, f"HCMP refused: {error}; unsplit")
    if ratio != "auto":
        return SplitLoad(runtime, f"HCMP split, GPU share {ratio:g}")
    return _arca(runtime, Path(model), gpu, settings.split_cache)


def _arca(runtime: HcmpRuntime, model: Path, gpu: str, cache: str | None) -> SplitLoad:
    """ARCA's ratio for every width: from the cache where it holds this model's and box's,
    else measured now (and cached)."""
    device = torch.device(gpu)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    identity = Identity(model_identity(model), box_identity(name))
    path = cache_path(Path(cache), model, gpu) if cache else None
    cached = path is not None and path.exists()
    if cached:
        try:
            costs = load_costs(path, identity)
        except (ProfileMismatch, OSError) as error:
            return SplitLoad(
                None, f"HCMP auto: {error}; unsplit (delete the file to measure again)"
            )
    else:
        costs = measure_costs(runtime)
        if path is not None:
            save_costs(path, identity, costs)
    ratios = ratios_by_width(costs)
    runtime.split_by_width(ratios)
    return SplitLoad(runtime, describe(costs, ratios, cached))


def measure_costs(runtime: HcmpRuntime) -> dict[tuple[int, float], float]:
    """Median ms of a verification at each width and the ratios ARCA's search tried: the
    unsplit ratios, the sides' balance point, then steps while the cost falls."""
    prefix = [(7 * i + 100) % runtime.vocab_size for i in range(PREFIX)]
    costs: dict[tuple[int, float], float] = {}
    for width in ARCA_WIDTHS:

        def measured(ratio: float, width: int = width) -> float:
            if (width, ratio) not in costs:
                timed = verify_costs(runtime, prefix, [width], [ratio], repeats=ARCA_REPEATS)
                costs.update(timed)
            return costs[width, ratio]

        start = initial_ratio(measured(1.0), measured(0.0))
        refine_ratio(measured, start, most=ARCA_MOST)
    runtime.rollback(0)  # the calibration prefix is no one's context
    return costs


def describe(costs: dict[tuple[int, float], float], ratios: dict[int, float], cached: bool) -> str:
    """ARCA's choice a width, and what it gains over the better unsplit ratio there."""
    parts = []
    for width, ratio in ratios.items():
        gain = unsplit_ms(costs, width) / costs[width, ratio]
        parts.append(f"width {width} ratio {ratio:g}" + (f" ({gain:.2f}x)" if gain > 1 else ""))
    source = "cached profile" if cached else f"measured {len(costs)} splits"
    return f"HCMP by ARCA ({source}): " + ", ".join(parts)
