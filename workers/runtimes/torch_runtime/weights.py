"""Strict loading of safetensors checkpoints (single file or sharded) into a CausalLM.

Every parameter the model declares must be present once with the right shape, and every tensor
in the files must be one the model uses: a partial or mismatched load is an error that names
the folder and the tensors, never a silently half-random model. safetensors only; no pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.runtimes.torch_runtime.model import CausalLM

# Buffers some exporters write that the model recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelLoadError(f"{folder}: unreadable {index.name}: {error}") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        found = sorted(folder.glob("*.safetensors"))
        if not found:
            pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(
                p.name for p in folder.glob("*.pt")
            )
            hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded)" * bool(
                pickled
            )
            raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
        files = found
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{folder}: weight files missing: {', '.join(missing)}")
    return files


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_model(
    folder: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    only: Callable[[str], bool] | None = None,
) -> CausalLM:
    """Build the model for ``config`` and fill every parameter from the folder's weights; with
    ``only``, just the parameters it accepts (a pipeline stage's layers; the others stay on
    the meta device and take no memory)."""
    with torch.device("meta"):
        model = CausalLM(config)
    declared = {name: tuple(p.shape) for name, p in model.named_parameters()}
    expected = {name: shape for name, shape in declared.items() if only is None or only(name)}
    tied_head = config.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in checkpoint_files(folder):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(_IGNORED_SUFFIXES) or (tied_head and name == "lm_head.weight"):
                        continue
                    if name not in expected:
                        if name not in declared:
                            unexpected.append(name)
                        continue
                    if name in state:
                        raise ModelLoadError(f"{folder}: tensor {name} appears in two files")
                    tensor = handle.get_tensor(name)
                    if tuple(tensor.shape) != expected[name]:
                        raise ModelLoadError(
                            f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {expected[name]}"
                        )
                    state[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {error}") from None
    if unexpected:
        raise ModelLoadError(
            f"{folder}: tensors this {config.model_type} model does not use: "
            f"{_listing(sorted(unexpected))}"
        )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{folder}: missing tensors: {_listing(missing)}")
    model.load_state_dict(state, strict=only is None, assign=True)
    return model.eval().requires_grad_(False)
