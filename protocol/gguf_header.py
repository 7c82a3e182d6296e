"""A GGUF file's header read fast: its key-value fields and tensor table, the data mapped.

The daemon (model facts, chat templates) and the workers (the native kernels) read model files'
headers. gguf-py's ``GGUFReader`` builds a numpy view for every entry of every array, which
takes it 4-8 s on a 152K- or 262K-token vocabulary (Qwen, Gemma 3); this walks the same bytes
with ``struct`` and skips the arrays of strings (the vocabulary, its merges) unless asked, so
a header reads in milliseconds. Little-endian files (every file llama.cpp writes here); the
format is gguf-py's ``GGUFWriter``'s, versions 2 and 3, laid out as llama.cpp reads it back: no
key or tensor twice, tensors of at most 4 dimensions whose rows are whole blocks, stored back to
back in the order listed. A header that breaks a rule is refused (``GGUFFormatError``): such a
file is crafted, and its tensors' data may overlap. What the metadata says of the model is
checked against the tensors by ``protocol.gguf_checks``.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type id -> struct format of a scalar of it (8: string, 9: array)
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
NUMPY_TYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
STRING, ARRAY, UINT32 = 8, 9, 4
MAX_NESTING = 8  # arrays of arrays: llama.cpp writes none; a deep nest is a crafted file
MAX_DIMS = 4  # of a tensor: ggml's GGML_MAX_DIMS


class GGUFFormatError(ValueError):
    """Not a GGUF file this reads; the message says why."""


@dataclass(frozen=True)
class SkippedStrings:
    """An array of ``count`` strings not read (``read_gguf_header(strings=False)``)."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ``shape`` in GGUF's order (the row length first), ``type`` ggml's id,
    ``offset`` from the start of the file, ``nbytes`` of data."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def type_name(self) -> str:
        """ggml's name of the type ("Q8_0"); read_gguf_header admits only types gguf-py knows."""
        from gguf.constants import GGMLQuantizationType  # noqa: PLC0415

        return GGMLQuantizationType(self.type).name


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    fields: dict[str, object]  # scalars, strings, lists (of numbers or strings) or SkippedStrings
    tensors: dict[str, TensorInfo]
    data_offset: int
    types: dict[str, int] = field(default_factory=dict)  # each field's value type id (SCALARS')

    @functools.cached_property
    def _mapped(self) -> np.memmap:
        return np.memmap(self.path, np.uint8, "r")

    def tensor_data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only view of the file, mapped once (the pages are the
        page cache's, shared with every process that maps the file): float32 (rows, cols) for
        F32, float16 for F16, else uint8 (rows, bytes per row)."""
        mapped = self._mapped[tensor.offset : tensor.offset + tensor.nbytes]
        rows = int(np.prod(tensor.shape[1:], dtype=np.int64))
        if tensor.type in (0, 1):  # F32, F16
            view = mapped.view(np.float32 if tensor.type == 0 else np.float16)
            return view.reshape(*reversed(tensor.shape)) if len(tensor.shape) > 1 else view
        return mapped.reshape(rows, -1)


def type_bytes(ggml_type: int, shape: tuple[int, ...], path: Path) -> int:
    """Bytes of a tensor of ``shape`` (GGUF's order) in ggml type ``ggml_type`` (gguf-py's
    table of sizes); its rows must be whole blocks, as llama.cpp requires."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"{path}: unknown tensor type {ggml_type}") from None
    row = shape[0] if shape else 1
    if row % block:
        raise GGUFFormatError(f"{path}: rows of {row} values are not whole blocks of {block}")
    # Python's integers: [2**32, 2**32] must not wrap to 0
    return math.prod(shape) // block * size


class _Cursor:
    def __init__(self, data: bytes | memoryview, path: Path) -> None:
        self.data, self.at, self.path = data, 0, path
        self.depth = 0  # of the arrays of arrays being read

    def take(self, fmt: str) -> object:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.data):
            raise GGUFFormatError(f"{self.path}: the header ends early (at byte {self.at})")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return value

    def string(self) -> str:
        length = self.take("Q")
        end = self.at + length
        if end > len(self.data):
            raise GGUFFormatError(f"{self.path}: a string runs past the end of the file")
        text = bytes(self.data[self.at : end]).decode("utf-8", errors="replace")
        self.at = end
        return text

    def skip_string(self) -> None:
        length = self.take("Q")  # (not `self.at += self.take(...)`: that adds to the old at)
        self.at += length

    def value(self, kind: int, strings: bool) -> object:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown value type {kind} at byte {self.at}")
        item, count = self.take("I"), self.take("Q")
        if item in NUMPY_TYPES:
            dtype = np.dtype(NUMPY_TYPES[item]).newbyteorder("<")
            end = self.at + count * dtype.itemsize
            if end > len(self.data):
                raise GGUFFormatError(f"{self.path}: an array runs past the end of the file")
            values = np.frombuffer(self.data, dtype, count, self.at).tolist()
            self.at = end
            return values
        if item == STRING:
            if strings:
                return [self.string() for _ in range(count)]
            for _ in range(count):
                self.skip_string()
            return SkippedStrings(count)
        if self.depth >= MAX_NESTING:
            raise GGUFFormatError(
                f"{self.path}: arrays nested more than {MAX_NESTING} deep (at byte {self.at})"
            )
        self.depth += 1
        try:
            return [self.value(item, strings) for _ in range(count)]  # arrays of arrays
        finally:
            self.depth -= 1


