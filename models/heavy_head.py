"""A heavy copy's draft head: the bundled target's draft head (train_head.py), widened to the
heavy target's features, written into the copy's folder as ``draft-head``.

Contract: ``widened_head`` widens the head's input maps to the heavy target's feature width
with zero columns, its blocks as trained (``HeavyModelError`` for a narrower width);
``write_head`` writes it atomically (temporary folder, rename) and again only when the bundled
head or the recipe changed (its ``source.json`` stamp), and does nothing where no head is
bundled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from hetspec.models.cache_files import fsync, remove, temp_name
from hetspec.models.heavy_folder import RECIPE
from hetspec.models.heavy_presets import SOURCE, HeavyModelError

HEAD_SOURCE = SOURCE.parent / "head"  # the bundled target's draft head (train_head.py)
HEAD_FOLDER = "draft-head"  # the heavy target's copy of it, widened to its features
HEAD_FILES = ("head_config.json", "model.safetensors")


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


def write_head(folder: Path, feature_size: int, say: Callable[[str], None]) -> None:
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
