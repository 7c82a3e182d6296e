"""ARCA (Ghidorah's architecture-aware profiling): the verification width, tree and HCMP split
ratio that give the most tokens a second, from a profile measured once per model and box.

A profile holds what one verification of each width costs at each split ratio (both sides
running at once, so their contention for memory is in the figures) and what a round of each
width and tree shape emits on calibration prompts (accepted tokens plus the verifier's own).
``choose`` takes, for every width, the cheapest measured ratio (the unsplit ratios 0 and 1
among them, so a split is chosen only where it is measured to pay), then the width and tree
with the best ``emitted / cost``. ``initial_ratio`` and ``refine_ratio`` are the paper's
search for a width's ratio: start from the sides' costs alone, then step while it improves.

The profile cache is a JSON file naming the model and the box it was measured on; a file
made for another is refused with one line (``ProfileMismatch``) and ``decide`` falls back to
the unsplit runtime. Pure arithmetic and a JSON file: no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

UNSPLIT = (0.0, 1.0)  # one side computes everything
FORMAT = 1


@dataclass(frozen=True)
class Profile:
    """``cost_ms``: {(width, ratio): ms of one verification}; ``emitted``: {(width, tree):
    tokens a round emits on average}."""

    cost_ms: Mapping[tuple[int, float], float]
    emitted: Mapping[tuple[int, str], float]


@dataclass(frozen=True)
class Choice:
    width: int
    tree: str
    ratio: float
    ms: float
    tokens_per_s: float
    unsplit_tokens_per_s: float  # the same width and tree at the better unsplit ratio

    @property
    def gain(self) -> float:
        """The split's speed over the unsplit verifier at the same width (>= 1)."""
        return self.tokens_per_s / self.unsplit_tokens_per_s


def best_ratio(cost_ms: Mapping[tuple[int, float], float], width: int) -> tuple[float, float]:
    """The cheapest measured ratio of ``width`` and its cost (ties: the unsplit, then the
    smaller GPU share)."""
    tried = {r: ms for (w, r), ms in cost_ms.items() if w == width}
    if not tried:
        raise ValueError(f"no cost measured at width {width}")
    ratio = min(tried, key=lambda r: (tried[r], r not in UNSPLIT, r))
    return ratio, tried[ratio]


def unsplit_ms(cost_ms: Mapping[tuple[int, float], float], width: int) -> float:
    """The cheaper of the unsplit ratios measured at ``width``."""
    measured = [cost_ms[width, r] for r in UNSPLIT if (width, r) in cost_ms]
    if not measured:
        raise ValueError(f"width {width} has no unsplit cost (ratio 0 or 1) to compare with")
    return min(measured)


def choose(profile: Profile) -> Choice:
    """The (width, tree, ratio) with the most tokens a second; never slower than the best
    unsplit ratio at the same width, which every width must have measured."""
    best: Choice | None = None
    for (width, tree), emitted in sorted(profile.emitted.items()):
        if not any(w == width for w, _ in profile.cost_ms):
            continue
        ratio, ms = best_ratio(profile.cost_ms, width)
        choice = Choice(
            width,
            tree,
            ratio,
            ms,
            1000.0 * emitted / ms,
            1000.0 * emitted / unsplit_ms(profile.cost_ms, width),
        )
        if best is None or choice.tokens_per_s > best.tokens_per_s:
            best = choice
    if best is None:
        raise ValueError("the profile has no width with both a cost and an acceptance")
    return best


def initial_ratio(gpu_alone_ms: float, cpu_alone_ms: float) -> float:
    """The GPU side's share that would finish both sides together if each side's time
    scaled with its share and they did not contend: its speed over both sides'."""
    return cpu_alone_ms / (gpu_alone_ms + cpu_alone_ms)


def refine_ratio(
    measure: Callable[[float], float], start: float, step: float = 0.05, most: int = 40
) -> dict[float, float]:
    """The costs ``measure(ratio)`` gave: the unsplit ratios, ``start`` (on the ``step``
    grid) and its neighbours, then steps in the direction that is cheaper while the cost
    falls (at most ``most`` measurements). ``best_ratio`` of the result is the choice."""
    grid = max(1, round(1 / step))

    def on_grid(ratio: float) -> float:
        return min(max(round(ratio * grid), 0), grid) / grid

    tried: dict[float, float] = {}

    def cost(ratio: float) -> float:
        ratio = on_grid(ratio)
        if ratio not in tried and len(tried) < most:
            tried[ratio] = measure(ratio)
        return tried.get(ratio, math.inf)

    for ratio in UNSPLIT:
        cost(ratio)
    here = on_grid(start)
    while True:
        around = [on_grid(here - 1 / grid), here, on_grid(here + 1 / grid)]
        cheapest = min(around, key=cost)
        if cheapest == here or len(tried) >= most:
            return tried
        here = cheapest


# ------------------------------------------------------------ the profile cache


class ProfileMismatch(ValueError):
    """A profile cache made for another model or box (the message is one line)."""


@dataclass(frozen=True)
class Identity:
    """What a profile was measured for: the model (``model_identity``) and the box."""

    model: str
    box: str


def model_identity(folder: Path) -> str:
    """A digest of a model folder's config.json and its weight files' names and sizes."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:24]


def box_identity(gpu: str | None) -> str:
    """This box: its machine, CPU model and core count, and the GPU named by the caller
    (``gpu``: a device name, None where there is none)."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    cpu = cpu or platform.processor()  # elsewhere (it may run `uname -p`)
    return f"{platform.machine()} | {cpu} x{os.cpu_count()} | gpu: {gpu or 'none'}"


