"""A GGUF's model metadata checked against its own tensors, before anything is sized by it.

A loader sizes what it allocates by the file's metadata: ``block_count`` layers, RoPE tables
``key_length`` wide, a KV cache of ``head_count_kv`` heads. A crafted file may state any
number there (2**28 blocks made the native loader take 2.1 GB before it failed, 0 heads
raised ZeroDivisionError, a string for a number "could not convert string to float").
``check_model`` reads those numbers as llama.cpp reads them, GGUF types included, and holds
them against the tensor table: a file whose metadata contradicts itself or its tensors is
refused with one line naming the key (and so are a file without a vocabulary and one whose
tensors are not 32-byte aligned, which llama.cpp loads and then aborts on). The daemon at
start-up, ``hetspec models check`` and the workers' loaders (the native kernels', llama.cpp's)
all call it, so they refuse the same files in the same words, before any of them allocates by
the file's numbers.

The checks are those of llama.cpp's llama-family layouts, the ones the native kernels run
(``CHECKED_ARCHITECTURES``: token_embd, blk.N.attn_q/k/v/output, ffn_gate/up/down). Another
architecture is llama.cpp's to judge (it may load it): only that the file names one is
checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hetspec.protocol.gguf_header import ARRAY, STRING, GGUFHeader, SkippedStrings, read_gguf_header

CHECKED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
UINT32, FLOAT32 = 4, 6  # the GGUF value types llama.cpp reads counts and reals as, exactly
TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
}
MAX_CONTEXT = 2**31 - 1  # positions are int32 in every runtime here
TENSOR_ALIGNMENT = 32  # ggml's: a tensor mapped from the file must start on such a boundary
NO_VOCABULARY = ("none", "no_vocab")  # tokenizer.ggml.model's names for a file without one
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")  # llama.cpp's names (it aborts on others)
# optional real-valued settings the loaders read (Gemma's among them): key -> whether it must be
# positive (else at least 0, where 0 means "none")
REAL_SETTINGS = {
    "rope.freq_base": True,
    "rope.scaling.factor": True,
    "rope.freq_base_swa": False,
    "attn_logit_softcapping": False,
    "final_logit_softcapping": False,
}


class GGUFMetadataError(ValueError):
    """A GGUF file whose metadata contradicts itself or its tensors; the message, one line,
    names the file and the key."""


@dataclass(frozen=True)
class ModelShape:
    """A checked file's numbers, as llama.cpp reads them (its defaults applied)."""

    architecture: str
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    key_length: int  # per head, as rope.dimension_count (whole heads rotate)
    value_length: int  # per head
    vocab_size: int  # token_embd's rows
    context_length: int  # the trained context
    rope_scaling: str  # one of ROPE_SCALINGS
    experts: int  # of a mixture of experts (Mixtral's layout: ffn_*_exps); 0: a dense model


def check_model_file(path: str | Path) -> ModelShape | None:
    """``check_model`` of the file at ``path``; raises ``GGUFFormatError`` (not a GGUF file
    read here), ``GGUFMetadataError`` or ``OSError``."""
    return check_model(read_gguf_header(path))


def check_model(header: GGUFHeader) -> ModelShape | None:
    """The numbers of a ``CHECKED_ARCHITECTURES`` file, checked against its tensors (None for
    another architecture); ``GGUFMetadataError`` says what contradicts what. Reads the
    header only, in time and memory of the order of its tensor table."""
    return _Checker(header).shape()


def _shown(value: object) -> str:
    """A value for one line of text: strings quoted (a newline escaped), long ones cut."""
    if isinstance(value, SkippedStrings):
        return f"an array of {value.count} strings"
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _shape(dims: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, dims)) + ")"


