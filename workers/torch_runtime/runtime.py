"""TorchRuntime: token-tree forwards over a preallocated KV cache (the GPU worker's engine).

The committed tokens' keys/values fill cache slots 0..committed-1 and the pending tree's nodes
the slots after them, in the order they were evaluated; attention masks make each node see the
prefix and its own ancestors. Committing a path copies its slots right after the prefix.
The tree bookkeeping, appending and drafting come from ``TreeRuntime``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from hetspec.protocol.vocab import VocabInfo
from hetspec.workers.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.torch_runtime.model import rope_tables
from hetspec.workers.torch_runtime.tokenizer import FolderTokenizer
from hetspec.workers.torch_runtime.weights import load_model
from hetspec.workers.tree_runtime import TreeRuntime

DEFAULT_MAX_CONTEXT = 8192  # the KV cache for a 128k-context model would not fit most boxes


@dataclass(frozen=True)
class TreeOutput:
    logits: torch.Tensor  # (nodes, vocab) float32, on the runtime's device
    hidden: torch.Tensor  # (nodes, hidden) last decoder layer output, before the final norm


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {requested!r} requested but CUDA is not available")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if requested not in dtypes:
        raise ModelLoadError(f"dtype {requested!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[requested]


class TorchRuntime(TreeRuntime[TreeOutput]):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_context: int | None = None,
        threads: int | None = None,
        compile: bool = False,
    ) -> None:
        """Load ``model_dir``; ``compile`` runs the model through torch.compile (worth it on
        CUDA for long runs; the first forward of each new shape pays the compilation)."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: not a directory")
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.config = self._read_config(folder)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        limit = self.config.max_context
        capacity = max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if not 0 < capacity <= limit:
            raise ModelLoadError(
                f"{folder}: context {capacity} is outside what the model allows (1..{limit})"
            )
        self.model = self._load_model(folder)
        self._run_model = torch.compile(self.model, dynamic=True) if compile else self.model
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, capacity, c.head_dim)
        self._keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cos, self._sin = rope_tables(c, capacity, self.device)
        self.folder = folder
        super().__init__(c.vocab_size, capacity)
        self.feature_size = c.hidden_size

    def _read_config(self, folder: Path) -> ModelConfig:
        """The shape the KV cache and RoPE tables are built for."""
        return ModelConfig.from_folder(folder)

    def _load_model(self, folder: Path):
        return load_model(folder, self.config, self.dtype, self.device)

    def set_extra_threads(self, extra: int) -> None:
        """Compute with ``extra`` threads beyond the configured ones (on cores lent for now:
        see workers/spare_cores.py); 0 restores the configured count."""
        torch.set_num_threads(self.threads + extra)

    # ------------------------------------------------------------ vocabulary

    @cached_property
    def tokenizer(self) -> FolderTokenizer:
        """The folder's ``tokenizer.json`` (read on first use: tests build folders without one)."""
        return FolderTokenizer(self.folder, self.config.vocab_size)

    def vocab_info(self) -> VocabInfo:
        return self.tokenizer.vocab_info()

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def special_tokens(self) -> list[int]:
        """The tokenizer's special added tokens: markup, not text."""
        return sorted(t for t in self.tokenizer.specials if t < self.vocab_size)

    # ------------------------------------------------------------ TreeRuntime hooks

    @torch.inference_mode()
    def _run(
        self, tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> TreeOutput:
        hidden = self._hidden(tokens, positions, rows)
        self._capture_hidden(hidden)
        return TreeOutput(self.model.logits(hidden), hidden)

    def _capture_hidden(self, hidden: torch.Tensor) -> None:
        if self.features_sink is not None:
            self._capture(self.model.model.norm(hidden).float().cpu().numpy())

    def _node_logits(self, output: TreeOutput, index: int) -> np.ndarray:
        return output.logits[index].cpu().numpy()

    def _step_logits(self, output: TreeOutput) -> np.ndarray:
        return output.logits.cpu().numpy()

    @torch.inference_mode()
    def _keep_path(self, path: list[int]) -> None:
        start, count = self.committed, len(path)
        if path != list(range(count)):  # move the path's slots right after the prefix
            source = torch.tensor(path, device=self.device) + start
            self._keys[:, :, start : start + count] = self._keys[:, :, source]
            self._values[:, :, start : start + count] = self._values[:, :, source]

    def _drop_pending_kv(self) -> None:
        """Nothing to do: pending slots are overwritten by the next forward."""

    def _truncate_kv(self, length: int) -> None:
        """Nothing to do: slots past the committed length are never attended to."""

    @torch.inference_mode()
    def _extend_committed(self, tokens: np.ndarray) -> np.ndarray:
        count = len(tokens)
        rows = np.tril(np.ones((count, count), bool))
        hidden = self._hidden(tokens, self.committed + np.arange(count), rows)
        self._capture_hidden(hidden)
        return self.model.logits(hidden[-1:])[0].cpu().numpy()

    # ------------------------------------------------------------ the model call

    def _hidden(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Run new nodes whose keys/values go to the slots after the pending ones."""
        existing = self.pending
        device_positions = torch.from_numpy(positions).to(self.device)
        return self._run_model(
            torch.from_numpy(tokens).to(self.device),
            self._cos[device_positions].to(self.dtype),
            self._sin[device_positions].to(self.dtype),
            cache_keys=self._keys,
            cache_values=self._values,
            start=self.committed + existing,
            masks=self._attention_masks(rows, positions, existing),
        )

    def _attention_masks(
        self, rows: np.ndarray, positions: np.ndarray, existing: int
    ) -> list[torch.Tensor | None]:
        """One boolean mask (n, keys) per layer: the whole prefix, ancestors in the tree.

        None where every key is visible (a single token continuing a chain), which lets SDPA
        take its unmasked path.
        """
        windows = set(self.config.sliding_windows)
        plain_ok = rows.all() and windows == {None}
        by_window: dict[int | None, torch.Tensor | None] = {}
        if plain_ok:
            by_window[None] = None
        else:
            n, prefix = len(rows), self.committed
            allowed = np.ones((n, prefix + rows.shape[1]), bool)
            allowed[:, prefix:] = rows
            key_positions = np.concatenate(
                [np.arange(prefix), prefix + self._pending_depths[:existing], positions]
            )
            for window in windows:
                mask = allowed
                if window is not None:  # keys no more than window-1 positions back
                    mask = allowed & (key_positions[None, :] > positions[:, None] - window)
                by_window[window] = torch.from_numpy(mask).to(self.device)
        return [by_window[w] for w in self.config.sliding_windows]
