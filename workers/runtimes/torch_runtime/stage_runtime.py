"""StageRuntime: a contiguous range of a torch target's layers, a pipeline stage of FlowSpec.

The first stage embeds token ids, the last one ends with the final norm and the LM head; the
others take and give hidden states. A range may end between a layer's attention and its MLP
(speculative/flow/layer_split.py), so few layers still split into stages of equal cost. The
stage's KV cache (its attention halves') holds the committed context and the
tree nodes pending here (speculative/flow/stage_cache.py decides which slots each new node attends
to and which slots a commit moves); only this stage's layers are loaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hetspec.speculative.flow.layer_split import SplitError, parse_range
from hetspec.speculative.flow.stage_cache import Admission, Compaction
from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.runtimes.torch_runtime.model import layer_rope_tables, mlp_parts
from hetspec.workers.runtimes.torch_runtime.runtime import (
    DEFAULT_MAX_CONTEXT,
    pick_device,
    pick_dtype,
)
from hetspec.workers.runtimes.torch_runtime.weights import load_model


class StageRuntime:
    def __init__(
        self,
        model_dir: str | Path,
        first_layer: float,
        end_layer: float,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_context: int | None = None,
        threads: int | None = None,
    ) -> None:
        """From layer ``first_layer`` up to ``end_layer`` (excluded) of the model in
        ``model_dir``; either may be a half (2.5: after layer 2's attention)."""
        folder = Path(model_dir)
        self.config = config = ModelConfig.from_folder(folder)
        try:
            first, end = parse_range(f"{first_layer}:{end_layer}", config.num_layers)
        except SplitError as error:
            raise ModelLoadError(f"{folder}: {error}") from None
        if threads is not None:
            torch.set_num_threads(threads)
        self.halves = range(first, end)
        self.first = first == 0
        self.last = end == 2 * config.num_layers
        self._attention_layers = [half // 2 for half in self.halves if half % 2 == 0]
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        capacity = max_context or min(config.max_context, DEFAULT_MAX_CONTEXT)
        if not 0 < capacity <= config.max_context:
            raise ModelLoadError(f"{folder}: context {capacity} is outside 1..{config.max_context}")
        self.capacity = capacity
        self.model = load_model(folder, config, self.dtype, self.device, only=self._owns)
        shape = (len(self._attention_layers), config.num_kv_heads, capacity, config.head_dim)
        self._keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cos, self._sin = layer_rope_tables(config, capacity, self.device)
        self._windows = [config.sliding_windows[i] for i in self._attention_layers]
        self.filled = 0  # cache slots in use: committed context, then pending nodes
        self._slot_positions = np.zeros(capacity, np.int64)  # for sliding windows

    def _owns(self, name: str) -> bool:
        if name.startswith("model.layers."):
            _, _, layer, part = name.split(".")[:4]
            mlp = part in mlp_parts(self.config)
            return 2 * int(layer) + mlp in self.halves
        if name.startswith("model.embed_tokens."):
            tied = self.config.tie_word_embeddings
            return self.first or (self.last and tied)
        return self.last  # the final norm and the LM head

    @torch.inference_mode()
    def forward(
        self, inputs: np.ndarray, positions: np.ndarray, visible: np.ndarray, committed: int
    ) -> np.ndarray:
        """Compute new rows at cache slots ``filled``.. (token ids (n,) for the first stage,
        hidden states (n, hidden) otherwise). Each row attends to the ``committed`` context
        and the slots after it that ``visible`` (n, filled - committed + n) marks. Returns
        hidden states (n, hidden) float32, or logits (n, vocab) float32 from the last stage."""
        n = len(positions)
        if self.filled + n > self.capacity:
            raise ValueError(
                f"the stage's cache holds {self.capacity} slots; {self.filled} used, {n} more asked"
            )
        if self.first:
            x = self.model.model.embed(torch.from_numpy(inputs).to(self.device))
        else:
            x = torch.from_numpy(inputs).to(self.device, self.dtype)
        at = torch.from_numpy(positions).to(self.device)
        hidden = self.model.run_halves(
            x,
            self.halves,
            self._cos[:, at].to(self.dtype),
            self._sin[:, at].to(self.dtype),
            cache_keys=self._keys,
            cache_values=self._values,
            start=self.filled,
            masks=self._masks(positions, visible, committed),
        )
        self._slot_positions[self.filled : self.filled + n] = positions
        self.filled += n
        if self.last:
            return self.model.logits(hidden).cpu().numpy()
        return hidden.float().cpu().numpy()

    def _masks(self, positions: np.ndarray, visible: np.ndarray, committed: int):
        allowed = np.ones((len(positions), self.filled + len(positions)), bool)
        allowed[:, committed:] = visible
        key_positions = np.concatenate([self._slot_positions[: self.filled], positions])
        masks: dict[int | None, torch.Tensor] = {}
        for window in set(self._windows):
            mask = allowed
            if window is not None:  # keys no more than window-1 positions back
                mask = allowed & (key_positions[None, :] > positions[:, None] - window)
            masks[window] = torch.from_numpy(mask).to(self.device)
        return [masks[w] for w in self._windows]

    def clear(self) -> None:
        """Forget every slot: the next ``prefill`` starts a new sequence."""
        self.filled = 0

    def prefill(self, inputs: np.ndarray) -> np.ndarray:
        """Extend the committed context by a causal run of ``inputs`` (token ids for the
        first stage, hidden states otherwise)."""
        n = len(inputs)
        causal = np.tril(np.ones((n, n), bool))
        return self.forward(inputs, self.filled + np.arange(n), causal, self.filled)

    def admit(
        self, admission: Admission, inputs: np.ndarray, positions: np.ndarray, committed: int
    ) -> np.ndarray:
        """Compute a segment's live rows (``inputs``/``positions`` already cut to them)."""
        if admission.start != self.filled:
            raise ValueError(
                f"the book places the segment at slot {admission.start}, the "
                f"cache is filled to {self.filled}"
            )
        return self.forward(inputs, positions, admission.visible, committed)

    @torch.inference_mode()
    def compact(self, compaction: Compaction) -> None:
        """Move slots as a commit says; slots past them are free again."""
        first, sources = compaction.first, compaction.sources
        if sources:
            index = torch.tensor(sources, device=self.device)
            self._keys[:, :, first : first + len(sources)] = self._keys[:, :, index]
            self._values[:, :, first : first + len(sources)] = self._values[:, :, index]
            self._slot_positions[first : first + len(sources)] = self._slot_positions[sources]
        self.filled = first + len(sources)