def save_profile(path: Path, identity: Identity, profile: Profile) -> None:
    """Write ``profile`` and ``choose``'s choice, for ``identity``."""
    record = {
        "format": FORMAT,
        "model": identity.model,
        "box": identity.box,
        "cost_ms": [[w, r, ms] for (w, r), ms in sorted(profile.cost_ms.items())],
        "emitted": [[w, t, n] for (w, t), n in sorted(profile.emitted.items())],
        "choice": asdict(choose(profile)),
    }
    path.write_text(json.dumps(record, indent=1) + "\n")


def _read_record(path: Path, identity: Identity, reader: Callable[[dict], object]):
    """``reader`` of the cache file's record, checked to be ``identity``'s: ``ProfileMismatch``
    where it was made for another model or box or is not a profile (``OSError`` where the file
    is unreadable)."""
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT:
            raise ProfileMismatch(f"{path}: profile format {record.get('format')}, not {FORMAT}")
        for field in ("model", "box"):
            if record[field] != getattr(identity, field):
                raise ProfileMismatch(
                    f"{path}: profile made for {field} {record[field]!r}, "
                    f"not this {field} {getattr(identity, field)!r}"
                )
        return reader(record)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        if isinstance(error, ProfileMismatch):
            raise
        raise ProfileMismatch(f"{path}: not an ARCA profile ({error!r})") from None


def _costs(record: dict) -> dict[tuple[int, float], float]:
    return {(int(w), float(r)): float(ms) for w, r, ms in record["cost_ms"]}


def load_profile(path: Path, identity: Identity) -> tuple[Profile, Choice]:
    """The cached profile and choice for ``identity``; ``ProfileMismatch`` where the file was
    made for another model or box or is not a profile (``OSError`` where it is unreadable)."""

    def read(record: dict) -> tuple[Profile, Choice]:
        emitted = {(int(w), str(t)): float(n) for w, t, n in record["emitted"]}
        return Profile(_costs(record), emitted), Choice(**record["choice"])

    return _read_record(path, identity, read)


# A verifier on its own does not know the draft's acceptance: it keeps each width's cheapest
# ratio, and the budget controller, which prices widths by measured acceptance, then makes
# ``choose``'s choice of width from these costs (the best emitted / cost of a width is at its
# cheapest ratio, whatever it emits).


def ratios_by_width(cost_ms: Mapping[tuple[int, float], float]) -> dict[int, float]:
    """Each measured width's cheapest ratio (``best_ratio``)."""
    return {w: best_ratio(cost_ms, w)[0] for w in sorted({w for w, _ in cost_ms})}


def split_gpu(device: str) -> str:
    """The GPU side's device for a torch worker's ``device`` setting ("auto" is CUDA's)."""
    return "cuda" if device == "auto" else device


def cache_path(cache: Path, model: Path, gpu: str) -> Path:
    """Where a verifier's costs for ``model`` split with ``gpu`` are kept under the cache
    folder: one file a model path and device, whose contents name the model and box they were
    measured for."""
    key = hashlib.sha256(f"{model.resolve()}|{gpu}".encode()).hexdigest()[:24]
    return cache / "arca" / f"{key}.json"


def describe_cached(path: Path) -> str:
    """One line on what the cached costs at ``path`` choose, and the box they were measured
    on, for ``hetspecd --check`` (whether they fit this box is the worker's check)."""
    if not path.exists():
        return "no ARCA profile yet: the GPU worker measures one at its first start"
    try:
        record = json.loads(path.read_text())
        costs = _costs(record)
        chosen = ", ".join(f"width {w} ratio {r:g}" for w, r in ratios_by_width(costs).items())
        return f"ARCA profile (measured on {record['box']}): {chosen}"
    except (OSError, KeyError, TypeError, ValueError) as error:
        return f"{path}: not an ARCA profile ({error!r}); the GPU worker will verify unsplit"


def save_costs(path: Path, identity: Identity, cost_ms: Mapping[tuple[int, float], float]) -> None:
    """Write a verifier's measured costs for ``identity``, whole or not at all (a hidden
    sibling renamed over the file)."""
    record = {
        "format": FORMAT,
        "model": identity.model,
        "box": identity.box,
        "cost_ms": [[w, r, ms] for (w, r), ms in sorted(cost_ms.items())],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)


def load_costs(path: Path, identity: Identity) -> dict[tuple[int, float], float]:
    """``save_costs``' costs for ``identity`` (``ProfileMismatch``, ``OSError`` as
    ``load_profile``); every width must hold an unsplit cost."""

    def read(record: dict) -> dict[tuple[int, float], float]:
        costs = _costs(record)
        for width in {w for w, _ in costs}:
            unsplit_ms(costs, width)  # ValueError: refused as not a profile
        return costs

    return _read_record(path, identity, read)


@dataclass(frozen=True)
class Decision:
    """What a verifier runs: ``choice`` (None: the unsplit runtime at ``ratio``) and, where a
    cache was refused, the one line saying why."""

    ratio: float
    choice: Choice | None = None
    refused: str | None = None


def decide(path: Path, identity: Identity, *, unsplit_ratio: float) -> Decision:
    """The cached choice, or the unsplit runtime at ``unsplit_ratio`` (1 where there is a GPU,
    0 where not) where there is no cache yet or it was refused."""
    if not path.exists():
        return Decision(unsplit_ratio)
    try:
        _, choice = load_profile(path, identity)
    except (ProfileMismatch, OSError) as error:
        return Decision(unsplit_ratio, refused=f"{error}; verifying unsplit")
    return Decision(choice.ratio, choice)
