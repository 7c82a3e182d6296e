"""A Llama-family GGUF file read for the native kernels: its settings checked, its tensors
mapped in place as the kernels read them.

The weights stay in the file's pages (``protocol.gguf_header`` maps it read-only), so the native
runtime shares them with the page cache instead of holding a second copy. What it supports is
what llama.cpp writes for its ``llama``, ``qwen2``, ``qwen3``, ``gemma2`` and ``gemma3``
architectures: grouped-query attention, RoPE over whole heads (default or linear scaling,
per-frequency factors as Llama 3 files carry them), SwiGLU, RMSNorm, optional biases on every
projection (Qwen2's q, k, v), optional per-head query/key norms (Qwen3), untied or tied
output; and Gemma's parts: scaled embeddings, GeGLU, norms after attention and feed-forward,
sliding windows on some layers (Gemma 3's with their own rotary base), Gemma 2's soft caps of
the attention scores and the logits, read as llama.cpp reads them.

Contract: ``ModelFile`` (the layer ``model.NativeModel`` derives from) reads the header, the
shape and the settings (RoPE, windows, soft caps, the attention scale) as llama.cpp reads
them, and hands each tensor over as the kernels take it (a ``Matrix``, Q8_0 ones with a packed
copy where ``packed``; a vector's address; a ``Layer``'s fields), the arrays C points into
kept alive (``_keep``). A file with any tensor or setting this does not account for is refused
(``ModelFormatError``, naming the file and why; ``_check_all_used`` once every tensor is
read): computing without it would be a different model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from hetspec.native.kernels import (
    BEST,
    BLOCK,
    MATRICES,
    PACKED_SIGNED,
    PACKED_UNSIGNED,
    Q8_0,
    SIMD_LEVELS,
    TYPE_NAMES,
    Kernels,
    Layer,
    Matrix,
    NativeUnavailable,
    matrix,
)
from hetspec.protocol.gguf_checks import GGUFMetadataError, ModelShape, check_model
from hetspec.protocol.gguf_header import TensorInfo, read_gguf_header

LAYER_TENSORS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
assert tuple(LAYER_TENSORS) == MATRICES
# architecture -> whether a head's halves rotate together (llama.cpp's NEOX rotation) rather
# than adjacent pairs; llama.cpp's converter reorders Llama's q/k rows for the pairs
FAMILIES = {"llama": False, "qwen2": True, "qwen3": True, "gemma2": True, "gemma3": True}
DEFAULT_MAX_CONTEXT = 8192
ROPE_SCALINGS = ("none", "linear")  # of llama.cpp's, the ones computed here
# Q8_0 weights up to this size get a packed copy for calls of few rows (hs_matrix.packed):
# such a model's weights stay in the caches, where transposing blocks in registers, not
# memory, bounds a drafter's token; a larger model streams from memory at one row's pace
# either way, and a copy would double its memory
PACK_LIMIT_BYTES = 64 << 20
# Gemma as llama.cpp reads it when the file does not say: the period of its window pattern
# (Gemma 3: five windowed layers, then a global one; Gemma 2: every other layer windowed, from
# the first), Gemma 2's window and soft caps, Gemma 3's windowed layers' rotary base
GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA2_WINDOW = 4096
GEMMA2_SOFTCAPS = (50.0, 30.0)  # attention scores, logits
GEMMA3_WINDOW_THETA = 10000.0
# layers of the model whose query scale llama.cpp takes from the width per head (27B)
GEMMA_WIDE_QUERY_LAYERS = {"gemma2": 46, "gemma3": 62}


class ModelFormatError(NativeUnavailable):
    """A GGUF file the native kernels cannot run; the message names the file and why."""


class ModelFile:
    """The header, settings and tensors of the GGUF file ``path``, for a KV cache of
    ``capacity`` slots."""

    def __init__(
        self,
        path: str | Path,
        capacity: int | None = None,
        simd: int = BEST,
        pack: bool | None = None,
        *,
        shared: bool = False,
    ) -> None:
        """``simd``: the most capable kernel level to use (``kernels.SIMD_LEVELS``);
        ``pack``: whether Q8_0 matrices get a packed copy, with values of the kind the level
        reads (None: where the level reads one and the model's Q8_0 weights are at most
        ``PACK_LIMIT_BYTES``); ``shared``: the cache is shared by several sequences, so it
        may hold more slots than the trained context, and ``context`` (the most positions
        one sequence may reach) is the trained context, not the whole cache."""
        self.path = Path(path)
        self.kernels = Kernels.load()
        shape = self._read_header()
        self._tensors = self._header.tensors
        self._keep: list[object] = []  # arrays and structs C holds pointers into
        self.architecture = str(self._field("general.architecture"))
        if shape is None or self.architecture not in FAMILIES:
            raise ModelFormatError(
                f"{self.path}: architecture {self.architecture!r}; the native "
                f"runtime runs {', '.join(FAMILIES)}"
            )
        self.d_model, self.n_layers = shape.embedding_length, shape.block_count
        self.n_heads, self.n_kv_heads = shape.head_count, shape.head_count_kv
        self.head_dim, self.n_ff = shape.key_length, shape.feed_forward_length
        if shape.value_length != self.head_dim:
            raise ModelFormatError(f"{self.path}: values and keys of different widths")
        self.eps = float(self._hparam("attention.layer_norm_rms_epsilon"))
        trained = shape.context_length
        self.capacity = capacity or min(trained, DEFAULT_MAX_CONTEXT)
        self.context = min(self.capacity, trained) if shared else self.capacity
        if not 0 < self.context <= trained:
            raise ModelFormatError(
                f"{self.path}: context {self.context} is outside what the "
                f"model allows (1..{trained})"
            )
        self._used: set[str] = set()  # the tensors read: any other one is refused
        self._check_rope()
        self._gemma = self.architecture in ("gemma2", "gemma3")
        self.windows = self._read_windows()
        self._softcaps = self._read_softcaps()
        self.packed = self._packs(simd) if pack is None else pack
        vnni = self.kernels.level_for(simd) >= SIMD_LEVELS.get("avx_vnni", 99)
        self._packing = PACKED_UNSIGNED if vnni else PACKED_SIGNED  # what the level reads

    # ------------------------------------------------------------ reading the file

    def _read_header(self) -> ModelShape | None:
        """Read the header (``_header``); its numbers checked against its tensors
        (protocol/gguf_checks.py), before anything is sized by them."""
        try:
            self._header = read_gguf_header(self.path)
        except (OSError, ValueError) as error:
            raise ModelFormatError(f"{self.path}: not a readable GGUF file ({error})") from None
        try:
            return check_model(self._header)
        except GGUFMetadataError as error:
            raise ModelFormatError(str(error)) from None

    def _field(self, key: str, default: object = None) -> object:
        value = self._header.fields.get(key)
        if value is None:
            if default is None:
                raise ModelFormatError(f"{self.path}: lacks {key!r}")
            return default
        return value

    def _hparam(self, key: str, default: object = None) -> object:
        return self._field(f"{self.architecture}.{key}", default)

    def _tensor(self, name: str) -> TensorInfo:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelFormatError(f"{self.path}: lacks tensor {name!r}")
        self._used.add(name)
        return tensor

    def _read_layer(self, layer: Layer, index: int) -> None:
        prefix = f"blk.{index}."
        layer.attn_norm = self._vector(f"{prefix}attn_norm.weight", self.d_model)
        layer.ffn_norm = self._vector(f"{prefix}ffn_norm.weight", self.d_model)
        for field, name in LAYER_TENSORS.items():
            weights = self._matrix(f"{prefix}{name}.weight")
            setattr(layer, field, weights)
            if f"{prefix}{name}.bias" in self._tensors:
                setattr(layer, f"{field}_bias", self._vector(f"{prefix}{name}.bias", weights.rows))
        for field in ("q_norm", "k_norm"):
            name = f"{prefix}attn_{field}.weight"
            if name in self._tensors:
                setattr(layer, field, self._vector(name, self.head_dim))
        if self.architecture in ("qwen3", "gemma3") and not (layer.q_norm and layer.k_norm):
            raise ModelFormatError(
                f"{self.path}: a {self.architecture} file needs attn_q_norm "
                f"and attn_k_norm in layer {index}"
            )
        if self._gemma:
            layer.post_attn_norm = self._vector(f"{prefix}post_attention_norm.weight")
            layer.post_ffn_norm = self._vector(f"{prefix}post_ffw_norm.weight")

    def _read_softcaps(self) -> tuple[float, float]:
        """Gemma 2's soft caps of the attention scores and of the logits (0: none), as
        llama.cpp reads them: a gemma3 file's final cap is taken, its attention cap ignored
        (llama.cpp's gemma3 has none)."""
        if self.architecture == "gemma2":
            attention, final = GEMMA2_SOFTCAPS
            return (
                float(self._hparam("attn_logit_softcapping", attention)),
                float(self._hparam("final_logit_softcapping", final)),
            )
        if self.architecture == "gemma3":
            return 0.0, float(self._hparam("final_logit_softcapping", 0.0))
        return 0.0, 0.0

    def _read_windows(self) -> list[int]:
        """Each layer's sliding window (0: none): Gemma's, as llama.cpp reads them."""
        if not self._gemma:
            return [0] * self.n_layers
        default = GEMMA2_WINDOW if self.architecture == "gemma2" else 0
        window = int(self._hparam("attention.sliding_window", default))
        if window <= 0:
            return [0] * self.n_layers
        period = GEMMA_WINDOW_PATTERN[self.architecture]
        pattern = self._hparam("attention.sliding_window_pattern", period)
        if isinstance(pattern, list):  # one flag per layer
            if len(pattern) != self.n_layers:
                raise ModelFormatError(
                    f"{self.path}: sliding_window_pattern has {len(pattern)} "
                    f"entries for {self.n_layers} layers"
                )
            return [window if flag else 0 for flag in pattern]
        every = int(pattern)  # the last layer of each run of `every` is global (0: none is)
        return [window if every == 0 or i % every < every - 1 else 0 for i in range(self.n_layers)]

    def _window_rope_tables(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The windowed layers' rotary tables where they differ from the others' (None):
        Gemma 3's rotate with their own base (10,000 unless the file says), unscaled; Gemma
        2's as the others unless the file gives them a base."""
        if not any(self.windows):
            return None
        default = GEMMA3_WINDOW_THETA if self.architecture == "gemma3" else 0.0
        theta = float(self._hparam("rope.freq_base_swa", default))
        if not theta:
            return None
        factor = self._rope_factor if self.architecture == "gemma2" else 1.0
        tables = rope_tables(self.capacity, self.head_dim, theta, factor)
        self._keep.append(tables)
        return tables

    def _attention_scale(self) -> float:
        """Gemma's query scale as llama.cpp sets it (the 27B models by the model width per
        head, the others by head_dim); 0: the kernels' 1 / sqrt(head_dim)."""
        if not self._gemma:
            return 0.0
        wide = self.n_layers == GEMMA_WIDE_QUERY_LAYERS[self.architecture]
        width = self.d_model // self.n_heads if wide else self.head_dim
        return float(np.float32(1.0) / np.sqrt(np.float32(width)))

    def _check_all_used(self) -> None:
        unused = sorted(set(self._tensors) - self._used)
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise ModelFormatError(
                f"{self.path}: tensor(s) {', '.join(unused[:3])}{more} mean a computation the "
                f"native kernels do not do (a {self.architecture} model with extra parts)"
            )

    def _matrix(self, name: str) -> Matrix:
        tensor = self._tensor(name)
        kind = tensor.type
        if kind not in TYPE_NAMES:
            raise ModelFormatError(
                f"{self.path}: {name} is {tensor.type_name}; the native kernels read "
                f"{', '.join(TYPE_NAMES.values())}"
            )
        if len(tensor.shape) != 2:
            raise ModelFormatError(f"{self.path}: {name} has shape {tensor.shape}, not a matrix")
        cols, rows = tensor.shape
        data = np.ascontiguousarray(self._header.tensor_data(tensor))
        self._keep.append(data)
        try:
            weights = matrix(kind, data, rows, cols)
        except NativeUnavailable as error:
            raise ModelFormatError(f"{self.path}: {name}: {error}") from None
        if self.packed and kind == Q8_0 and rows >= 8:
            packed = self.kernels.pack_q8_0(weights, self._packing)
            self._keep.append(packed)
            weights.packed, weights.packing = packed.ctypes.data, self._packing
        return weights

    def _packs(self, simd: int) -> bool:
        """Whether the kernels read packed Q8_0 copies at this level (x86's SIMD ones) and
        the model is small enough to keep them."""
        avx2 = SIMD_LEVELS.get("avx2")
        if avx2 is None or self.kernels.level_for(simd) < avx2:
            return False
        q8 = sum(t.nbytes for t in self._tensors.values() if t.type == Q8_0 and len(t.shape) == 2)
        return 0 < q8 <= PACK_LIMIT_BYTES

    def _vector(self, name: str, length: int | None = None) -> int:
        """The address of F32 vector ``name`` of ``length`` (default d_model) values."""
        length = length or self.d_model
        tensor = self._tensor(name)
        if tensor.type != gguf.GGMLQuantizationType.F32 or tensor.shape != (length,):
            raise ModelFormatError(f"{self.path}: {name} must be F32 ({length},)")
        data = self._header.tensor_data(tensor)
        self._keep.append(data)
        return data.ctypes.data

    def _check_rope(self) -> None:
        rotated = int(self._hparam("rope.dimension_count", self.head_dim))
        if rotated != self.head_dim:
            raise ModelFormatError(
                f"{self.path}: RoPE over {rotated} of {self.head_dim} dimensions is not supported"
            )
        scaling = str(self._hparam("rope.scaling.type", "none"))
        if scaling not in ROPE_SCALINGS:
            raise ModelFormatError(f"{self.path}: RoPE scaling {scaling!r} is not supported")
        self._rope_theta = float(self._hparam("rope.freq_base", 10000.0))
        factor = float(self._hparam("rope.scaling.factor", 1.0))
        self._rope_factor = factor if scaling == "linear" else 1.0
        self._rope_frequency_factors = None  # Llama 3's: one per rotated pair, dividing it
        if "rope_freqs.weight" in self._tensors:
            tensor = self._tensor("rope_freqs.weight")
            if tensor.type != gguf.GGMLQuantizationType.F32 or tensor.shape != (
                self.head_dim // 2,
            ):
                raise ModelFormatError(
                    f"{self.path}: rope_freqs.weight must be F32 ({self.head_dim // 2},)"
                )
            self._rope_frequency_factors = np.array(self._header.tensor_data(tensor), np.float64)
        if self.d_model % BLOCK or self.n_ff % BLOCK or (self.n_heads * self.head_dim) % BLOCK:
            raise ModelFormatError(f"{self.path}: widths must be multiples of {BLOCK}")


def rope_tables(
    length: int,
    head_dim: int,
    theta: float,
    factor: float = 1.0,
    frequency_factors: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (length, head_dim / 2) float32: the angle of pair i at position p is
    p / factor * theta ** (-2 i / head_dim) / frequency_factors[i], computed in float64."""
    inverse = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / factor
    if frequency_factors is not None:
        inverse = inverse / frequency_factors
    angles = np.outer(np.arange(length, dtype=np.float64), inverse)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
