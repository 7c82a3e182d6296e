"""HeadRuntime: drafting with a draft head (draft_head.py) over the target's features.

The head's KV cache, pending tree and drafting loop are the torch runtime's; what differs is
each node's input. A node at position t reads the feature of position t - 1: for committed
positions the target's own, as the verifier reported it (``provide_features``), else the
head's prediction; for pending nodes the prediction of their parent. Committed positions whose
target feature never came (the target decoded without reporting, a prefix the verifier
reused) are evaluated one at a time from the head's own predictions, as a draft is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from hetspec.workers.runtimes.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.runtimes.torch_runtime.draft_head import (
    HeadConfig,
    load_head,
    load_target_pieces,
)
from hetspec.workers.runtimes.torch_runtime.runtime import TorchRuntime, TreeOutput
from hetspec.workers.runtimes.torch_runtime.tokenizer import FolderTokenizer


class HeadRuntime(TorchRuntime):
    static_shapes = False  # its model takes features beside tokens: forwards run eagerly

    def __init__(
        self,
        head_dir: str | Path,
        *,
        target: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        max_context: int | None = None,
        threads: int | None = None,
    ) -> None:
        """Load the head in ``head_dir`` for the target model folder ``target``; a head
        trained for another target (feature width, vocabulary) is a ``ModelLoadError``."""
        self.target_folder = Path(target)
        if not self.target_folder.is_dir():
            raise ModelLoadError(f"{self.target_folder}: not a directory (the head's target)")
        self.target_config = ModelConfig.from_folder(self.target_folder)
        super().__init__(
            head_dir, device=device, dtype=dtype, max_context=max_context, threads=threads
        )
        fingerprint = self.tokenizer.vocab_info().fingerprint
        if fingerprint != self.head_config.vocab_fingerprint:
            raise ModelLoadError(
                f"{head_dir}: the head was trained over another vocabulary "
                f"than {self.target_folder}'s"
            )
        self.feature_size = None  # it consumes features, it reports none
        width = self.target_config.hidden_size
        self._features = torch.zeros((self.capacity, width), dtype=self.dtype, device=self.device)
        self._known = np.zeros(self.capacity, bool)  # the target's own feature at a position

    def _read_config(self, folder: Path) -> ModelConfig:
        self.head_config = HeadConfig.from_folder(folder)
        blocks = self.head_config.block_config()
        limit = min(blocks.max_context, self.target_config.max_context)
        return dataclasses.replace(blocks, max_context=limit)

    def _load_model(self, folder: Path):
        self.pieces = load_target_pieces(
            self.target_config, self.target_folder, self.dtype, self.device
        )
        return load_head(folder, self.target_config, self.dtype, self.device)

    @cached_property
    def tokenizer(self) -> FolderTokenizer:
        return FolderTokenizer(self.target_folder, self.target_config.vocab_size)

    # ------------------------------------------------------------ features

    def provide_features(self, start: int, rows: np.ndarray) -> None:
        """The target's features of positions ``start``.. (rows before position 0 or past
        the context are ignored)."""
        rows = np.asarray(rows, np.float32)
        if rows.ndim != 2 or rows.shape[1] != self._features.shape[1]:
            raise ModelLoadError(
                f"features must be (n, {self._features.shape[1]}), not {rows.shape}"
            )
        skip = max(0, -start)
        begin, end = start + skip, min(start + len(rows), self.capacity)
        if begin >= end:
            return
        self._features[begin:end] = torch.from_numpy(rows[skip : skip + end - begin]).to(
            device=self.device, dtype=self.dtype
        )
        self._known[begin:end] = True

    def prefill(
        self,
        prompt: Sequence[int],
        chunk_size: int | None = None,
        *,
        features: np.ndarray | None = None,
        start: int = 0,
    ) -> int:
        """``TreeRuntime.prefill``, with the target's features of positions ``start``.."""
        if features is None:
            return super().prefill(prompt, chunk_size)
        common = self._rollback_to_common_prefix(prompt)
        self.provide_features(start, features)
        self.append(prompt[common:], chunk_size)
        return common

    def append_after_features(self, tokens: Sequence[int], features: np.ndarray) -> None:
        """Append ``tokens`` whose preceding positions' target features are ``features``
        (row i: the position before tokens[i]). Drafted nodes along ``tokens`` are evaluated
        again from those features instead of reused."""
        self.discard_pending()
        self.provide_features(self.committed - 1, features)
        self.append(tokens)

    def warm_up(self, max_width: int) -> None:
        """Flat trees of every width up to ``max_width`` (a draft step evaluates one node
        per branch, all at one depth), then forget them; chains would go one node at a time."""
        self.rollback(0)
        self.append([0])
        for nodes in range(1, min(max_width, self.capacity - 1) + 1):
            self.forward_tree([0] * nodes, [-1] * nodes)
        self.rollback(0)

    # ------------------------------------------------------------ TreeRuntime hooks

    def _reset_pending(self) -> None:
        super()._reset_pending()
        width = self.target_config.hidden_size
        self._pending_features = torch.zeros((0, width), dtype=self.dtype, device=self.device)

    def _end_feature(self) -> torch.Tensor:
        """The feature of the last committed position (zeros before the first token)."""
        if self.committed == 0:
            return torch.zeros_like(self._features[0])
        return self._features[self.committed - 1]

    def _forward(
        self,
        tokens: np.ndarray,
        inputs: torch.Tensor,
        positions: np.ndarray,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Predicted features of new nodes, keys/values to slots start.."""
        at = torch.from_numpy(positions).to(self.device)
        embeddings = self.pieces.embed(torch.from_numpy(tokens).to(self.device))
        # the head's blocks have one rotary kind (layer_rope_tables' first)
        out = self.model(
            inputs,
            embeddings,
            self._cos[0, at].to(self.dtype),
            self._sin[0, at].to(self.dtype),
            cache_keys=self._keys,
            cache_values=self._values,
            start=start,
            mask=mask,
        )
        return self.pieces.feature(out)

    @torch.inference_mode()
    def _run(
        self, tokens: np.ndarray, parents: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> TreeOutput:
        existing, start = self.pending, self.committed + self.pending
        masks = self._attention_masks(rows, positions, existing)
        mask = masks[0] if masks else None
        table = torch.cat([self._end_feature()[None], self._pending_features])
        if (parents < existing).all():  # every input is known: one forward
            inputs = table[torch.from_numpy(parents + 1).to(self.device)]
            features = self._forward(tokens, inputs, positions, start, mask)
        else:  # a node below a new node reads its prediction: one node at a time
            for index, parent in enumerate(parents.tolist()):
                node_mask = None if mask is None else mask[index : index + 1, : start + index + 1]
                feature = self._forward(
                    tokens[index : index + 1],
                    table[parent + 1][None],
                    positions[index : index + 1],
                    start + index,
                    node_mask,
                )
                table = torch.cat([table, feature])
            features = table[existing + 1 :]
        self._pending_features = torch.cat([self._pending_features, features])
        return TreeOutput(self.pieces.logits(features), features)

    @torch.inference_mode()
    def _keep_path(self, path: list[int]) -> None:
        super()._keep_path(path)
        start = self.committed
        self._features[start : start + len(path)] = self._pending_features[path]
        self._known[start : start + len(path)] = False

    def _truncate_kv(self, length: int) -> None:
        self._known[length:] = False

    @torch.inference_mode()
    def _extend_committed(self, tokens: np.ndarray) -> np.ndarray:
        """Evaluate committed tokens in runs: a run goes on while the next position's input
        is a target feature; after a position without one, its prediction is the input."""
        base, count, begin = self.committed, len(tokens), 0
        while begin < count:
            end = begin + 1
            while end < count and self._known[base + end - 1]:
                end += 1
            first = base + begin
            inputs = (
                self._features[first - 1 : first - 1 + end - begin]
                if first
                else torch.cat(
                    [torch.zeros_like(self._features[:1]), self._features[: end - begin - 1]]
                )
            )
            n = end - begin
            mask = None
            if n > 1:
                causal = torch.ones((n, n), dtype=torch.bool, device=self.device).tril()
                prefix = torch.ones((n, first), dtype=torch.bool, device=self.device)
                mask = torch.cat([prefix, causal], dim=1)
            features = self._forward(tokens[begin:end], inputs, first + np.arange(n), first, mask)
            unknown = torch.from_numpy(~self._known[first : first + n]).to(self.device)
            span = self._features[first : first + n]
            span[unknown] = features[unknown]
            begin = end
        return self.pieces.logits(features[-1:])[0].cpu().numpy()
