"""What heavy copies can be made of: the source models, their size presets, and the sizes and
GGUF types a caller names.

Contract: ``SOURCES`` maps each source's name to its ``HeavySource`` (its folder, the prefix of
its copies' names, its presets); ``parse_size`` and ``parse_types`` turn what a caller writes
into a preset name and validated GGUF types, or raise ``HeavyModelError`` saying what is
wrong. ``HeavyModel`` describes a copy once built (heavy.py's ``ensure_heavy``). Nothing here
reads or writes a model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from hetspec.models.gguf_export import OUT_TYPES
from hetspec.models.llama_quantize import QUANT_TYPES
from hetspec.models.padding import HeavyShape

SOURCE = Path(__file__).resolve().parent / "target"
SOURCE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
DEFAULT_TYPES = ("f16", "q8_0", "q4_0")


class HeavyModelError(ValueError):
    """A heavy model cannot be made or found; the message says what is wrong."""


# Sizes are named by their nominal parameter count; `python -m hetspec.models.heavy` prints
# the exact one. 1b is wide and shallow because D/d must be a power of four (padding.py).
PRESETS: Mapping[str, HeavyShape] = MappingProxyType(
    {
        "100m": HeavyShape(1024, 8, 32, 16, 2816),
        "300m": HeavyShape(1024, 25, 32, 16, 2816),
        "1b": HeavyShape(4096, 5, 128, 64, 11264),
    }
)
_NOMINAL = MappingProxyType({"100m": 100e6, "300m": 300e6, "1b": 1e9})
# SmolLM2-135M (576 wide, 30 layers, 9 of 3 query heads per KV head) at the costs of its
# siblings: 360M keeps the width and grows heads, layers and the MLP; 1.7B is 4x as wide.
SMOLLM2_PRESETS: Mapping[str, HeavyShape] = MappingProxyType(
    {
        "360m": HeavyShape(576, 32, 15, 5, 5120),
        "1.7b": HeavyShape(2304, 30, 36, 12, 5632),
    }
)
_SMOLLM2_NOMINAL = MappingProxyType({"360m": 360e6, "1.7b": 1.7e9})


@dataclass(frozen=True)
class HeavySource:
    """A trained model heavy copies are made of."""

    name: str  # "bundled", "smollm2"
    prefix: str  # of the copies' folders and files: "heavy" -> heavy-100m/heavy-100m-q8_0.gguf
    presets: Mapping[str, HeavyShape]
    nominal: Mapping[str, float]
    described: str  # for the model card
    fingerprinted: tuple[str, ...]  # the source's files whose bytes identify it
    dtype: type  # the copies' weights: the source's own precision

    def folder(self, cache_dir: Path) -> Path:
        """The source's Hugging Face folder (SmolLM2's is fetched into the cache first)."""
        if self.name == "bundled":
            return SOURCE
        from hetspec.models.smollm2 import RealModelError, ensure_smollm2  # noqa: PLC0415

        try:
            return ensure_smollm2(cache_dir).folder
        except RealModelError as error:
            raise HeavyModelError(f"{self.prefix}: {error}") from None


SOURCES: Mapping[str, HeavySource] = MappingProxyType(
    {
        "bundled": HeavySource(
            "bundled",
            "heavy",
            PRESETS,
            _NOMINAL,
            "the 5M bundled target (hetspec's models/target)",
            SOURCE_FILES,
            np.float16,
        ),
        "smollm2": HeavySource(
            "smollm2",
            "smollm2-heavy",
            SMOLLM2_PRESETS,
            _SMOLLM2_NOMINAL,
            "SmolLM2-135M-Instruct (its Q4_1 weights, dequantized)",
            ("config.json", "smollm2.json", "tokenizer.json"),
            np.float32,
        ),
    }
)


@dataclass(frozen=True)
class HeavyModel:
    """A built heavy target: a Hugging Face folder plus GGUF exports inside it."""

    size: str  # the preset name, e.g. "100m"
    folder: Path  # config.json, model.safetensors (f16), tokenizer files, README.md
    params: int  # exact parameter count
    shape: HeavyShape
    ggufs: Mapping[str, Path] = field(hash=False)  # GGUF type -> file, for the types asked for
    source: str = "bundled"  # the SOURCES entry it was made of

    def gguf(self, gguf_type: str) -> Path:
        """The GGUF file of ``gguf_type``; HeavyModelError if it was not asked for."""
        try:
            return self.ggufs[gguf_type]
        except KeyError:
            raise HeavyModelError(
                f"{SOURCES[self.source].prefix}-{self.size} was made without a {gguf_type} GGUF; "
                f"pass it in ensure_heavy(types=...) (made: {', '.join(self.ggufs) or 'none'})"
            ) from None


def parse_size(text: str, source: str = "bundled") -> str:
    """The preset name for a parameter count such as ``100m``, ``300M``, ``1b`` or ``0.3b``
    (of ``source``'s presets)."""
    presets, nominals = SOURCES[source].presets, SOURCES[source].nominal
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([mb])\s*", text, re.IGNORECASE)
    choices = ", ".join(presets)
    if not match:
        raise HeavyModelError(
            f"cannot read size {text!r}: write a parameter count, one of {choices}"
        )
    count = float(match[1]) * (1e6 if match[2].lower() == "m" else 1e9)
    for name, nominal in nominals.items():
        if math.isclose(count, nominal):
            return name
    raise HeavyModelError(f"no heavy preset of {text.strip()} parameters; choose one of {choices}")


def parse_types(types: str | Iterable[str]) -> tuple[str, ...]:
    """GGUF types from ``"f16,q8_0"`` or an iterable, validated, duplicates dropped."""
    names = types.split(",") if isinstance(types, str) else list(types)
    result = tuple(dict.fromkeys(name.strip() for name in names if name.strip()))
    unknown = [name for name in result if name not in OUT_TYPES and name not in QUANT_TYPES]
    if unknown:
        raise HeavyModelError(
            f"unknown GGUF type {unknown[0]!r}; choose from {', '.join([*OUT_TYPES, *QUANT_TYPES])}"
        )
    return result
