"""TorchRuntime: token-tree forwards over a preallocated KV cache, commit, rollback, drafting.

State is one sequence: ``committed`` tokens whose keys/values fill cache slots 0..committed-1,
then a *pending* tree of evaluated but unconfirmed nodes in the slots after them. A forward adds
nodes to the pending tree (attending to the whole committed prefix and to their own ancestors
only); ``commit`` keeps one root-to-node path of it, compacting its slots in place right after
the prefix, and drops the rest. Verification is one forward of the drafted tree then a commit
of the accepted path; drafting grows branches in the pending tree one batched forward per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetspec.speculative.sampling import SamplingParams, choose, distribution
from hetspec.speculative.tree import (
    ROOT,
    ancestor_mask,
    chain_parents,
    depths,
    is_path,
    validate_parents,
)
from hetspec.workers.torch_runtime.config import ModelConfig, ModelLoadError
from hetspec.workers.torch_runtime.model import rope_tables
from hetspec.workers.torch_runtime.weights import load_model

DEFAULT_MAX_CONTEXT = 8192  # the KV cache for a 128k-context model would not fit most boxes


class RuntimeUsageError(ValueError):
    """A call the runtime's state does not allow (context full, not a path, ...)."""


@dataclass(frozen=True)
class TreeOutput:
    logits: torch.Tensor  # (nodes, vocab) float32, on the runtime's device
    hidden: torch.Tensor  # (nodes, hidden) last decoder layer output, before the final norm


@dataclass(frozen=True)
class DraftResult:
    tokens: np.ndarray  # (branches, steps) int64
    probs: np.ndarray  # (branches, steps, vocab) float32: the distribution each token came from
    # (branches, steps) pending-tree node of each token; -1 for the last step, which is drawn
    # but not evaluated (its keys/values are computed only if it is accepted).
    nodes: np.ndarray


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


