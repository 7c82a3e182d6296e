"""ctypes bindings of the native kernels; their contracts are in native/src/hsnative.h.

The C code ships as the extension module ``hetspec.native._hsnative`` (built by setup.py,
optional): loading it as a shared library gives the functions. Arrays cross as pointers, so
every array handed in must be C-contiguous and of the stated dtype; the helpers here check.
"""

from __future__ import annotations

import ctypes
import importlib.util
import platform
from dataclasses import dataclass

import numpy as np

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8  # ggml's type ids
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 12, 13, 14, 20, 23
BLOCK = 32  # the activations' blocks
PACKED_BYTES = 8 * 4 + 8 * BLOCK  # hs_matrix.packed: one group of 8 rows, one block
PACKED_UNSIGNED, PACKED_SIGNED = 1, 2  # hs_matrix.packing: its values (the VNNI levels', AVX2's)
TYPE_NAMES = {
    F32: "F32",
    F16: "F16",
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q5_0: "Q5_0",
    Q5_1: "Q5_1",
    Q8_0: "Q8_0",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
    IQ4_NL: "IQ4_NL",
    IQ4_XS: "IQ4_XS",
}
# The quantized types' blocks: (values, bytes). K-quants' and IQ4_XS's super-blocks hold 256.
BLOCK_BYTES = {
    Q8_0: (32, 34),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
    IQ4_NL: (32, 18),
    IQ4_XS: (256, 136),
}
# Kernel levels (hsnative.h's HS_SIMD_*), by this machine's architecture. x86-64: AVX2, AVX-VNNI
# (vpdpbusd on 256-bit vectors) and VNNI (AVX-512 VNNI) give the same bits, each faster than the
# last, and the portable C rounds its other float steps its own way; aarch64: the dot-product
# kernels give the portable bits. A CPU may lack a level below its best (AVX-512 VNNI without
# AVX-VNNI): a cap runs the best level it has at or below the cap.
SIMD_LEVELS = (
    {"portable": 0, "dotprod": 1}
    if platform.machine().lower() in ("aarch64", "arm64")
    else {"portable": 0, "avx2": 1, "avx_vnni": 2, "vnni": 3}
)
BEST = -1  # as a cap: the best level this CPU runs


class NativeUnavailable(RuntimeError):
    """The kernels were not built for this install, or cannot run here."""


class Matrix(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("packing", ctypes.c_int32),  # packed's values (PACKED_*; 0: no packed copy)
        ("data", ctypes.c_void_p),
        ("packed", ctypes.c_void_p),  # optional: None
    ]


MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's, in hs_layer's order


class Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        *((name, Matrix) for name in MATRICES),
        *((f"{name}_bias", ctypes.c_void_p) for name in MATRICES),  # optional: None
        ("q_norm", ctypes.c_void_p),  # optional: None
        ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),  # optional: None (Gemma's sandwich norms)
        ("post_ffn_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),  # optional: None, the model's tables
        ("rope_sin", ctypes.c_void_p),
        ("window", ctypes.c_int32),  # > 0: a sliding window of that many positions
        ("reserved", ctypes.c_int32),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int32)
            for name in (
                "n_layers",
                "d_model",
                "n_ff",
                "n_heads",
                "n_kv_heads",
                "head_dim",
                "vocab",
                "capacity",
            )
        ),
        ("eps", ctypes.c_float),
        ("simd", ctypes.c_int32),  # the most capable kernel level allowed; BEST: any
        ("layers", ctypes.POINTER(Layer)),
        ("output_norm", ctypes.c_void_p),
        ("embed", Matrix),
        ("output", Matrix),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("rope_halves", ctypes.c_int32),  # 1: values (i, i + head_dim/2) rotate together
        ("activation", ctypes.c_int32),  # SILU or GELU_TANH
        ("embed_scale", ctypes.c_float),  # > 0: embeddings times it
        ("attn_scale", ctypes.c_float),  # > 0: scores q.k times it, else 1 / sqrt(head_dim)
        ("attn_softcap", ctypes.c_float),  # > 0: scores, then logits, cap * tanh(x / cap)
        ("final_softcap", ctypes.c_float),
    ]


