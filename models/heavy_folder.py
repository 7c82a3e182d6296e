"""Writing one heavy copy into the cache: its Hugging Face folder and its GGUF exports.

Contract: ``build_folder`` writes the padded weights (padding.py), the config, the copied
tokenizer files, the model card and the manifest (``heavy.json``: the recipe, the shape, the
seed and the source's fingerprint) into a temporary folder, then renames it into place, so a
folder that has its manifest is complete; ``is_current`` tells whether a folder's manifest is
the one asked for. ``export_type`` writes one GGUF the same way (temporary file, rename).
Failures the caller can act on are ``HeavyModelError``; the caller holds the cache's lock.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from hetspec.models.cache_files import fsync, remove, temp_name
from hetspec.models.gguf_export import ExportError, export_any
from hetspec.models.heavy_presets import HeavyModelError, HeavySource
from hetspec.models.llama_quantize import QuantizeError
from hetspec.models.padding import (
    INIT_STD,
    SEED,
    HeavyShape,
    PaddingError,
    heavy_config,
    heavy_tensors,
)

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MANIFEST = "heavy.json"
# Bump when the recipe changes what gets written: cached models of another recipe are rebuilt.
RECIPE = 1


def source_fingerprint(source: HeavySource, folder: Path) -> str:
    digest = hashlib.sha256()
    for name in source.fingerprinted:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def heavy_manifest(
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


def is_current(folder: Path, manifest: dict) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()) == manifest
    except (OSError, json.JSONDecodeError):
        return False


def model_card(
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


def build_folder(
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
        card = model_card(source, size, config, params, source_config)
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


def export_type(folder: Path, label: str, gguf_type: str, say: Callable[[str], None]) -> Path:
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