class TorchRuntime:
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
        self.config = ModelConfig.from_folder(folder)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        limit = self.config.max_context
        capacity = max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if not 0 < capacity <= limit:
            raise ModelLoadError(
                f"{folder}: context {capacity} is outside what the model allows (1..{limit})"
            )
        self.capacity = capacity
        self.model = load_model(folder, self.config, self.dtype, self.device)
        self._run_model = torch.compile(self.model, dynamic=True) if compile else self.model
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, capacity, c.head_dim)
        self._keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cos, self._sin = rope_tables(c, capacity, self.device)
        self.tokens: list[int] = []  # the committed sequence
        self._last_hidden: torch.Tensor | None = None  # hidden state of tokens[-1], if known
        self.discard_pending()

    # ------------------------------------------------------------ state

    @property
    def committed(self) -> int:
        return len(self.tokens)

    @property
    def pending(self) -> int:
        return len(self._pending_tokens)

    def discard_pending(self) -> None:
        """Forget the pending tree (its cache slots are simply overwritten later)."""
        self._pending_tokens = np.zeros(0, np.int64)
        self._pending_parents = np.zeros(0, np.int64)
        self._pending_depths = np.zeros(0, np.int64)
        self._pending_mask = np.zeros((0, 0), bool)
        self._pending_hidden: list[torch.Tensor] = []

    def rollback(self, length: int) -> None:
        """Shorten the committed sequence to ``length`` tokens and drop the pending tree."""
        if not 0 <= length <= self.committed:
            raise RuntimeUsageError(f"cannot roll back to {length}: {self.committed} committed")
        if length < self.committed:
            del self.tokens[length:]
            self._last_hidden = None
        self.discard_pending()

    # ------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward_tree(
        self, tokens: Sequence[int], parents: Sequence[int], *, extend: bool = False
    ) -> TreeOutput:
        """Evaluate a token tree below the committed prefix; logits for every node.

        ``parents[i]`` is -1 (the last committed token) or the index of an earlier node of this
        call. With ``extend=True`` the nodes join the existing pending tree instead, and parent
        indices count from its first node (existing nodes first).
        """
        if not extend:
            self.discard_pending()
        hidden = self._evaluate(tokens, parents)
        return TreeOutput(self.model.logits(hidden), hidden)

    def _evaluate(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        token_array = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n, existing = len(token_array), self.pending
        if n == 0:
            raise RuntimeUsageError("a forward needs at least one token")
        if len(parents) != n:
            raise RuntimeUsageError(f"{n} tokens but {len(parents)} parents")
        bad = (token_array < 0) | (token_array >= self.config.vocab_size)
        if bad.any():
            raise RuntimeUsageError(
                f"token id {int(token_array[bad][0])} outside the vocabulary "
                f"(0..{self.config.vocab_size - 1})"
            )
        parent_array = validate_parents(parents, existing)
        node_depths = depths(parent_array, self._pending_depths)
        start = self.committed + existing
        if start + n > self.capacity:
            raise RuntimeUsageError(
                f"context full: {self.committed} committed + {existing + n} tree nodes exceed "
                f"the {self.capacity}-token cache"
            )
        rows = ancestor_mask(parent_array, self._pending_mask)
        positions = self.committed + node_depths
        masks = self._attention_masks(rows, positions, existing)

        device_positions = torch.from_numpy(positions).to(self.device)
        cos = self._cos[device_positions].to(self.dtype)
        sin = self._sin[device_positions].to(self.dtype)
        hidden = self._run_model(
            torch.from_numpy(token_array).to(self.device),
            cos,
            sin,
            cache_keys=self._keys,
            cache_values=self._values,
            start=start,
            masks=masks,
        )
        mask = np.zeros((existing + n, existing + n), bool)
        mask[:existing, :existing] = self._pending_mask
        mask[existing:] = rows
        self._pending_mask = mask
        self._pending_tokens = np.concatenate([self._pending_tokens, token_array])
        self._pending_parents = np.concatenate([self._pending_parents, parent_array])
        self._pending_depths = np.concatenate([self._pending_depths, node_depths])
        self._pending_hidden.append(hidden)
        return hidden

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

    # ------------------------------------------------------------ commit

    @torch.inference_mode()
    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the pending nodes ``nodes`` (one path from the prefix down) and drop the rest."""
        path = [int(node) for node in nodes]
        in_range = all(0 <= node < self.pending for node in path)
        if not (in_range and is_path(path, self._pending_parents)):
            raise RuntimeUsageError(f"nodes {path} are not a path of the pending tree")
        if path:
            start, count = self.committed, len(path)
            if path != list(range(count)):  # move the path's slots right after the prefix
                source = torch.tensor(path, device=self.device) + start
                self._keys[:, :, start : start + count] = self._keys[:, :, source]
                self._values[:, :, start : start + count] = self._values[:, :, source]
            self._last_hidden = torch.cat(self._pending_hidden)[path[-1]]
            self.tokens.extend(int(t) for t in self._pending_tokens[path])
        self.discard_pending()

    def append(self, tokens: Sequence[int], chunk_size: int = 512) -> None:
        """Make ``tokens`` follow the committed sequence, reusing matching pending nodes.

        What the pending tree already evaluated along ``tokens`` (a draft branch that was
        accepted) is committed without recomputation; the rest is evaluated in chunks.
        """
        matched, parent = [], ROOT
        for token in tokens:
            hits = np.flatnonzero(
                (self._pending_parents == parent) & (self._pending_tokens == token)
            )
            if not len(hits):
                break
            parent = int(hits[0])
            matched.append(parent)
        self.commit(matched)
        rest = list(tokens[len(matched) :])
        with torch.inference_mode():
            for begin in range(0, len(rest), chunk_size):
                chunk = rest[begin : begin + chunk_size]
                self._evaluate(chunk, chain_parents(len(chunk)))
                self.commit(range(len(chunk)))

    def prefill(self, prompt: Sequence[int], chunk_size: int = 512) -> int:
        """Make the committed sequence exactly ``prompt``; returns how many tokens were reused.

        The longest common prefix with what is committed stays in the cache (a chat's earlier
        turns), at least one token is re-evaluated so the last token's output is fresh.
        """
        if not prompt:
            raise RuntimeUsageError("the prompt is empty")
        common = 0
        for mine, theirs in zip(self.tokens, prompt, strict=False):
            if mine != theirs:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        self.rollback(common)
        self.append(list(prompt[common:]), chunk_size)
        return common

    # ------------------------------------------------------------ drafting

    @torch.inference_mode()
    def last_logits(self) -> torch.Tensor:
        """Logits (vocab,) of the next token after the committed sequence."""
        if self._last_hidden is None:
            if not self.tokens:
                raise RuntimeUsageError("nothing committed yet: prefill a prompt first")
            last = self.tokens[-1]
            self.rollback(self.committed - 1)
            self.append([last])
        return self.model.logits(self._last_hidden[None])[0]

    @torch.inference_mode()
    def draft(
        self,
        steps: int,
        params: SamplingParams,
        rng: np.random.Generator,
        *,
        branches: int = 1,
        out: np.ndarray | None = None,
    ) -> DraftResult:
        """Draft ``branches`` continuations of ``steps`` tokens each, one forward per step.

        Branch first tokens are the top-``branches`` tokens when greedy, independent draws when
        sampling. ``out`` (branches, steps, vocab) float32 receives the probability rows (e.g. a
        shared-memory slot); one is allocated when not given.
        """
        vocab = self.config.vocab_size
        if steps < 1 or not 1 <= branches <= vocab:
            raise RuntimeUsageError(f"cannot draft {branches} branches of {steps} steps")
        shape = (branches, steps, vocab)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise RuntimeUsageError(f"out must be C-contiguous float32 {shape}, not {out.shape}")
        first = self.last_logits().cpu().numpy()
        self.discard_pending()
        tokens = np.empty((branches, steps), np.int64)
        nodes = np.full((branches, steps), -1, np.int64)
        distribution(first, params, out=out[0, 0])
        out[1:, 0] = out[0, 0]
        if params.greedy:
            tokens[:, 0] = np.argsort(-out[0, 0], kind="stable")[:branches]
        else:
            tokens[:, 0] = choose(out[:, 0], params, rng)
        for step in range(1, steps):
            parents = nodes[:, step - 2] if step > 1 else np.full(branches, ROOT)
            nodes[:, step - 1] = self.pending + np.arange(branches)
            hidden = self._evaluate(tokens[:, step - 1], parents)
            logits = self.model.logits(hidden).cpu().numpy()
            distribution(logits, params, out=out[:, step])
            tokens[:, step] = choose(out[:, step], params, rng)
        return DraftResult(tokens, out, nodes)
