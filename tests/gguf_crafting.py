"""Crafted GGUF files: a real file's header rewritten, its tensor data kept byte for byte.

``RawGGUF.read`` takes a file apart (gguf-py's reader finds each field's bytes); a test
changes, adds or removes fields and tensor infos, and ``write`` puts the file back together:
untouched fields keep their exact bytes, a field set here is encoded anew (any type, so a
count may become a string or a float), and the tensor data follows the new header at the
same alignment, whatever the tensor infos now say about it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from pathlib import Path

import gguf

T = gguf.GGUFValueType
SCALAR_FORMATS = {
    T.UINT8: "B",
    T.INT8: "b",
    T.UINT16: "H",
    T.INT16: "h",
    T.UINT32: "I",
    T.INT32: "i",
    T.FLOAT32: "f",
    T.BOOL: "?",
    T.UINT64: "Q",
    T.INT64: "q",
    T.FLOAT64: "d",
}
ALIGNMENT = 32  # the files here keep gguf-py's default


def encode(kind: T, value: object, item: T | None = None) -> bytes:
    """The bytes of one value of type ``kind`` (its type id not included); arrays of
    scalars or strings with ``item``."""
    if kind == T.STRING:
        data = str(value).encode()
        return struct.pack("<Q", len(data)) + data
    if kind == T.ARRAY:
        assert item is not None
        return struct.pack("<IQ", item, len(value)) + b"".join(encode(item, v) for v in value)
    return struct.pack("<" + SCALAR_FORMATS[kind], value)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # GGUF's order: the row length first
    type: int  # ggml's type id
    offset: int  # from the start of the data

    def encoded(self) -> bytes:
        name = self.name.encode()
        return (
            struct.pack("<Q", len(name))
            + name
            + struct.pack("<I", len(self.dims))
            + b"".join(struct.pack("<Q", d) for d in self.dims)
            + struct.pack("<IQ", self.type, self.offset)
        )


@dataclass
class RawGGUF:
    """A GGUF file taken apart: ``fields`` maps a key to its type id and value bytes."""

    fields: dict[str, tuple[int, bytes]]
    tensors: list[TensorEntry]
    data: bytes
    version: int = 3

    @classmethod
    def read(cls, path: Path) -> RawGGUF:
        reader = gguf.GGUFReader(path)
        fields = {}
        for name, found in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            kind = int(found.parts[2][0])
            fields[name] = (kind, b"".join(part.tobytes() for part in found.parts[3:]))
        tensors = [
            TensorEntry(
                t.name,
                tuple(int(d) for d in t.field.parts[3]),
                int(t.tensor_type),
                int(t.field.parts[5][0]),
            )
            for t in reader.tensors
        ]
        start = min(int(t.data_offset) for t in reader.tensors) - min(e.offset for e in tensors)
        return cls(fields, tensors, path.read_bytes()[start:])

    def copy(self) -> RawGGUF:
        return RawGGUF(dict(self.fields), list(self.tensors), self.data, self.version)

    def set(self, key: str, kind: T, value: object, item: T | None = None) -> RawGGUF:
        self.fields[key] = (int(kind), encode(kind, value, item))
        return self

    def drop(self, key: str) -> RawGGUF:
        del self.fields[key]
        return self

    def tensor(self, name: str) -> int:
        return next(i for i, t in enumerate(self.tensors) if t.name == name)

    def reshape(self, name: str, dims: tuple[int, ...]) -> RawGGUF:
        index = self.tensor(name)
        self.tensors[index] = replace(self.tensors[index], dims=dims)
        return self

    def write(self, path: Path) -> Path:
        head = b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.fields))
        for key, (kind, value) in self.fields.items():
            head += encode(T.STRING, key) + struct.pack("<I", kind) + value
        head += b"".join(t.encoded() for t in self.tensors)
        head += bytes(-len(head) % ALIGNMENT)
        path.write_bytes(head + self.data)
        return path


def crafted_copy(source: Path, target: Path, values: dict[str, tuple[T, object]]) -> Path:
    """``source`` written to ``target`` with the fields of ``values`` (key -> (type, value))
    set."""
    raw = RawGGUF.read(source)
    for key, (kind, value) in values.items():
        raw.set(key, kind, value)
    return raw.write(target)