class _Checker:
    def __init__(self, header: GGUFHeader) -> None:
        self.header = header
        self.fields, self.tensors = header.fields, header.tensors
        self.architecture = ""

    def refuse(self, reason: str) -> GGUFMetadataError:
        return GGUFMetadataError(f"{self.header.path}: {reason}")

    def shape(self) -> ModelShape | None:
        architecture = self.fields.get("general.architecture")
        if architecture is None:
            raise self.refuse("lacks general.architecture")
        if self.header.types.get("general.architecture") != STRING:
            raise self.refuse(f"general.architecture is {_shown(architecture)}, not a name")
        tokenizer = self.fields.get("tokenizer.ggml.model")
        if tokenizer in NO_VOCABULARY:  # llama.cpp loads it, then aborts when asked for tokens
            raise self.refuse(f"tokenizer.ggml.model is {tokenizer!r}: no vocabulary to serve")
        for tensor in self.tensors.values():
            if tensor.offset % TENSOR_ALIGNMENT:  # a smaller general.alignment; llama.cpp aborts
                raise self.refuse(
                    f"tensor {tensor.name!r:.60} starts at byte {tensor.offset}, "
                    f"off ggml's {TENSOR_ALIGNMENT}-byte boundaries"
                )
        if architecture not in CHECKED_ARCHITECTURES:
            return None
        self.architecture = architecture
        width = self.count("embedding_length")
        heads = self.count("attention.head_count")
        kv_heads = self.count("attention.head_count_kv", heads)
        if heads % kv_heads:
            raise self.refuse(
                f"{self.key('attention.head_count')} {heads} is not a multiple of "
                f"head_count_kv {kv_heads}"
            )
        per_head = width // heads
        stated = all(self.key(f"attention.{n}_length") in self.fields for n in ("key", "value"))
        if not per_head and not stated:
            raise self.refuse(
                f"{self.key('attention.head_count')} {heads} is more than "
                f"embedding_length {width}, and no key_length and value_length "
                "say how wide a head is"
            )
        key_length = self.count("attention.key_length", per_head)
        rotated = self.count("rope.dimension_count", key_length)
        if rotated != key_length:
            raise self.refuse(
                f"{self.key('rope.dimension_count')} {rotated} is not key_length "
                f"{key_length} (only whole heads rotate)"
            )
        shape = ModelShape(
            architecture,
            self.count("block_count"),
            width,
            self.count("feed_forward_length"),
            heads,
            kv_heads,
            key_length,
            self.count("attention.value_length", per_head),
            self.vocab(width),
            self.count("context_length"),
            self.rope_scaling(),
            self.experts(),
        )
        if shape.context_length > MAX_CONTEXT:
            raise self.refuse(
                f"{self.key('context_length')} {shape.context_length} is over "
                f"{MAX_CONTEXT} positions"
            )
        self.check_settings(shape)
        self.check_blocks(shape)
        return shape

    def key(self, name: str) -> str:
        return f"{self.architecture}.{name}"

    def count(self, name: str, default: int | None = None) -> int:
        """The positive uint32 ``{architecture}.{name}`` (``default`` where absent: None, it
        is needed)."""
        key = self.key(name)
        value = self.fields.get(key)
        if value is None:
            if default is None:
                raise self.refuse(f"lacks {key}")
            return default
        kind = self.header.types.get(key)
        if kind != UINT32:
            raise self.refuse(
                f"{key} is {_shown(value)} ({TYPE_NAMES.get(kind, kind)}), where "
                "llama.cpp reads a uint32"
            )
        if value == 0:
            raise self.refuse(f"{key} is 0")
        return value

    def typed(self, name: str, *kinds: int) -> object:
        """``{architecture}.{name}`` where it is of one of the types ``kinds``, or None."""
        key = self.key(name)
        value, kind = self.fields.get(key), self.header.types.get(key)
        if value is not None and kind not in kinds:
            wanted = " or ".join(f"a {TYPE_NAMES[k]}" for k in kinds)
            raise self.refuse(
                f"{key} is {_shown(value)} ({TYPE_NAMES.get(kind, kind)}), where {wanted} belongs"
            )
        return value

    def rope_scaling(self) -> str:
        scaling = self.typed("rope.scaling.type", STRING)
        if scaling is not None and scaling not in ROPE_SCALINGS:
            raise self.refuse(
                f"{self.key('rope.scaling.type')} is {_shown(scaling)}, not one of "
                f"llama.cpp's {', '.join(ROPE_SCALINGS)}"
            )
        return scaling or "none"

    def experts(self) -> int:
        return self.typed("expert_count", UINT32) or 0

    def real(self, name: str, *, positive: bool, needed: bool = False) -> None:
        key = self.key(name)
        value = self.fields.get(key)
        if value is None:
            if needed:
                raise self.refuse(f"lacks {key}")
            return
        kind = self.header.types.get(key)
        if kind != FLOAT32:
            raise self.refuse(
                f"{key} is {_shown(value)} ({TYPE_NAMES.get(kind, kind)}), where "
                "llama.cpp reads a float32"
            )
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            wanted = "a positive number" if positive else "a number of at least 0"
            raise self.refuse(f"{key} is {_shown(value)}, where {wanted} belongs")

    def check_settings(self, shape: ModelShape) -> None:
        """The other settings the loaders read, of the types they read them as."""
        self.real("attention.layer_norm_rms_epsilon", positive=True, needed=True)
        for name, positive in REAL_SETTINGS.items():
            self.real(name, positive=positive)
        self.typed("attention.sliding_window", UINT32)
        pattern = self.typed("attention.sliding_window_pattern", UINT32, ARRAY)
        if isinstance(pattern, list) and len(pattern) != shape.block_count:
            raise self.refuse(
                f"{self.key('attention.sliding_window_pattern')} has "
                f"{len(pattern)} entries for {shape.block_count} blocks"
            )

    def vocab(self, width: int) -> int:
        """token_embd's rows, which the vocabulary's size and the output's rows must equal."""
        embed = self.tensor("token_embd.weight", (width, None), f"embedding_length {width}")
        rows = embed[1]
        stated = self.fields.get(self.key("vocab_size"))
        if stated is not None and self.count("vocab_size") != rows:
            raise self.refuse(
                f"{self.key('vocab_size')} {stated} does not match token_embd.weight's {rows} rows"
            )
        tokens = self.fields.get("tokenizer.ggml.tokens")
        listed = tokens.count if isinstance(tokens, SkippedStrings) else None
        listed = len(tokens) if isinstance(tokens, list) else listed
        if listed is not None and listed != rows:
            raise self.refuse(
                f"tokenizer.ggml.tokens lists {listed} tokens for token_embd.weight's {rows} rows"
            )
        if "output.weight" in self.tensors:
            self.tensor(
                "output.weight",
                (width, rows),
                f"embedding_length {width}, token_embd.weight's {rows} rows",
            )
        self.tensor("output_norm.weight", (width,), f"embedding_length {width}")
        return rows

    def check_blocks(self, shape: ModelShape) -> None:
        """blk.0 .. blk.{block_count - 1}, each with the tensors of its shape."""
        present = set()
        for name in self.tensors:
            index, _, rest = name.removeprefix("blk.").partition(".")
            if name.startswith("blk.") and rest and index.isascii() and index.isdigit():
                present.add(int(index))
        whole = len(present) == max(present, default=-1) + 1  # blk.0 .. blk.{n - 1}, no gaps
        if not whole or len(present) != shape.block_count:
            found = f"{len(present)} blocks of tensors" if present else "no blk.N tensors"
            found += f" (blk.0 to blk.{max(present)})" if present and whole else ""
            raise self.refuse(
                f"{self.key('block_count')} is {shape.block_count} but the file has {found}"
            )
        w, f = shape.embedding_length, shape.feed_forward_length
        queries = shape.head_count * shape.key_length
        keys = shape.head_count_kv * shape.key_length
        values = shape.head_count_kv * shape.value_length
        outputs = shape.head_count * shape.value_length
        width, ff = f"embedding_length {w}", f"feed_forward_length {f}"
        heads = f"head_count {shape.head_count}"
        kv_heads = f"head_count_kv {shape.head_count_kv}"
        key, value = f"key_length {shape.key_length}", f"value_length {shape.value_length}"
        expected = {  # (a mixture of experts' feed-forward tensors are llama.cpp's to check)
            "attn_norm": ((w,), width),
            "ffn_norm": ((w,), width),
            "attn_q": ((w, queries), f"{width}, {heads} x {key}"),
            "attn_k": ((w, keys), f"{width}, {kv_heads} x {key}"),
            "attn_v": ((w, values), f"{width}, {kv_heads} x {value}"),
            "attn_output": ((outputs, w), f"{heads} x {value}, {width}"),
            "ffn_gate": ((w, f), f"{width}, {ff}"),
            "ffn_up": ((w, f), f"{width}, {ff}"),
            "ffn_down": ((f, w), f"{ff}, {width}"),
        }
        if shape.experts:
            del expected["ffn_gate"], expected["ffn_up"], expected["ffn_down"]
        for index in range(shape.block_count):
            for part, (dims, why) in expected.items():
                self.tensor(f"blk.{index}.{part}.weight", dims, why)

    def tensor(self, name: str, dims: tuple[int | None, ...], why: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, which must be ``dims`` (None: any) as ``why`` says."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise self.refuse(f"lacks tensor {name}")
        if len(tensor.shape) != len(dims) or any(
            want is not None and want != got for want, got in zip(dims, tensor.shape, strict=False)
        ):
            wanted = _shape(tuple("*" if d is None else d for d in dims))
            raise self.refuse(
                f"{name} has shape {_shape(tensor.shape)}, not {wanted} as the "
                f"metadata says ({self.architecture}.{why})"
            )
        return tensor.shape