SILU, GELU_TANH = 0, 1  # hs_model.activation
# hs_sequence's fields: an (n_sequences, 5) int32 array of these columns is an array of them
SEQUENCE_FIELDS = ("rows", "prefix_start", "prefix_len", "start", "first_logit")


def row_bytes(kind: int, cols: int) -> int:
    """Bytes of one weight row of ``cols`` values in ggml type ``kind``."""
    if kind == F32:
        return 4 * cols
    if kind == F16:
        return 2 * cols
    if kind in BLOCK_BYTES:
        values, size = BLOCK_BYTES[kind]
        return cols // values * size
    raise NativeUnavailable(f"ggml type {kind} is not one the native kernels read")


def matrix(kind: int, data: np.ndarray, rows: int, cols: int) -> Matrix:
    """A ``Matrix`` over ``data`` (C reads it in place). A copy of the structure, e.g. a field
    of a ``Layer``, does not keep ``data`` alive: its holder must."""
    if kind not in TYPE_NAMES:
        raise NativeUnavailable(f"ggml type {kind} is not one the native kernels read")
    if kind in BLOCK_BYTES and cols % BLOCK_BYTES[kind][0]:
        raise NativeUnavailable(
            f"a {TYPE_NAMES[kind]} row of {cols} values is not whole blocks "
            f"of {BLOCK_BYTES[kind][0]}"
        )
    if not data.flags.c_contiguous or data.nbytes != rows * row_bytes(kind, cols):
        raise NativeUnavailable(
            f"{rows}x{cols} {TYPE_NAMES[kind]} weights need "
            f"{rows * row_bytes(kind, cols)} contiguous bytes, "
            f"not {data.nbytes}"
        )
    weights = Matrix(kind, rows, cols, 0, data.ctypes.data)
    weights.owner = data  # keeps the bytes alive as long as this Matrix (not its copies)
    return weights


def _pointer(array: np.ndarray, dtype: type) -> ctypes.c_void_p:
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous {np.dtype(dtype).name} array")
    return ctypes.c_void_p(array.ctypes.data)


