"""A Llama-family GGUF file laid out for the native kernels: weights mapped in place, a KV cache.

``NativeModel`` builds on ``model_file.ModelFile``, which reads and checks the file (what it
supports is said there): it assembles the kernels' model (its layers, RoPE tables, the KV
cache of ``capacity`` slots, float16 as the kernels store it) and makes the calls into them.

Contract: the calls hand the kernels C-contiguous arrays of the dtypes they take (converting
what they are given; ``draft_chain`` refuses ``probs``, ``noise`` or ``uniforms`` of another
shape) and return logits and tokens as new arrays. The KV cache is ``keys`` and ``values``
(layers, KV heads, slots, head_dim), written by the calls at the slots they are given and
moved by ``move_slots`` alone. ``ModelFormatError``, ``FAMILIES``, ``ROPE_SCALINGS``, the
other constants and ``rope_tables`` are importable from here, as before the split.

Several sequences share one cache by owning ranges of its slots: ``forward`` with
``prefix_start`` computes one sequence's rows in its range, ``forward_sequences`` the rows of
several (``SequenceRows`` each) in one call, each row bit for bit what it is in a call of its
own (the kernels' width invariance, across sequences).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetspec.native.kernels import BEST, GELU_TANH, SILU, Layer, Model
from hetspec.native.model_file import (
    DEFAULT_MAX_CONTEXT,
    FAMILIES,
    GEMMA2_SOFTCAPS,
    GEMMA2_WINDOW,
    GEMMA3_WINDOW_THETA,
    GEMMA_WIDE_QUERY_LAYERS,
    GEMMA_WINDOW_PATTERN,
    LAYER_TENSORS,
    PACK_LIMIT_BYTES,
    ROPE_SCALINGS,
    ModelFile,
    ModelFormatError,
    rope_tables,
)

__all__ = [
    "DEFAULT_MAX_CONTEXT",
    "FAMILIES",
    "GEMMA2_SOFTCAPS",
    "GEMMA2_WINDOW",
    "GEMMA3_WINDOW_THETA",
    "GEMMA_WIDE_QUERY_LAYERS",
    "GEMMA_WINDOW_PATTERN",
    "LAYER_TENSORS",
    "PACK_LIMIT_BYTES",
    "ROPE_SCALINGS",
    "ModelFormatError",
    "NativeModel",
    "SequenceRows",
    "rope_tables",
]


def cache_array(shape: tuple[int, ...], shared: bool) -> np.ndarray:
    """Zeros of ``shape`` in float16 for a KV cache. A cache shared by several sequences is
    mapped without numpy's advice to use huge pages, so that memory is committed as slots
    are first written: with it, the first sequence's writes (a few KiB in each layer's and
    head's plane) made the whole cache resident, 2 MiB a plane (SmolLM2-135M, 16384 slots:
    one 512-token sequence's prefill grew the resident memory by 422 MiB, now by 76)."""
    if not shared:
        return np.zeros(shape, np.float16)
    size = max(int(np.prod(shape)), 1) * 2
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, np.float16).reshape(shape)


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows in ``NativeModel.forward_sequences``: ``tokens`` at ``positions``
    (counted within the sequence) into cache slots start..start+rows-1; row j sees the
    sequence's committed prefix, slots prefix_start..prefix_start+prefix-1, then
    ``visible[offsets[j]:offsets[j + 1]]`` (cache slots after the prefix up to its own, in
    increasing order: its pending ancestors, ending with itself); logits for rows
    first_logit.. (0: every row, a tree to verify; rows - 1: a prompt's chunk)."""

    tokens: np.ndarray
    positions: np.ndarray
    prefix_start: int
    prefix: int
    start: int
    offsets: np.ndarray
    visible: np.ndarray
    first_logit: int = 0


class NativeModel(ModelFile):
    """The weights of ``path``, a KV cache of ``capacity`` slots, and one forward call."""

    def __init__(
        self,
        path: str | Path,
        capacity: int | None = None,
        simd: int = BEST,
        pack: bool | None = None,
        *,
        shared: bool = False,
    ) -> None:
        """Read ``path`` as ``ModelFile`` does (its arguments' meaning is there), then lay
        the model out for the kernels at level ``simd``."""
        super().__init__(path, capacity, simd, pack, shared=shared)
        embed = self._matrix("token_embd.weight")
        self.vocab = embed.rows
        output = self._matrix("output.weight") if "output.weight" in self._tensors else embed
        layers = (Layer * self.n_layers)()
        for index in range(self.n_layers):
            self._read_layer(layers[index], index)
        output_norm = self._vector("output_norm.weight")
        self._check_all_used()
        cos, sin = rope_tables(
            self.capacity,
            self.head_dim,
            self._rope_theta,
            self._rope_factor,
            self._rope_frequency_factors,
        )
        local = self._window_rope_tables()
        for layer, window in zip(layers, self.windows, strict=True):
            layer.window = window
            if window and local is not None:
                layer.rope_cos, layer.rope_sin = (table.ctypes.data for table in local)
        shape = (self.n_layers, self.n_kv_heads, self.capacity, self.head_dim)
        self.keys = cache_array(shape, shared)  # float16, as the kernels store them
        self.values = cache_array(shape, shared)
        self._keep += [layers, cos, sin]
        self.struct = Model(
            self.n_layers,
            self.d_model,
            self.n_ff,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.vocab,
            self.capacity,
            self.eps,
            simd,
            layers,
            output_norm,
            embed,
            output,
            cos.ctypes.data,
            sin.ctypes.data,
            self.keys.ctypes.data,
            self.values.ctypes.data,
            FAMILIES[self.architecture],
            GELU_TANH if self._gemma else SILU,
            float(np.sqrt(np.float32(self.d_model))) if self._gemma else 0.0,
            self._attention_scale(),
            *self._softcaps,
        )

    # ------------------------------------------------------------ computing

    def forward(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        *,
        start: int,
        prefix: int,
        offsets: np.ndarray,
        visible: np.ndarray,
        first_logit: int,
        threads: int,
        prefix_start: int = 0,
    ) -> np.ndarray:
        """Logits (n - first_logit, vocab) of new tokens at cache slots start..start+n-1; row
        i sees slots prefix_start..prefix_start+prefix-1 and ``visible[offsets[i]:offsets[i +
        1]]`` (a sequence in a range of the cache: ``SequenceRows``'s meaning)."""
        if prefix_start:
            rows = SequenceRows(
                tokens, positions, prefix_start, prefix, start, offsets, visible, first_logit
            )
            return self.forward_sequences([rows], threads=threads)[0]
        logits = np.empty((len(tokens) - first_logit, self.vocab), np.float32)
        self.kernels.forward(
            self.struct,
            np.ascontiguousarray(tokens, np.int32),
            np.ascontiguousarray(positions, np.int32),
            start=start,
            prefix=prefix,
            offsets=np.ascontiguousarray(offsets, np.int32),
            visible=np.ascontiguousarray(visible, np.int32),
            first_logit=first_logit,
            logits=logits,
            threads=threads,
        )
        return logits

    def forward_sequences(
        self, sequences: Sequence[SequenceRows], *, threads: int
    ) -> list[np.ndarray]:
        """The rows of several sequences in one forward: each sequence's logits (rows -
        first_logit, vocab), views of one array. Each row's logits, and the keys and values it
        writes, are bit for bit those of the same row computed in a call of its own. The
        sequences' spans (prefix_start..start+rows-1) must not overlap: ``ValueError``."""
        if not sequences:
            raise ValueError("a forward needs at least one sequence")
        table = np.array(
            [
                (len(rows.tokens), rows.prefix_start, rows.prefix, rows.start, rows.first_logit)
                for rows in sequences
            ],
            np.int32,
        )
        # each sequence's offsets moved to where its visible slots land in the concatenation
        offsets, visible, shift = [np.zeros(1, np.int32)], [], 0
        for rows in sequences:
            if len(rows.offsets) != len(rows.tokens) + 1:
                raise ValueError(f"{len(rows.tokens)} rows need {len(rows.tokens) + 1} offsets")
            first, last = int(rows.offsets[0]), int(rows.offsets[-1])
            offsets.append(np.asarray(rows.offsets[1:]) + (shift - first))
            visible.append(rows.visible[first:last])
            shift += last - first
        outputs = [len(rows.tokens) - rows.first_logit for rows in sequences]
        logits = np.empty((sum(outputs), self.vocab), np.float32)
        self.kernels.forward_sequences(
            self.struct,
            table,
            np.concatenate([rows.tokens for rows in sequences]).astype(np.int32, copy=False),
            np.concatenate([rows.positions for rows in sequences]).astype(np.int32, copy=False),
            offsets=np.concatenate(offsets).astype(np.int32, copy=False),
            visible=np.concatenate(visible).astype(np.int32, copy=False),
            logits=logits,
            threads=threads,
        )
        ends = np.cumsum(outputs).tolist()
        return [logits[end - count : end] for count, end in zip(outputs, ends, strict=True)]

    def draft_chain(
        self,
        first: int,
        count: int,
        *,
        position: int,
        start: int,
        prefix: int,
        base: np.ndarray,
        threads: int,
        temperature: float = 1.0,
        noise: np.ndarray | None = None,
        uniforms: np.ndarray | None = None,
        probs: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A chain of ``count`` forwards from token ``first`` at slot ``start`` and
        ``position``, seeing slots 0..prefix-1, ``base`` and its own chain: the chain's
        count + 1 tokens (``first`` and each forward's choice: the argmax, or from
        softmax(logits / temperature) by (count, vocab) ``noise`` or (count,) ``uniforms``,
        see ``hs_draft_chain``), its (count, vocab) logits and the probability rows the tokens
        came from (greedy: the softmax rows where ``probs`` is given, else None), written
        into ``probs`` (C-contiguous float32 (count, vocab)) where given."""
        tokens = np.zeros(count + 1, np.int32)
        tokens[0] = first
        logits = np.empty((count, self.vocab), np.float32)
        sampled = noise is not None or uniforms is not None
        shape = (count, self.vocab)
        if probs is not None and (
            probs.shape != shape or probs.dtype != np.float32 or not probs.flags.c_contiguous
        ):
            raise ValueError(f"probs must be C-contiguous float32 {shape}, not {probs.shape}")
        if probs is None and sampled:
            probs = np.empty(shape, np.float32)
        if noise is not None and noise.shape != logits.shape:
            raise ValueError(f"noise must be {logits.shape}, not {noise.shape}")
        if uniforms is not None and uniforms.shape != (count,):
            raise ValueError(f"uniforms must be ({count},), not {uniforms.shape}")
        self.kernels.draft_chain(
            self.struct,
            tokens,
            position=position,
            start=start,
            prefix=prefix,
            base=np.ascontiguousarray(base, np.int32),
            logits=logits,
            temperature=temperature,
            noise=None if noise is None else np.ascontiguousarray(noise, np.float32),
            uniforms=None if uniforms is None else np.ascontiguousarray(uniforms, np.float64),
            probs=probs,
            threads=threads,
        )
        return tokens, logits, probs

    def draft_branches(
        self,
        firsts: np.ndarray,
        count: int,
        *,
        position: int,
        start: int,
        prefix: int,
        base: np.ndarray,
        threads: int,
        probs: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Greedy chains of ``count`` forwards below the same node, one per first token of
        ``firsts``, side by side (see ``hs_draft_branches``): their tokens (count + 1,
        branches), the first ones in row 0, and their (count x branches, vocab) logits, step
        by step; each row's softmax into ``probs`` [:, 1:] ((branches, count + 1, vocab))
        where given."""
        branches = len(firsts)
        tokens = np.zeros((count + 1, branches), np.int32)
        tokens[0] = firsts
        logits = np.empty((count * branches, self.vocab), np.float32)
        self.kernels.draft_branches(
            self.struct,
            tokens,
            position=position,
            start=start,
            prefix=prefix,
            base=np.ascontiguousarray(base, np.int32),
            logits=logits,
            probs=probs,
            threads=threads,
        )
        return tokens, logits

    def move_slots(self, sources: np.ndarray, first: int) -> None:
        """Copy the keys/values of slots ``sources`` to slots first, first + 1, ..."""
        targets = first + np.arange(len(sources))
        self.keys[:, :, targets] = self.keys[:, :, sources]
        self.values[:, :, targets] = self.values[:, :, sources]