def read_gguf_header(path: str | Path, *, strings: bool = False) -> GGUFHeader:
    """The header of the GGUF file at ``path``; arrays of strings are read only with
    ``strings`` (else ``SkippedStrings``). Raises ``GGUFFormatError`` or ``OSError``."""
    path = Path(path)
    with open(path, "rb") as file:
        mapped = np.memmap(file, np.uint8, "r") if path.stat().st_size else b""
    data = memoryview(mapped) if len(mapped) else b""
    if bytes(data[:4]) != MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (no GGUF magic)")
    cursor = _Cursor(data, path)
    cursor.at = 4
    version = cursor.take("I")
    if version not in (2, 3):
        raise GGUFFormatError(
            f"{path}: GGUF version {version} (this reads 2 and 3; a "
            "big-endian file reads as a huge version)"
        )
    tensor_count, field_count = cursor.take("Q"), cursor.take("Q")
    fields: dict[str, object] = {}
    types: dict[str, int] = {}
    for _ in range(field_count):
        key = cursor.string()
        if key in fields:
            raise GGUFFormatError(f"{path}: key {key!r:.60} appears twice")
        types[key] = cursor.take("I")
        fields[key] = cursor.value(types[key], strings)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.take("I")
        if dims > MAX_DIMS:
            raise GGUFFormatError(
                f"{path}: tensor {name!r:.60} has {dims} dimensions (ggml's most: {MAX_DIMS})"
            )
        shape = tuple(cursor.take("Q") for _ in range(dims))
        infos.append((name, shape, cursor.take("I"), cursor.take("Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    uint32 = types.get("general.alignment", UINT32) == UINT32
    if not uint32 or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(
            f"{path}: alignment {alignment!r:.40} is not a power of two in a uint32"
        )
    data_offset = -(-cursor.at // alignment) * alignment
    tensors = {}
    end = 0  # of the tensors so far, in the data: llama.cpp reads them back to back, in order
    for name, shape, kind, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"{path}: tensor {name!r:.60} is listed twice")
        nbytes = type_bytes(kind, shape, path)
        start = data_offset + offset
        if start + nbytes > len(data):
            raise GGUFFormatError(f"{path}: tensor {name!r:.60} runs past the end of the file")
        if offset != end:
            raise GGUFFormatError(
                f"{path}: tensor {name!r:.60} starts at {offset} in the data, "
                f"where the tensors before it end at {end}"
            )
        end += -(-nbytes // alignment) * alignment
        tensors[name] = TensorInfo(name, shape, kind, start, nbytes)
    return GGUFHeader(path, version, fields, tensors, data_offset, types)