@dataclass(frozen=True)
class Kernels:
    """The loaded library, with typed entry points."""

    library: ctypes.CDLL

    @classmethod
    def load(cls, path: str | None = None) -> Kernels:
        """The installed build, or the shared library at ``path`` (another build of the same
        sources, e.g. to time two builds in one process)."""
        if path is None:
            spec = importlib.util.find_spec("hetspec.native._hsnative")
            if spec is None or spec.origin is None:
                raise NativeUnavailable(
                    "hetspec's native kernels were not built (the install found no C compiler "
                    "with OpenMP); install gcc and run `make setup` again"
                )
            path = spec.origin
        try:
            library = ctypes.CDLL(path)
        except OSError as error:
            raise NativeUnavailable(f"cannot load the native kernels: {error}") from None
        library.hs_simd_level.restype = ctypes.c_int
        library.hs_simd_supported.restype = ctypes.c_int
        library.hs_quantize_rows.restype = None
        library.hs_matmul.restype = ctypes.c_int
        library.hs_dequantize_rows.restype = ctypes.c_int
        library.hs_forward.restype = ctypes.c_int
        library.hs_forward_sequences.restype = ctypes.c_int
        library.hs_draft_chain.restype = ctypes.c_int
        library.hs_draft_branches.restype = ctypes.c_int
        library.hs_pack_q8_0.restype = ctypes.c_int
        library.hs_argmax.restype = ctypes.c_int
        return cls(library)

    def simd_level(self) -> int:
        """The best kernel level this CPU runs (a value of ``SIMD_LEVELS``)."""
        return self.library.hs_simd_level()

    def simd_levels(self) -> list[int]:
        """Every kernel level this CPU runs, increasing (values of ``SIMD_LEVELS``)."""
        return [
            level for level in sorted(SIMD_LEVELS.values()) if self.library.hs_simd_supported(level)
        ]

    def level_for(self, cap: int) -> int:
        """The level a call capped at ``cap`` runs (``BEST``: no cap)."""
        return max(level for level in self.simd_levels() if cap == BEST or level <= cap)

    def argmax(self, row: np.ndarray, simd: int = BEST) -> int:
        """``hs_argmax``: a greedy chain's choice from float32 ``row`` at level ``simd``."""
        if not len(row):
            raise ValueError("an empty row has no argmax")
        return self.library.hs_argmax(_pointer(row, np.float32), len(row), simd)

    def pack_q8_0(self, weights: Matrix, packing: int) -> np.ndarray:
        """``weights``' (Q8_0) whole groups of 8 rows in ``hs_matrix.packed``'s layout, values
        of kind ``packing`` (``PACKED_UNSIGNED`` for the VNNI levels, ``PACKED_SIGNED`` for
        AVX2); set its ``packed`` to the result's address and its ``packing`` (and keep the
        result alive) to use them."""
        blocks = weights.cols // BLOCK
        packed = np.empty(weights.rows // 8 * blocks * PACKED_BYTES, np.uint8)
        if self.library.hs_pack_q8_0(ctypes.byref(weights), packing, _pointer(packed, np.uint8)):
            raise ValueError(
                f"only Q8_0 weights are packed, with values of kind "
                f"{PACKED_UNSIGNED} or {PACKED_SIGNED}"
            )
        return packed

    def quantize_rows(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int8 (n, cols) values and float32 (n, cols / 32) block scales of float32 rows."""
        n, cols = x.shape
        if cols % BLOCK:
            raise ValueError(f"rows of {cols} values are not whole blocks of {BLOCK}")
        q = np.empty((n, cols), np.int8)
        scale = np.empty((n, cols // BLOCK), np.float32)
        self.library.hs_quantize_rows(
            _pointer(x, np.float32), n, cols, _pointer(q, np.int8), _pointer(scale, np.float32)
        )
        return q, scale

    def matmul(
        self, weights: Matrix, x: np.ndarray, threads: int = 1, simd: int = BEST
    ) -> np.ndarray:
        """float32 (n, weights.rows): rows ``x`` (n, weights.cols) times the weights, with
        kernels of at most level ``simd``."""
        n = x.shape[0]
        if x.shape != (n, weights.cols):
            raise ValueError(f"x must be (n, {weights.cols}), not {x.shape}")
        out = np.empty((n, weights.rows), np.float32)
        status = self.library.hs_matmul(
            ctypes.byref(weights),
            _pointer(x, np.float32),
            n,
            _pointer(out, np.float32),
            threads,
            simd,
        )
        if status:
            raise ValueError("hs_matmul refused its arguments")
        return out

    def dequantize(self, weights: Matrix, first: int = 0, count: int | None = None) -> np.ndarray:
        """float32 (count, weights.cols): rows first.. of the weights, as ggml dequantizes them."""
        count = weights.rows - first if count is None else count
        out = np.empty((max(count, 0), weights.cols), np.float32)
        if self.library.hs_dequantize_rows(
            ctypes.byref(weights), first, count, _pointer(out, np.float32)
        ):
            raise ValueError(f"rows {first}..{first + count - 1} are not rows of the weights")
        return out

    def forward(
        self,
        model: Model,
        tokens: np.ndarray,
        positions: np.ndarray,
        *,
        start: int,
        prefix: int,
        offsets: np.ndarray,
        visible: np.ndarray,
        first_logit: int,
        logits: np.ndarray,
        threads: int,
    ) -> None:
        """``hs_forward``: evaluate ``tokens`` into cache slots start.., logits into ``logits``."""
        status = self.library.hs_forward(
            ctypes.byref(model),
            len(tokens),
            _pointer(tokens, np.int32),
            _pointer(positions, np.int32),
            start,
            prefix,
            _pointer(offsets, np.int32),
            _pointer(visible, np.int32),
            first_logit,
            _pointer(logits, np.float32),
            threads,
        )
        if status:
            raise ValueError(
                "hs_forward refused its arguments (a token, position, slot or shape out of range)"
            )

    def forward_sequences(
        self,
        model: Model,
        sequences: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        *,
        offsets: np.ndarray,
        visible: np.ndarray,
        logits: np.ndarray,
        threads: int,
    ) -> None:
        """``hs_forward_sequences``: the rows of several sequences in one forward;
        ``sequences`` (n_sequences, 5) int32 in ``SEQUENCE_FIELDS`` order, ``logits`` each
        sequence's rows first_logit.. in turn."""
        if sequences.ndim != 2 or sequences.shape[1] != len(SEQUENCE_FIELDS):
            raise ValueError(f"sequences must be (n, 5), not {sequences.shape}")
        rows, *_, first_logits = sequences.sum(axis=0).tolist()
        outputs = rows - first_logits
        if len(tokens) != rows or len(positions) != rows or len(offsets) != rows + 1:
            raise ValueError(f"{rows} rows need as many tokens and positions, {rows + 1} offsets")
        if offsets[-1] > len(visible):  # (C refuses offsets that decrease before reading)
            raise ValueError(f"offsets must end at most at {len(visible)} visible slots")
        if logits.shape != (outputs, model.vocab):
            raise ValueError(f"logits must be {(outputs, model.vocab)}, not {logits.shape}")
        status = self.library.hs_forward_sequences(
            ctypes.byref(model),
            len(sequences),
            _pointer(sequences, np.int32),
            _pointer(tokens, np.int32),
            _pointer(positions, np.int32),
            _pointer(offsets, np.int32),
            _pointer(visible, np.int32),
            _pointer(logits, np.float32),
            threads,
        )
        if status:
            raise ValueError(
                "hs_forward_sequences refused its arguments (a token, position, slot or shape "
                "out of range, or sequences whose slots overlap)"
            )

    def draft_branches(
        self,
        model: Model,
        tokens: np.ndarray,
        *,
        position: int,
        start: int,
        prefix: int,
        base: np.ndarray,
        logits: np.ndarray,
        probs: np.ndarray | None,
        threads: int,
    ) -> None:
        """``hs_draft_branches``: ``tokens`` (steps + 1, branches) int32, row 0 the first
        tokens, each next row the argmax of the last one's rows; ``logits`` (steps x branches,
        vocab); ``probs`` (branches, steps + 1, vocab), C-contiguous: rows [:, 1:] get the
        softmax of each row (rows [:, 0] untouched)."""
        count, branches = tokens.shape[0] - 1, tokens.shape[1]
        rows, stride = None, 0
        if probs is not None:
            if (
                probs.dtype != np.float32
                or not probs.flags.c_contiguous
                or probs.shape != (branches, count + 1, logits.shape[1])
            ):
                raise ValueError(
                    f"probs must be C-contiguous float32 {(branches, count + 1, logits.shape[1])}"
                )
            rows = ctypes.c_void_p(probs.ctypes.data + probs.strides[1])  # row [0, 1]
            stride = probs.shape[1] * probs.shape[2]
        status = self.library.hs_draft_branches(
            ctypes.byref(model),
            branches,
            count,
            _pointer(tokens, np.int32),
            position,
            start,
            prefix,
            _pointer(base, np.int32),
            len(base),
            _pointer(logits, np.float32),
            rows,
            ctypes.c_longlong(stride),
            threads,
        )
        if status:
            raise ValueError(
                "hs_draft_branches refused its arguments (a token, position, slot "
                "or shape out of range)"
            )

    def draft_chain(
        self,
        model: Model,
        tokens: np.ndarray,
        *,
        position: int,
        start: int,
        prefix: int,
        base: np.ndarray,
        logits: np.ndarray,
        temperature: float = 1.0,
        noise: np.ndarray | None = None,
        uniforms: np.ndarray | None = None,
        probs: np.ndarray | None = None,
        threads: int,
    ) -> None:
        """``hs_draft_chain``: ``len(tokens) - 1`` forwards, each next token the argmax (the
        softmax rows to ``probs`` where given), or chosen by ``noise`` or ``uniforms`` from
        softmax(logits / ``temperature``), whose rows go to ``probs``."""
        sampled = noise is not None or uniforms is not None
        inverse = ctypes.c_float(1 / temperature if sampled else 1)  # greedy: temperature 0
        status = self.library.hs_draft_chain(
            ctypes.byref(model),
            len(tokens) - 1,
            _pointer(tokens, np.int32),
            position,
            start,
            prefix,
            _pointer(base, np.int32),
            len(base),
            _pointer(logits, np.float32),
            None if noise is None else _pointer(noise, np.float32),
            None if uniforms is None else _pointer(uniforms, np.float64),
            inverse,
            None if probs is None else _pointer(probs, np.float32),
            threads,
        )
        if status:
            raise ValueError(
                "hs_draft_chain refused its arguments (a token, position, slot "
                "or shape out of range, or draws without probabilities)"
            )
